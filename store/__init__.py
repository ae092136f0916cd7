"""The store: sweeps, runs, attempts, eval points and checkpoints in SQLite or PostgreSQL.

Nothing outside this package imports SQLAlchemy; everything goes through `Store`'s methods.
"""

from store.api import Store
from store.records import (
    PRUNE_EXEMPT,
    AttemptRecord,
    CheckpointRecord,
    EvalRecord,
    NewRun,
    RunRecord,
    SweepRecord,
    TrackedAttempt,
    same_seed_reruns,
)
from store.urls import mask_url, resolve_url, scrub
from store.axes import COMPUTE_AXES, MEASURED_COMPUTE_AXES
from store.errors import BadURLError, NotFoundError, SchemaError, StoreError
from store.states import (
    ACTIVE_STATES,
    ATTEMPT_STATES,
    CANCELLABLE_STATES,
    FAILED_STATES,
    OPEN_ATTEMPT_STATES,
    RETRYABLE_STATES,
    RUN_STATES,
    TERMINAL_STATES,
    UNSTARTED_ATTEMPT_STATES,
    AttemptState,
    RunState,
)

__all__ = [
    "COMPUTE_AXES",
    "MEASURED_COMPUTE_AXES",
    "ACTIVE_STATES",
    "ATTEMPT_STATES",
    "CANCELLABLE_STATES",
    "FAILED_STATES",
    "OPEN_ATTEMPT_STATES",
    "RETRYABLE_STATES",
    "RUN_STATES",
    "TERMINAL_STATES",
    "UNSTARTED_ATTEMPT_STATES",
    "PRUNE_EXEMPT",
    "AttemptRecord",
    "BadURLError",
    "AttemptState",
    "CheckpointRecord",
    "EvalRecord",
    "NewRun",
    "NotFoundError",
    "RunRecord",
    "RunState",
    "SchemaError",
    "Store",
    "StoreError",
    "SweepRecord",
    "TrackedAttempt",
    "mask_url",
    "resolve_url",
    "same_seed_reruns",
    "scrub",
]
