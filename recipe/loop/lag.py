"""PipelineRL-k bookkeeping: which prompt groups may start, which finished samples may train.

Pure functions and one counter, no I/O and no torch, so the rules can be tested as properties
(tests/test_lag.py) and shared by every engine.

Versions: the policy after v optimizer steps is version v. Trainer step s trains version s on
B = `batch.prompts` groups and produces version s + 1. A sample records the versions its first and
last tokens were generated with (`Span`); with in-flight weight updates they differ. Its lag at
step s is s - version_start: how many policy versions older than the trained policy its oldest
token is. k = `async.max_lag` bounds it.

- **Admission** (before a generator starts a group): the i-th group admitted (0-based, every
  group ever admitted, less those given back) is trained, when nothing is dropped, by step
  floor(i / B). Started on a generator holding version g, it will then be floor(i / B) - g
  versions old. So a group is admitted only while i < (g + k + 1) * B: admission keeps the
  generators at most k versions ahead of the trainer, and with weights pushed as soon as they
  exist nothing is ever dropped.
- **Drop rule** (when step s takes a batch): a sample with s - version_start > k is dropped and
  counted, whatever delayed it (a slow push, a straggler group). This is the guarantee; admission
  only makes drops rare. A dropped group's admission slot is given back.

This version's torch engine alternates generation and training in one process, so its lag is 0;
generator ranks streaming while weights are pushed (`engine.generator_ranks`) will use these rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """The policy versions a sample was generated with: first token, last token."""

    version_start: int
    version_end: int

    def __post_init__(self) -> None:
        if not 0 <= self.version_start <= self.version_end:
            raise ValueError(f"a span runs forward from version >= 0, got {self.version_start}..{self.version_end}")


def admission_limit(generator_version: int, max_lag: int, groups_per_step: int) -> int:
    """How many groups may have been admitted in all while the generator holds `generator_version`."""
    return (generator_version + max_lag + 1) * groups_per_step


def lag(step: int, span: Span) -> int:
    """Policy versions between the trained policy and the sample's oldest token."""
    return step - span.version_start


def is_stale(step: int, span: Span, max_lag: int) -> bool:
    return lag(step, span) > max_lag


def split_stale(step: int, spans: Sequence[Span], max_lag: int) -> tuple[list[int], list[int]]:
    """Indices of the samples step `step` may train on, and of those it must drop."""
    keep = [i for i, span in enumerate(spans) if not is_stale(step, span, max_lag)]
    drop = [i for i, span in enumerate(spans) if is_stale(step, span, max_lag)]
    return keep, drop


def lag_metrics(step: int, kept: Sequence[Span], num_dropped: int) -> dict[str, float]:
    """The per-step train metrics: lag_max, lag_mean (policy versions) and num_dropped."""
    lags = [lag(step, span) for span in kept]
    return {
        "lag_max": float(max(lags, default=0)),
        "lag_mean": sum(lags) / len(lags) if lags else 0.0,
        "num_dropped": float(num_dropped),
    }


@dataclass
class Admission:
    """Trainer rank 0's admission counter (the only state of these rules)."""

    max_lag: int
    groups_per_step: int
    admitted: int = 0
    """Groups admitted so far, less those given back after a drop."""

    def __post_init__(self) -> None:
        if self.max_lag < 0 or self.groups_per_step < 1:
            raise ValueError(f"need max_lag >= 0 and groups_per_step >= 1, got {self.max_lag}, {self.groups_per_step}")

    def try_admit(self, generator_version: int) -> bool:
        """Admit one more group for a generator holding `generator_version`, if the bound allows."""
        if self.admitted >= admission_limit(generator_version, self.max_lag, self.groups_per_step):
            return False
        self.admitted += 1
        return True

    def give_back(self, num_groups: int) -> None:
        """Dropped groups free their slots: the groups admitted next take their place in line."""
        if not 0 <= num_groups <= self.admitted:
            raise ValueError(f"cannot give back {num_groups} of {self.admitted} admitted groups")
        self.admitted -= num_groups

    def state_dict(self) -> dict[str, int]:
        return {"admitted": self.admitted}
