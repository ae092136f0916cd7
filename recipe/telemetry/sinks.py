"""Where a training run reports what it measures.

The training loop knows nothing of databases: it hands eval points, metrics and checkpoints to a
Sink. `recipe.job` connects it to the store; tests use `MemorySink`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Sink(Protocol):
    def resumed(self, step: int) -> None:
        """The run continues from a checkpoint at `step`: anything reported past it is void."""

    def eval_point(self, point: dict[str, Any]) -> None:
        """One held-out evaluation: step, pass_rate, flops, tokens, device_seconds, gpu_hours,
        num_samples, metrics (dict)."""

    def train_metrics(self, step: int, metrics: dict[str, Any]) -> None: ...

    def checkpoint_saved(self, step: int, path: str) -> None: ...

    def checkpoint_deleted(self, step: int) -> None: ...


@dataclass
class MemorySink:
    """Keeps everything in lists, with the store's semantics (one eval point per step)."""

    eval_points: dict[int, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    checkpoints: dict[int, str] = field(default_factory=dict)
    resumes: list[int] = field(default_factory=list)

    def resumed(self, step: int) -> None:
        self.resumes.append(step)
        self.eval_points = {s: p for s, p in self.eval_points.items() if s <= step}

    def eval_point(self, point: dict[str, Any]) -> None:
        self.eval_points[point["step"]] = point

    def train_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics[step] = metrics

    def checkpoint_saved(self, step: int, path: str) -> None:
        self.checkpoints[step] = path

    def checkpoint_deleted(self, step: int) -> None:
        self.checkpoints.pop(step, None)
