"""What one job runs: `python -m recipe RUN_DIR`, or the launcher's submitted function.

Reads the run directory, records the attempt in the store, trains (resuming from the newest valid
checkpoint), and records how the attempt ended.

Stop signals: Slurm sends SIGUSR2 ahead of a time limit or a preemption (`--signal=USR2@N`),
and SIGTERM when it requeues or cancels a job; `sweep cancel` sends SIGTERM to a local job. Either
makes the loop write a checkpoint at the next step boundary and return. After SIGUSR2 the job
requeues itself (`scontrol requeue`) and resumes from that checkpoint when it starts again; after
SIGTERM, Slurm (or the user) has already decided what comes next and `sweep status` reads it from
sacct.

The database may be away for a while: reports are buffered (recipe.telemetry.store_sink) and state changes
are retried for up to $SWEEP_DB_RETRY_S seconds (default 600).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from recipe.config import read_run_files
from recipe.telemetry import provenance
from recipe.telemetry.store_sink import StoreSink
from store import AttemptState, RunState, Store, StoreError

log = logging.getLogger("recipe")
T = TypeVar("T")

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def db_retry_s() -> float:
    return float(os.environ.get("SWEEP_DB_RETRY_S", "600"))


class StopFlag:
    """Set by a stop signal; the training loop polls it once per step."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        log.warning("received %s: checkpointing at the next step boundary", signal.Signals(signum).name)
        self.signum = signum


def main(run_dir: str | Path) -> RunState | str:
    """Run one attempt of the run in `run_dir`; return its final state.

    In a multi-task job (docs/engines.md, "Process layout") every task calls this; task 0,
    trainer rank 0, is the run and records the attempt; the other tasks play their role
    (`recipe.pipeline.peer.run_peer`) and return a line saying which they were.
    """
    _setup_logging()
    run_dir = Path(run_dir).resolve()
    info, cfg = read_run_files(run_dir)
    from recipe.pipeline.env import layout_of, task_env  # torch: only inside the job
    from recipe.pipeline.lead import LeadTeam
    from recipe.pipeline.peer import run_peer

    env = task_env()
    if env.rank != 0:
        return run_peer(cfg, run_dir, env, log.info)
    stop = StopFlag()
    stop.install()
    run_id = info["run_id"]
    store = retry(lambda: Store(info["db_url"]), "connecting to the store")
    attempt = retry(lambda: store.begin_attempt(run_id, _executor(), **_job_identity()), "recording the attempt")
    record = provenance.collect(
        sweep_file=info.get("sweep_file"), sweep_file_sha256=info.get("sweep_file_sha256"), config=cfg.to_dict()
    )
    record["hosts"] = [{"task": 0, "role": "trainer", "rank": 0, "host": record["host"], "pid": os.getpid()}]
    retry(lambda: store.update_attempt(attempt.id, provenance=record), "recording the provenance")
    log.info(
        "run %s (sweep %s), attempt %d, pid %d on %s, store %s",
        run_id, info["sweep"], attempt.number, os.getpid(), socket.gethostname(), store.display_url,
    )  # fmt: skip
    sink = StoreSink(store, run_id, run_dir, attempt_id=attempt.id)
    from recipe.loop.train import train  # torch is imported here, never by the launcher

    try:
        layout = layout_of(cfg, env)  # the tasks Slurm really started must fit engine.generator_ranks
        if layout.num_tasks == 1:
            outcome = train(cfg, run_dir, sink, should_stop=stop, log=log.info)
        else:
            with LeadTeam(cfg, run_dir, env, layout, log.info, should_stop=stop) as team:
                record["hosts"] = team.hosts
                retry(lambda: store.update_attempt(attempt.id, provenance=record), "recording the tasks' hosts")
                outcome = train(cfg, run_dir, sink, should_stop=stop, log=log.info, team=team)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc} (log: {attempt.stderr_path or 'the job stderr'})"
        for task in getattr(exc, "tasks", ()):  # a lost peer (recipe.pipeline.transport.PeerLost): its own log says why
            reason += f"; task {task}'s log: `sweep logs {run_id} --task {task}`"
        _flush(sink)
        retry(lambda: store.settle_attempt(attempt.id, RunState.FAILED, reason), "recording the failure")
        raise
    _flush(sink)
    if outcome.state == "completed":  # the loop's word (TrainOutcome), not a store state
        retry(lambda: store.settle_attempt(attempt.id, RunState.COMPLETED, None), "recording the completion")
        return RunState.COMPLETED
    return _stopped(store, run_id, attempt.id, stop.signum, outcome.final_step)


def _stopped(store: Store, run_id: str, attempt_id: int, signum: int | None, step: int) -> RunState:
    """The loop stopped on a signal after writing a checkpoint at `step`."""
    name = signal.Signals(signum).name if signum else "a stop request"
    run_state = retry(lambda: store.get_run(run_id).state, "reading the run")
    if run_state == RunState.CANCELLED:
        retry(
            lambda: store.end_attempt(attempt_id, AttemptState.CANCELLED, f"cancelled at step {step}"),
            "recording the cancel",
        )
        return RunState.CANCELLED
    if run_state == RunState.PRUNED:  # the sweep's prune policy stopped it (analysis/pruning.py)
        reason = f"pruned at step {step}; checkpoint written (`sweep launch --resume-pruned` resumes it)"
        retry(lambda: store.end_attempt(attempt_id, AttemptState.PRUNED, reason), "recording the prune")
        log.info("%s", reason)
        return RunState.PRUNED
    if signum == signal.SIGUSR2 and os.environ.get("SLURM_JOB_ID"):
        job = _slurm_job_id()
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
        reason = f"{name} at step {step} (time limit or preemption): checkpointed, requeued job {job}"
        retry(lambda: store.settle_attempt(attempt_id, RunState.PREEMPTED, reason), "recording the requeue")
        log.info("%s", reason)
        return RunState.PREEMPTED
    reason = f"stopped by {name} at step {step}; checkpoint written"
    state = RunState.PREEMPTED if os.environ.get("SLURM_JOB_ID") else RunState.CANCELLED  # Slurm's word comes later
    retry(lambda: store.settle_attempt(attempt_id, state, reason), "recording the stop")
    return state


def retry(action: Callable[[], T], what: str, *, timeout_s: float | None = None) -> T:
    """Run a store action, retrying while the database is unreachable."""
    deadline = time.monotonic() + (db_retry_s() if timeout_s is None else timeout_s)
    delay = 1.0
    while True:
        try:
            return action()
        except StoreError as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s failed (%s); retrying in %.0f s", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


def _flush(sink: StoreSink) -> None:
    if not sink.flush(timeout_s=db_retry_s()):
        raise StoreError(
            f"the database stayed unreachable for {db_retry_s():.0f} s; {sink.pending} reports wait in "
            f"{sink.spool} and are replayed by the next attempt"
        )


def _slurm_job_id() -> str:
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def _executor() -> str:
    if os.environ.get("SLURM_JOB_ID"):
        return "slurm"
    return os.environ.get("SUBMITIT_EXECUTOR", "manual")


def _job_identity() -> dict[str, Any]:
    fields: dict[str, Any] = {"pid": os.getpid(), "node": socket.gethostname()}
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        fields["job_id"] = _slurm_job_id()
    if env.get("SLURM_ARRAY_JOB_ID"):
        fields["array_job_id"] = env["SLURM_ARRAY_JOB_ID"]
        fields["array_index"] = int(env["SLURM_ARRAY_TASK_ID"])
    return fields


def _setup_logging() -> None:
    logging.Formatter.converter = time.gmtime
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,
    )
