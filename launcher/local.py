"""Local execution: a bounded queue in front of submitit's LocalExecutor.

submitit's LocalExecutor starts every submitted job at once; a sweep of 40 runs on a 2-core
machine would thrash. Submission here only records queued attempts in the store. A detached
scheduler process (`python -m launcher.local`, one per database) starts them through submitit
as slots free up, never more than `max_parallel` at once, records how each ended, and exits when
the queue is empty. `sweep launch` and `sweep status` start it whenever queued work has no
scheduler, so a reboot or a killed scheduler loses nothing.

While it serves runs of a sweep that has a `prune:` policy, the scheduler runs `sweep status
SWEEP` every $SWEEP_PRUNE_POLL_S seconds (default 30) in a child process: the status's sync step
applies the policy live (the scheduler itself knows nothing of fits), so pruning happens even
when nobody watches.

The limit lives in a file beside the scheduler's lock (not in the scheduler's memory), and a
scheduler counts the live jobs that an earlier, killed scheduler left running: so a scheduler that
`sweep status` restarts after a SIGKILL keeps `--max-parallel` (docs/decisions.md, "Local limit").

A run of `resources.tasks_per_node: T` tasks (trainer and generator ranks, `recipe.pipeline`) is one
submitit job of T processes, each with the task environment that submitit's local executor gives
(SUBMITIT_LOCAL_GLOBALID, ..., read by `recipe.pipeline.env.task_env` as srun's are on Slurm); it takes T
of the `max_parallel` slots (one core each). A task that fails stops the job's other tasks at
once and fails the run with that task's cause and log (docs/decisions.md, "Local multi-task runs").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from recipe.config import cache_root
from store import AttemptRecord, AttemptState, RunRecord, RunState, Store

EXECUTOR = "local"
JOB_TIMEOUT_MIN = 7 * 24 * 60  # submitit's local default is 2 minutes
POLL_S = 0.5
PRUNE_POLL_S = 30.0


def lock_path(db_url: str) -> Path:
    cache = cache_root()
    digest = hashlib.sha256(db_url.encode()).hexdigest()[:16]
    return cache / "locks" / f"local-queue-{digest}.lock"


def limit_path(db_url: str) -> Path:
    return lock_path(db_url).with_suffix(".limit")


def default_parallelism() -> int:
    return len(os.sched_getaffinity(0))


def check_parallelism(max_parallel: int) -> int:
    if max_parallel < 1:
        raise ValueError(f"--max-parallel must be >= 1 (runs at once), got {max_parallel}")
    return max_parallel


def save_limit(db_url: str, max_parallel: int) -> None:
    """Make `max_parallel` the limit of this database's scheduler, now and after a restart."""
    path = limit_path(db_url)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(f"{check_parallelism(max_parallel)}\n")
    os.replace(staging, path)


def read_limit(db_url: str) -> int:
    """The saved limit; the number of cores if none was saved (or the file is unreadable)."""
    try:
        value = int(limit_path(db_url).read_text().strip())
    except (OSError, ValueError):
        return default_parallelism()
    return value if value >= 1 else default_parallelism()


# ---------------------------------------------------------------------------------------------
# Submission side (the CLI process)


def submit(store: Store, runs: Sequence[RunRecord], *, max_parallel: int | None = None) -> None:
    """Queue the runs and make sure a scheduler will start them. What can be checked here (the
    limit, the run directories) is checked before anything is queued; a scheduler that cannot be
    started withdraws the queued runs again (back to `registered`, with the cause)."""
    if max_parallel is not None:
        save_limit(store.url, max_parallel)
    for run in runs:
        (Path(run.run_dir) / "logs").mkdir(parents=True, exist_ok=True)  # submitit's folder
    store.record_submissions(EXECUTOR, [{"run_id": run.id} for run in runs], RunState.QUEUED)
    try:
        ensure_scheduler(store)
    except Exception as exc:
        store.withdraw_submissions([r.id for r in runs], f"submission failed: could not start the scheduler: {exc}")
        raise


def ensure_scheduler(store: Store, *, max_parallel: int | None = None) -> bool:
    """Start a detached scheduler if queued work exists and none is running; True if started.
    A given `max_parallel` becomes the limit (saved), also of a scheduler already running."""
    if max_parallel is not None:
        save_limit(store.url, max_parallel)
    if not store.queued_attempts(EXECUTOR, limit=1) or _lock_held(lock_path(store.url)):
        return False
    log_file = _log_file(store)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "launcher.local"]  # the limit comes from limit_path
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
    num_tasks: int = 1
    """The job's processes: the slots it takes."""


def _resources(store: Store, run: RunRecord) -> dict[str, Any]:
    sweep = store.get_sweep(run.sweep)
    return (sweep.spec.get("resources") if sweep is not None else None) or {}


def run_tasks(store: Store, run: RunRecord) -> int:
    """`resources.tasks_per_node` of the run's sweep (one node: `sweep launch` refuses more locally)."""
    return max(1, int(_resources(store, run).get("tasks_per_node", 1) or 1))


