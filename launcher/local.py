"""Local execution: a bounded queue in front of submitit's LocalExecutor.

submitit's LocalExecutor starts every submitted job at once; a sweep of 40 runs on a 2-core
machine would thrash. Submission here only records queued attempts in the store. A detached
scheduler process (`python -m launcher.local`, one per database) starts them through submitit
as slots free up, never more than `max_parallel` at once, records how each ended, and exits when
the queue is empty. `sweep launch` and `sweep status` start it whenever queued work has no
scheduler, so a reboot or a killed scheduler loses nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from store import AttemptRecord, AttemptState, RunRecord, RunState, Store

EXECUTOR = "local"
JOB_TIMEOUT_MIN = 7 * 24 * 60  # submitit's local default is 2 minutes
POLL_S = 0.5


def lock_path(db_url: str) -> Path:
    cache = Path(os.environ.get("SWEEP_CACHE", Path.home() / ".cache" / "scalesweep"))
    digest = hashlib.sha256(db_url.encode()).hexdigest()[:16]
    return cache / "locks" / f"local-queue-{digest}.lock"


def default_parallelism() -> int:
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------------------------
# Submission side (the CLI process)


def submit(store: Store, runs: Sequence[RunRecord], *, max_parallel: int | None = None) -> None:
    """Queue the runs and make sure a scheduler will start them."""
    store.record_submissions(EXECUTOR, [{"run_id": run.id} for run in runs], RunState.QUEUED)
    ensure_scheduler(store, max_parallel=max_parallel)


def ensure_scheduler(store: Store, *, max_parallel: int | None = None) -> bool:
    """Start a detached scheduler if queued work exists and none is running; True if started."""
    if not store.queued_attempts(EXECUTOR, limit=1) or _lock_held(lock_path(store.url)):
        return False
    log_file = lock_path(store.url).with_suffix(".log")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "launcher.local", "--max-parallel", str(max_parallel or default_parallelism())]
    env = {**os.environ, "SWEEP_DB": store.url}  # in the environment, not argv: it may hold a password
    with open(log_file, "ab") as log:
        subprocess.Popen(args, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    return True


def _lock_held(path: Path) -> bool:
    lock = _try_lock(path)
    if lock is None:
        return True
    lock.release()
    return False


# ---------------------------------------------------------------------------------------------
# The scheduler (a detached process)


@dataclass
class Slot:
    attempt: AttemptRecord
    run: RunRecord
    job: Any  # submitit.local.local.LocalJob


def serve(store: Store, max_parallel: int) -> None:
    """Start queued attempts as slots free up; return when nothing is queued or running."""
    handle = _try_lock(lock_path(store.url))
    if handle is None:
        return  # another scheduler serves this database
    slots: list[Slot] = []
    try:
        while True:
            slots = _reap(store, slots)
            free = max_parallel - len(slots)
            if free > 0:
                slots += [_start(store, a) for a in store.queued_attempts(EXECUTOR, limit=free)]
            if not slots and not store.queued_attempts(EXECUTOR, limit=1):
                # Release, then look once more: a launch that queued work after our last look
                # either sees the lock free and starts a scheduler, or we see its work here.
                handle.release()
                handle = None
                if not store.queued_attempts(EXECUTOR, limit=1) or (handle := _try_lock(lock_path(store.url))) is None:
                    return
            time.sleep(POLL_S)
    finally:
        if handle is not None:
            handle.release()


def _start(store: Store, attempt: AttemptRecord) -> Slot:
    import submitit

    from launcher.job import run_recipe

    run = store.get_run(attempt.run_id)
    executor = submitit.LocalExecutor(folder=Path(run.run_dir) / "logs")
    executor.update_parameters(timeout_min=JOB_TIMEOUT_MIN)
    job = executor.submit(run_recipe, run.run_dir)
    store.update_attempt(
        attempt.id,
        state=AttemptState.PENDING,
        job_id=str(job.job_id),
        stdout_path=str(job.paths.stdout),
        stderr_path=str(job.paths.stderr),
    )
    print(f"started run {run.id} (attempt {attempt.number}) as local job {job.job_id}", flush=True)
    return Slot(attempt=attempt, run=run, job=job)


def _reap(store: Store, slots: list[Slot]) -> list[Slot]:
    running = []
    for slot in slots:
        if slot.job.done():
            _record_end(store, slot)
        else:
            running.append(slot)
    return running


def _record_end(store: Store, slot: Slot) -> None:
    """The job process is gone. It records its own success or stop; a crash or a kill it cannot
    record, so that is written here, with the cause and the log path."""
    run_id = slot.run.id
    if not slot.job.paths.result_pickle.exists():
        # (Asking submitit would wait 15 s for a result file that a killed job never writes.)
        cause = "the job process ended without a result: killed by a signal (e.g. SIGKILL) or out of memory"
    else:
        try:
            slot.job.result()
            return
        except Exception as exc:  # noqa: BLE001 - any failure of the job is reported, not raised
            cause = _failure_cause(exc)
    reason = f"{cause} (log: {slot.job.paths.stderr})"
    state = RunState.CANCELLED if store.get_run(run_id).state == RunState.CANCELLED else RunState.FAILED
    if store.settle_attempt(slot.attempt.id, state, reason):
        print(f"run {run_id} {state}: {reason}", flush=True)


def _failure_cause(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _try_lock(path: Path) -> FileLock | None:
    """The scheduler's lock if nobody holds it, else None (never waits)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launcher.local", description=__doc__)
    parser.add_argument("--max-parallel", type=int, default=default_parallelism())
    args = parser.parse_args(argv)
    store = Store()  # $SWEEP_DB
    print(f"local scheduler {os.getpid()} serving {store.display_url} with {args.max_parallel} slots", flush=True)
    serve(store, args.max_parallel)


if __name__ == "__main__":
    _main()
