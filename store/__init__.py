"""The store: sweeps, runs, attempts, eval points and checkpoints in SQLite or PostgreSQL.

Nothing outside this package imports SQLAlchemy; everything goes through `Store`'s methods.
"""

from store.api import (
    ACTIVE_STATES,
    RETRYABLE_STATES,
    RUN_STATES,
    AttemptRecord,
    CheckpointRecord,
    EvalRecord,
    NewRun,
    RunRecord,
    Store,
    StoreError,
    SweepRecord,
    mask_url,
    resolve_url,
)

__all__ = [
    "ACTIVE_STATES",
    "RETRYABLE_STATES",
    "RUN_STATES",
    "AttemptRecord",
    "CheckpointRecord",
    "EvalRecord",
    "NewRun",
    "RunRecord",
    "Store",
    "StoreError",
    "SweepRecord",
    "mask_url",
    "resolve_url",
]
