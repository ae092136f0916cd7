"""Run and attempt states, and the named sets of them: the one home of every state name.

The values are the strings stored in the database (`runs.state`, `attempts.state`); `StrEnum`
members compare equal to those strings, so rows written before the enum existed read the same.
See docs/decisions.md ("States") for what each state means and who moves a run between them.
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    REGISTERED = "registered"  # in the store, never submitted (or handed back by a failed submission)
    SUBMITTING = "submitting"  # claimed by one launcher, on its way to an executor
    QUEUED = "queued"  # waiting for a local scheduler slot
    PENDING = "pending"  # accepted by the executor, not started
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"  # stopped by the cluster; it comes back by itself (requeue)
    PRUNED = "pruned"  # stopped after a checkpoint by the sweep's prune policy; `--resume-pruned` resumes it


class AttemptState(StrEnum):
    QUEUED = "queued"
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    PRUNED = "pruned"


RUN_STATES: tuple[RunState, ...] = tuple(RunState)
ATTEMPT_STATES: tuple[AttemptState, ...] = tuple(AttemptState)

# A run somebody (an executor, a launcher) is still working on.
ACTIVE_STATES = (RunState.SUBMITTING, RunState.QUEUED, RunState.PENDING, RunState.RUNNING, RunState.PREEMPTED)
# A run that has ended and stays so until somebody launches it again.
TERMINAL_STATES = (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED, RunState.TIMEOUT, RunState.PRUNED)
# Ended without completing: `sweep launch --retry-failed` submits these again (pruned runs are
# not among them: `sweep launch --resume-pruned` resumes those).
RETRYABLE_STATES = (RunState.FAILED, RunState.CANCELLED, RunState.TIMEOUT)
# What `sweep cancel` may cancel.
CANCELLABLE_STATES = (RunState.REGISTERED, *ACTIVE_STATES)
# States whose failures are worth a line under `sweep status`.
FAILED_STATES = (RunState.FAILED, RunState.TIMEOUT)

# An attempt with no end recorded yet: the executor's word on how it ended may still come.
OPEN_ATTEMPT_STATES = (AttemptState.QUEUED, AttemptState.PENDING, AttemptState.RUNNING, AttemptState.PREEMPTED)
# An attempt its job has not taken over yet (the job's start makes it `running`).
UNSTARTED_ATTEMPT_STATES = (AttemptState.QUEUED, AttemptState.PENDING)
