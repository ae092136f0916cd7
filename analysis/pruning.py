"""Scaling-aware pruning: stop a configuration when its fitted *ceiling* is beaten, not its
current pass rate.

Pruners that judge a run by its current metric (Hyperband, ASHA, median stopping) are wrong on
RL scaling curves: the recipe with the highest asymptote often starts slowest (the paper's larger
batch and longer generation budget). Here a configuration (its seeds pooled) is pruned only when
the upper bound of its asymptote's interval lies below the best configuration's lower bound by
more than the margin (the paper's 0.02):

    A_hi(config) < A_lo(best) - margin,   best = the configuration with the highest A_lo

Judgments happen at fractions of the sweep's compute range: first at `first_at`, then every
`every`. `simulate` replays finished curves in compute order as if the sweep were running and
reports when each configuration would have been pruned and the compute saved; `simulate_current`
does the same with a current-value rule (prune when the current pass rate trails the best
current pass rate by more than the margin), to show the difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from analysis.comparison import PAPER_MARGIN
from analysis.curve import FLAG_A_AT_BOUND
from analysis.data import CurveLike, as_curves
from analysis.intervals import bootstrap
from analysis.options import DEFAULT_OPTIONS, FitOptions


MAX_JUDGMENTS = 1000
"""Judgment points at most (prune.every >= 1/MAX_JUDGMENTS): each is a fit of every configuration."""


@dataclass(frozen=True)
class PrunePolicy:
    first_at: float = 0.3
    """The first judgment, as a fraction of the sweep's compute range."""
    every: float = 0.1
    """Then one judgment per this fraction."""
    margin: float = PAPER_MARGIN
    level: float = 0.9
    """Level of the asymptote intervals."""
    n_boot: int = 100

    def __post_init__(self) -> None:
        if not (math.isfinite(self.first_at) and 0 < self.first_at <= 1):
            raise ValueError(f"prune.first_at must lie in (0, 1], got {self.first_at!r}")
        if not (math.isfinite(self.every) and 1 / MAX_JUDGMENTS <= self.every <= 1):
            raise ValueError(f"prune.every must lie in [{1 / MAX_JUDGMENTS:g}, 1] (at most {MAX_JUDGMENTS} judgment points), got {self.every!r}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"prune.margin must be a finite number >= 0, got {self.margin!r}")
        if not 0.5 <= self.level <= 0.999:
            raise ValueError(f"prune.level must lie in [0.5, 0.999], got {self.level!r}")
        if self.n_boot < 10:
            raise ValueError(f"prune.n_boot must be >= 10, got {self.n_boot!r}")

    def judgments(self) -> list[float]:
        """The fractions of the compute range at which configurations are judged."""
        out, f = [], self.first_at
        while f < 1 - 1e-9:
            out.append(round(f, 9))
            f += self.every
        return out


@dataclass(frozen=True)
class Verdict:
    label: str
    pruned: bool
    pruned_at: float | None
    """Compute at which it was pruned (None: kept)."""
    reason: str | None
    A_interval: tuple[float, float] | None
    """The asymptote interval that decided (at the last judgment it took part in)."""


@dataclass(frozen=True)
class Simulation:
    pruner: str
    verdicts: tuple[Verdict, ...]
    saved_fraction: float
    """Compute the pruned configurations would not have spent, over all compute spent."""
    best: str
    """The configuration with the highest asymptote on all data."""
    best_survived: bool


Curves = Mapping[str, Sequence[CurveLike]]


def judge(curves: Curves, policy: PrunePolicy, options: FitOptions = DEFAULT_OPTIONS) -> dict[str, Verdict]:
    """One judgment on the data as they are: which configurations are dominated now."""
    intervals = {label: _a_interval(seeds, policy, options) for label, seeds in curves.items()}
    known = {k: v for k, v in intervals.items() if v is not None}
    if len(known) < 2:
        return {k: Verdict(k, False, None, None, v) for k, v in intervals.items()}
    best = max(known, key=lambda k: known[k][0])
    floor = known[best][0] - policy.margin
    out = {}
    for label, interval in intervals.items():
        dominated = interval is not None and label != best and interval[1] < floor
        reason = (
            f"A <= {interval[1]:.3f} ({policy.level:.0%} interval) lies below {best}'s A >= {known[best][0]:.3f} "
            f"by more than {policy.margin}"
            if dominated and interval is not None
            else None
        )
        out[label] = Verdict(label, dominated, None, reason, interval)
    return out


def simulate(curves: Curves, policy: PrunePolicy, options: FitOptions = DEFAULT_OPTIONS) -> Simulation:
    """Replay finished curves as if running, pruning on fitted ceilings."""
    return _replay(curves, policy, lambda seen: judge(seen, policy, options), "asymptote", options)


def simulate_current(curves: Curves, policy: PrunePolicy, options: FitOptions = DEFAULT_OPTIONS) -> Simulation:
    """The same replay with a current-value pruner (what ASHA-style tools judge)."""

    def current(seen: Curves) -> dict[str, Verdict]:
        now = {label: float(np.mean([r[-1] for _, r in as_curves(seeds) if len(r)])) for label, seeds in seen.items()}
        best = max(now, key=lambda k: now[k])
        return {
            label: Verdict(
                label, value < now[best] - policy.margin, None,
                f"current pass rate {value:.3f} trails {best}'s {now[best]:.3f}" if value < now[best] - policy.margin else None,
                None,
            )  # fmt: skip
            for label, value in now.items()
        }

    return _replay(curves, policy, current, "current value", options)


def _replay(
    curves: Curves,
    policy: PrunePolicy,
    rule: Callable[[Curves], dict[str, Verdict]],
    name: str,
    options: FitOptions,
) -> Simulation:
    full = {label: as_curves(seeds) for label, seeds in curves.items()}
    top = max(float(c.max()) for seeds in full.values() for c, _ in seeds if len(c))
    pruned: dict[str, Verdict] = {}
    for fraction in policy.judgments():
        at = fraction * top
        alive = {
            label: [(c[c <= at], r[c <= at]) for c, r in seeds] for label, seeds in full.items() if label not in pruned
        }
        if len(alive) < 2:
            break
        for label, verdict in rule(alive).items():
            if verdict.pruned:
                pruned[label] = Verdict(label, True, at, verdict.reason, verdict.A_interval)
    spent = {label: sum(float(c.max()) for c, _ in seeds if len(c)) for label, seeds in full.items()}
    total = sum(spent.values())
    saved = sum(spent[k] - min(spent[k], v.pruned_at * len(full[k])) for k, v in pruned.items() if v.pruned_at)
    best = max(
        full,
        key=lambda k: (a if (a := _point_a(full[k], options)) is not None else -math.inf),
    )
    verdicts = tuple(pruned.get(label, Verdict(label, False, None, None, None)) for label in full)
    return Simulation(name, verdicts, saved / total if total else 0.0, best, best not in pruned)


def _a_interval(seeds: Sequence[CurveLike], policy: PrunePolicy, options: FitOptions) -> tuple[float, float] | None:
    """The asymptote's interval, or None where it says nothing (a failed fit, no interval).

    A fit whose A sits on a bound of its range keeps the end of its interval away from that
    bound, which is the end the rule reads there: A on the upper bound (a curve still climbing:
    the ceiling may lie higher) has its upper end set to the bound, so it is never pruned, while
    its lower end (the bootstrap's) may still make it the reference; A on the lower bound (a run
    that collapsed or never learned) can hide nothing below it, and the upper end, what pruning
    reads, is the bootstrap's."""
    result = bootstrap(seeds, options, n_boot=policy.n_boot, level=policy.level)
    if not result.fit.ok or not result.A.known:
        return None
    lo, hi = float(result.A.lo), float(result.A.hi)
    if FLAG_A_AT_BOUND in result.fit.flags and result.fit.A > options.a_bounds[0] + options.bound_tol:
        hi = float(options.a_bounds[1])
    return (lo, hi)


def _point_a(seeds: Sequence[CurveLike], options: FitOptions) -> float | None:
    from analysis.fit import fit_curves

    fit = fit_curves(seeds, options)
    return float(fit.A) if fit.ok else None
