"""`sweep cancel SWEEP|RUN`."""

from __future__ import annotations

import os
import signal

from store import CANCELLABLE_STATES, UNSTARTED_ATTEMPT_STATES, AttemptState, RunState, Store


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
    latest = store.latest_attempts(cancelled[0].sweep)
    slurm_jobs = []
    for attempt in (latest[i] for i in ids if i in latest):
        if attempt.state == AttemptState.QUEUED:
            store.end_attempt(attempt.id, AttemptState.CANCELLED, "cancelled before it started")
        elif attempt.executor == "slurm" and attempt.job_id:
            slurm_jobs.append(attempt.job_id)
        elif attempt.executor == "local" and attempt.state in (AttemptState.PENDING, AttemptState.RUNNING):
            _terminate(attempt.pid or (int(attempt.job_id) if attempt.job_id else None))
    if slurm_jobs:
        from launcher import slurm

        slurm.cancel_jobs(slurm_jobs)
    return ids


def _terminate(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