def run_gpus(store: Store, run: RunRecord) -> int:
    """The GPUs a local job sees: `resources.gpus_per_node`, else every GPU of this machine (the
    target `sweep launch` resolved `auto` for, `launcher.target`). submitit's local executor hides
    the GPUs it is not given (CUDA_VISIBLE_DEVICES)."""
    from launcher.target import local_gpu_count

    return int(_resources(store, run).get("gpus_per_node") or 0) or local_gpu_count()


def serve(store: Store) -> None:
    """Start queued attempts as slots free up; return when nothing is queued or running. The
    limit is read at every turn (`read_limit`), and jobs that a killed scheduler left running
    take slots too."""
    handle = _try_lock(lock_path(store.url))
    if handle is None:
        return  # another scheduler serves this database
    slots: list[Slot] = []
    pruning = PruneCheck(store)
    try:
        while True:
            pruning.tick(slots)
            slots = _reap(store, slots)
            orphans = _orphans(store, slots)
            free = read_limit(store.url) - sum(s.num_tasks for s in slots) - orphans
            if free > 0:
                slots += _start_fitting(store, store.queued_attempts(EXECUTOR, limit=free), free, idle=not slots)
            if not slots and not orphans and not store.queued_attempts(EXECUTOR, limit=1):
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


def prune_poll_s() -> float:
    return float(os.environ.get("SWEEP_PRUNE_POLL_S") or PRUNE_POLL_S)


