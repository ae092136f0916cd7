"""The frozen records the store hands to callers (never ORM objects), and what is computed from
them alone."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from store.states import AttemptState, RunState

PRUNE_EXEMPT = "exempt"
"""Key of a run's prune record (Run.prune) once resumed with --resume-pruned: never pruned again."""


@dataclass(frozen=True)
class SweepRecord:
    id: int
    name: str
    spec: dict[str, Any]
    root_dir: str
    executor: str
    created_at: datetime


@dataclass(frozen=True)
class RunRecord:
    id: str
    sweep: str
    position: int
    config_data: dict[str, Any] | str = field(repr=False)
    """The resolved config, or its JSON text as read from the database: `config` decodes it on
    first use (`sweep status` lists 10,000 runs and reads no config; decoding them all was a
    third of its time)."""
    axes: dict[str, Any]
    budget: dict[str, Any]
    run_dir: str
    state: RunState
    state_reason: str | None
    step: int
    updated_at: datetime
    prune: dict[str, Any] | None = None
    """The live prune policy's word on the run (store.models.Run.prune)."""

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The resolved RecipeConfig, as a dict."""
        data = self.config_data
        return json.loads(data) if isinstance(data, str) else data


def same_seed_reruns(runs: Sequence[RunRecord]) -> dict[str, str]:
    """{rerun id: the earlier run it reproduces} among `runs` (a sweep's, in position order): a
    launched run whose resolved config (seed included) and axes equal an earlier one's (`sweep rerun`
    without --seed); an imported run whose labels, a seed among them, equal an earlier one's.
    A reproduction is not an independent replicate: the report keeps it out of the fits."""
    first: dict[str, str] = {}
    reruns: dict[str, str] = {}
    for run in sorted(runs, key=lambda r: r.position):
        if run.config.get("source") == "import":
            if run.axes.get("seed") is None:
                continue
            key = "import " + json.dumps(run.axes, sort_keys=True, default=str)
        else:  # the axes too: a run's config holds its axis values, a hand-made one may not
            key = json.dumps([run.config, run.axes], sort_keys=True, default=str)
        if key in first:
            reruns[run.id] = first[key]
        else:
            first[key] = run.id
    return reruns


@dataclass(frozen=True)
class NewRun:
    id: str
    position: int
    config: dict[str, Any]
    axes: dict[str, Any]
    budget: dict[str, Any]
    run_dir: str


@dataclass(frozen=True)
class AttemptRecord:
    id: int
    run_id: str
    number: int
    executor: str
    job_id: str | None
    array_job_id: str | None
    array_index: int | None
    node: str | None
    pid: int | None
    state: AttemptState
    exit_reason: str | None
    resumed_from_step: int | None
    stdout_path: str | None
    stderr_path: str | None
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    provenance: dict[str, Any] | None = None


@dataclass(frozen=True)
class TrackedAttempt:
    """What an executor's reconcile step needs of a run's newest attempt (Store.tracked_attempts)."""

    id: int
    run_id: str
    job_id: str
    stderr_path: str | None
    run_state: RunState


@dataclass(frozen=True)
class EvalRecord:
    run_id: str
    step: int
    pass_rate: float
    flops: float
    tokens: int
    device_seconds: float
    gpu_hours: float
    num_samples: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    step: int
    path: str
    created_at: datetime


EVAL_FIELDS = ("step", "pass_rate", "flops", "tokens", "device_seconds", "gpu_hours", "num_samples", "metrics")
