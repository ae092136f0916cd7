"""`sweep cancel SWEEP|RUN`, and the stop that live pruning shares with it.

Both mark the store first, so a scheduler never starts a run that is being stopped, then stop
the jobs: a local job gets SIGTERM; a running Slurm job gets SIGTERM through
`scancel --signal=TERM` from pruning (the job then ends by itself), a plain `scancel` from
`sweep cancel`. The recipe's handler (recipe/job.py) writes a checkpoint at the next step
boundary and ends the attempt as the run's state says (cancelled, or pruned).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

from store import CANCELLABLE_STATES, AttemptState, RunState, Store


def cancel(store: Store, target: str) -> list[str]:
    """Cancel the active runs of a sweep, or one run; return the ids cancelled.

    The store is marked first, so a scheduler never starts a cancelled run; then running jobs
    get SIGTERM (local) or scancel (Slurm), which makes them checkpoint and stop.
    """
    runs = store.runs(target) if store.get_sweep(target) else [store.get_run(target)]
    cancelled = [r for r in runs if r.state in CANCELLABLE_STATES]
    if not cancelled:
        return []
    ids = [r.id for r in cancelled]
    store.set_runs_state(ids, RunState.CANCELLED, only_from=CANCELLABLE_STATES, reason="cancelled by the user")
    stop_jobs(store, cancelled[0].sweep, ids, AttemptState.CANCELLED, "cancelled before it started")
    return ids


def prune(store: Store, sweep: str, run_ids: Sequence[str], reason: str, record: dict[str, Any]) -> list[str]:
    """Prune active runs of `sweep` (the live prune policy decided: `record` is its decision);
    return the ids pruned. The runs become `pruned` with `reason` first, then their jobs are
    asked to checkpoint and stop; their checkpoints stay where they are."""
    pruned = store.prune_runs(run_ids, reason, record)
    if pruned:
        stop_jobs(store, sweep, pruned, AttemptState.PRUNED, "pruned before it started", graceful=True)
    return pruned


def stop_jobs(
    store: Store, sweep: str, run_ids: Sequence[str], unstarted: AttemptState, reason: str, *, graceful: bool = False
) -> None:
    """Stop the newest attempts of the runs: one not started yet ends as `unstarted` with
    `reason`; a running one is signalled and checkpoints. `graceful`: Slurm jobs that run get
    SIGTERM and nothing else (`scancel --signal=TERM`: no SIGKILL after KillWait, so a long step
    still reaches its checkpoint); pending ones are removed from the queue."""
    latest = store.latest_attempts(sweep)
    slurm_jobs: list[str] = []
    slurm_signal: list[str] = []
    for attempt in (latest[i] for i in run_ids if i in latest):
        if attempt.state == AttemptState.QUEUED:
            store.end_attempt(attempt.id, unstarted, reason)
        elif attempt.executor == "slurm" and attempt.job_id:
            running = attempt.state == AttemptState.RUNNING
            (slurm_signal if graceful and running else slurm_jobs).append(attempt.job_id)
        elif attempt.executor == "local" and attempt.state in (AttemptState.PENDING, AttemptState.RUNNING):
            _terminate(attempt.pid or (int(attempt.job_id) if attempt.job_id else None))
    if slurm_jobs or slurm_signal:
        from launcher import slurm

        if slurm_jobs:
            slurm.cancel_jobs(slurm_jobs)
        if slurm_signal:
            slurm.run_slurm(["scancel", "--signal=TERM", *slurm_signal])


def _terminate(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