class PruneCheck:
    """Every `prune_poll_s()`, one `sweep status SWEEP` child per served sweep that has a prune
    policy, one at a time (its sync step applies the policy; its output is not needed, its
    errors go to the scheduler's log)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.child: subprocess.Popen[bytes] | None = None
        self.waiting: list[str] = []
        self.last = time.monotonic()

    def tick(self, slots: Sequence[Slot]) -> None:
        if self.child is not None and self.child.poll() is None:
            return
        self.child = None
        if not self.waiting and time.monotonic() - self.last >= prune_poll_s():
            self.last = time.monotonic()
            self.waiting = [name for name in sorted({s.run.sweep for s in slots}) if self._has_policy(name)]
        if self.waiting:
            self.child = self._start(self.waiting.pop(0))

    def _has_policy(self, sweep: str) -> bool:
        record = self.store.get_sweep(sweep)
        return record is not None and (record.spec.get("grid") or {}).get("prune") is not None

    def _start(self, sweep: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "SWEEP_DB": self.store.url}
        args = [sys.executable, "-m", "launcher.cli", "status", sweep, "--json"]
        with open(_log_file(self.store), "ab") as log:
            return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)


def _orphans(store: Store, slots: list[Slot]) -> int:
    """The slots held by open local attempts of this host that an earlier scheduler started and
    whose process still runs. Those whose process is gone without a word are failed (nobody else
    would notice)."""
    ours = {slot.attempt.id for slot in slots}
    host, alive = socket.gethostname(), 0
    for attempt in store.active_attempts(EXECUTOR):
        job_id = attempt.job_id or ""
        pid = attempt.pid or (int(job_id) if job_id.isdigit() else None)
        if attempt.id in ours or attempt.state == AttemptState.QUEUED or attempt.node != host or pid is None:
            continue
        if is_alive(pid):
            alive += run_tasks(store, store.get_run(attempt.run_id))  # its tasks hold slots
        else:
            reason = f"process {pid} is gone without reporting an end (killed?) (log: {attempt.stderr_path})"
            store.settle_attempt(attempt.id, RunState.FAILED, reason)
    return alive


def _start_fitting(store: Store, queued: Sequence[AttemptRecord], free: int, *, idle: bool) -> list[Slot]:
    """Start queued attempts in order while their tasks fit the free slots; a run with more tasks
    than the whole limit starts alone when nothing else runs (else it would wait for ever)."""
    started: list[Slot] = []
    for attempt in queued:
        tasks = run_tasks(store, store.get_run(attempt.run_id))
        if tasks > free and not (idle and not started):
            break
        slot = _start(store, attempt, tasks)
        if slot is not None:
            started.append(slot)
            free -= tasks
    return started


def _start(store: Store, attempt: AttemptRecord, num_tasks: int = 1) -> Slot | None:
    """Start one queued attempt. If it cannot be started (submitit fails, the run directory is
    not writable), the run fails with the cause instead of staying queued for ever."""
    try:
        return _submit_job(store, attempt, num_tasks)
    except Exception as exc:  # noqa: BLE001 - any failure to start is the run's, not the scheduler's
        reason = f"the local scheduler could not start it: {type(exc).__name__}: {exc} (log: {_log_file(store)})"
        if store.settle_attempt(attempt.id, RunState.FAILED, reason):
            print(f"run {attempt.run_id} failed: {reason}", flush=True)
        return None


def _submit_job(store: Store, attempt: AttemptRecord, num_tasks: int = 1) -> Slot:
    import submitit

    from launcher.job import run_recipe

    run = store.get_run(attempt.run_id)
    executor = submitit.LocalExecutor(folder=Path(run.run_dir) / "logs")
    executor.update_parameters(timeout_min=JOB_TIMEOUT_MIN, tasks_per_node=num_tasks, gpus_per_node=run_gpus(store, run))
    job = executor.submit(run_recipe, run.run_dir)
    store.update_attempt(
        attempt.id,
        state=AttemptState.PENDING,
        node=socket.gethostname(),
        job_id=str(job.job_id),
        stdout_path=str(job.paths.stdout),
        stderr_path=str(job.paths.stderr),
    )
    tasks = f" of {num_tasks} tasks" if num_tasks > 1 else ""
    print(f"started run {run.id} (attempt {attempt.number}) as local job {job.job_id}{tasks}", flush=True)
    return Slot(attempt=attempt, run=run, job=job, num_tasks=num_tasks)


def _reap(store: Store, slots: list[Slot]) -> list[Slot]:
    running = []
    for slot in slots:
        if slot.job.done():
            _record_end(store, slot)
        elif (failed := _failed_task(slot.job)) is not None:
            # The other tasks would wait for the failed one until their peer timeout: stop them now
            # (submitit's controller takes SIGINT as "kill every task"), and say which task failed.
            slot.job.cancel()
            _record_end(store, slot, failed)
        else:
            running.append(slot)
    return running


def _tasks(job: Any) -> list[Any]:
    return list(job._sub_jobs) or [job]  # submitit: a job of several tasks holds one sub-job per task


def _failed_task(job: Any) -> tuple[str, Path] | None:
    """The first task of a running multi-task job that ended with an error: (cause, its log)."""
    if len(_tasks(job)) < 2:
        return None
    for task in _tasks(job):
        if task.paths.result_pickle.exists():
            cause = _task_cause(task)
            if cause is not None:
                return cause, task.paths.stderr
    return None


def _task_cause(task: Any) -> str | None:
    """Why one task failed, or None where it returned normally (its result file must exist)."""
    try:
        outcome, trace = task._get_outcome_and_result()  # reads the result file, waits for nothing
    except Exception as exc:  # noqa: BLE001 - an unreadable result is a failure too
        return f"{type(exc).__name__}: {exc}"
    return failure_cause(RuntimeError(str(trace))) if outcome == "error" else None


def _record_end(store: Store, slot: Slot, failed: tuple[str, Path] | None = None) -> None:
    """The job's processes are gone (or are being stopped because task `failed` did). Task 0
    records its own success or stop; a crash or a kill it cannot record, so that is written here,
    with the cause and the log path of the task that failed."""
    run_id = slot.run.id
    if failed is None:
        failed = _ended_badly(slot.job)
        if failed is None:
            return
    cause, log = failed
    reason = f"{cause} (log: {log})"
    state = RunState.CANCELLED if store.get_run(run_id).state == RunState.CANCELLED else RunState.FAILED
    if store.settle_attempt(slot.attempt.id, state, reason):
        print(f"run {run_id} {state}: {reason}", flush=True)


def _ended_badly(job: Any) -> tuple[str, Path] | None:
    """The cause and log of the first task that failed, or None where every task returned."""
    for task in _tasks(job):
        if not task.paths.result_pickle.exists():
            # (Asking submitit would wait 15 s for a result file that a killed job never writes.)
            return (
                "the job process ended without a result: killed by a signal (e.g. SIGKILL) or out of memory",
                task.paths.stderr,
            )
        cause = _task_cause(task)
        if cause is not None:
            return cause, task.paths.stderr
    return None


TRACEBACK = "Traceback (most recent call last):"


def failure_cause(exc: BaseException) -> str:
    """One line saying why a job failed. submitit's error wraps the job's traceback in dashed
    rules and ends with the log paths: the cause is the exception line of the last traceback
    ("ModuleNotFoundError: No module named 'zmq'"), not the text's last line."""
    text = str(exc).strip()
    if TRACEBACK in text:
        for line in text.rsplit(TRACEBACK, 1)[1].splitlines():
            if line.strip() and not line[0].isspace() and set(line.strip()) != {"-"}:
                return line.strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _log_file(store: Store) -> Path:
    return lock_path(store.url).with_suffix(".log")


def is_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose; /proc tells (Linux)
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


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
    parser.add_argument("--max-parallel", type=int, default=None, help="Save this limit first [default: saved one].")
    args = parser.parse_args(argv)
    if args.max_parallel is not None and args.max_parallel < 1:
        parser.error(f"--max-parallel must be >= 1, got {args.max_parallel}")
    store = Store()  # $SWEEP_DB
    if args.max_parallel is not None:
        save_limit(store.url, args.max_parallel)
    print(f"local scheduler {os.getpid()} serving {store.display_url} with {read_limit(store.url)} slots", flush=True)
    serve(store)


if __name__ == "__main__":
    _main()
