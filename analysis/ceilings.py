"""Shared ceilings: configurations that share a ceiling are extrapolated with one A.

Early in a run the fit cannot tell a high ceiling approached slowly from a lower one approached
fast: from the first quarter of the project's sumk runs, A's 95% interval is 0.3-0.6 wide and the
predicted final pass rate misses by 0.03-0.1 (docs/predictions.md). Nor can the data say, that
early, which configurations share a ceiling: with its own B and Cmid, a curve at 0.3 fits a
ceiling of 0.72 nearly as well as one of 0.37. That is knowledge about the task and the knobs,
the paper's reading of its leave-one-out studies (most design choices leave A where it is) and
what its shared-A comparison assumes. So a sweep says which of its axes set the ceiling (the
*ceiling axes*: `sweep report --ceiling-axes`, or what the task knows, `TASK_CEILING_AXES`), and
at the extrapolation's cut:

1. Each configuration's own extrapolation is made as before (`analysis.extrapolation`).
2. The separating axes are the ceiling axes plus every axis that already moves A at the cut, as
   `sweep report` judges axes (`analysis.ranking.effects` on the window fits: intervals apart).
3. Configurations with the same values of every separating axis form a group; each group with
   two or more predicted configurations is refitted jointly: one A, and each configuration its
   own B and Cmid (the profile of the summed squared error over A, `shared_a`).
4. Each member is extrapolated again with A held at the group's (`FitOptions.fix_a`); its
   prediction is that refit's, and its band the hull of its own band and the refit's (the refit's
   band alone treats A as known).

Without ceiling axes (a task that knows none, nothing declared) every configuration keeps its own
A. Configurations whose own prediction is withheld (an unstable window, a failed fit) stay
withheld and take no part in a group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np
from scipy.optimize import minimize_scalar

from analysis.effects import DEFAULT_EFFECT_OPTIONS, EffectOptions
from analysis.extrapolation import Extrapolation, extrapolate, fit_window
from analysis.fit import fit_curves
from analysis.intervals import Interval
from analysis.options import FitOptions
from analysis.ranking import ABLATE_AXIS, ConfigResult, effects, fmt_axis_value

TASK_CEILING_AXES: dict[str, tuple[str, ...]] = {
    "sumk": (
        "length.max_new_tokens", "length.control", "length.interrupt_min", "length.interrupt_max",
        "data.sumk_min_digits", "data.sumk_max_digits", "data.task", "model.path",
    ),
}  # fmt: skip
"""The axes that set a built-in task's ceiling. sumk's is its length budget (a k-digit problem
needs k + 4 tokens) over its digit range; the model is listed too, since capacity can cap it."""

A_GRID_POINTS = 21
"""Coarse grid of the shared-A profile before the bounded refinement around its best point."""


def task_ceiling_axes(tasks: Iterable[str]) -> tuple[str, ...] | None:
    """The ceiling axes the sweep's tasks know (one built-in task with a known ceiling), or None."""
    found = set(tasks)
    return TASK_CEILING_AXES.get(found.pop()) if len(found) == 1 else None


def separating_axes(
    configs: Sequence[ConfigResult], ceiling_axes: Iterable[str], options: EffectOptions = DEFAULT_EFFECT_OPTIONS
) -> set[str]:
    """The ceiling axes, and the axes whose values already move A at the extrapolations' cut
    (judged on their window fits); `ablate` (a leave-one-out's row name) only where it is the
    sweep's one axis."""
    windows = [
        replace(c, fit=c.extrapolation.fit, boot=c.extrapolation.bootstrap)
        for c in configs
        if c.extrapolation is not None and c.extrapolation.predicts
    ]
    judged = effects(windows, options)
    real_axes = {e.axis for e in judged} - {ABLATE_AXIS}
    moved = {e.axis for e in judged if e.verdict == "asymptote" and (e.axis != ABLATE_AXIS or not real_axes)}
    return moved | set(ceiling_axes)


def ceiling_groups(configs: Sequence[ConfigResult], separating: set[str]) -> list[list[ConfigResult]]:
    """Configurations with a prediction, grouped by their values of the separating axes."""
    groups: dict[tuple[str, ...], list[ConfigResult]] = {}
    for c in configs:
        if c.extrapolation is None or not c.extrapolation.predicts:
            continue
        key = tuple(fmt_axis_value(c.axes.get(axis)) for axis in sorted(separating))
        groups.setdefault(key, []).append(c)
    return list(groups.values())


def shared_a(windows: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], options: FitOptions) -> float | None:
    """The A that minimises the summed squared error of the windows, each with its own B and
    Cmid (a coarse grid over A, then a bounded Brent search around its best); None when no A
    fits every window."""

    def total(a: float) -> float:
        held = options.replace(fix_a=float(a))
        sse = 0.0
        for window in windows:
            fit = fit_curves(window, held)
            if not fit.ok:
                return math.inf
            sse += fit.sse
        return sse

    lo, hi = options.a_bounds
    grid = np.linspace(lo, hi, A_GRID_POINTS)
    values = np.array([total(a) for a in grid])
    if not np.isfinite(values).any():
        return None
    best = int(np.argmin(values))
    step = grid[1] - grid[0]
    found = minimize_scalar(
        total, bounds=(max(lo, grid[best] - step), min(hi, grid[best] + step)), method="bounded", options={"xatol": 1e-4}
    )
    return float(found.x) if math.isfinite(found.fun) and found.fun <= values[best] else float(grid[best])


def share_ceilings(
    configs: Sequence[ConfigResult],
    options: FitOptions,
    *,
    ceiling_axes: Iterable[str] | None,
    n_boot: int,
    level: float,
    window: float = 0.1,
    seed: int = 0,
    effect_options: EffectOptions = DEFAULT_EFFECT_OPTIONS,
) -> list[ConfigResult]:
    """The configurations with each group's extrapolations redone at the group's A (module
    docstring; the same cut, target, bootstrap size and level as their own). `ceiling_axes` None:
    nothing is known about the ceilings, every configuration keeps its own."""
    if ceiling_axes is None:
        return list(configs)
    separating = separating_axes(configs, ceiling_axes, effect_options)
    refitted: dict[int, ConfigResult] = {}
    for group in ceiling_groups(configs, separating):
        if len(group) < 2:
            continue
        windows = [fit_window(c.curve_data(), c.extrapolation.fit_until) for c in group]  # type: ignore[union-attr]
        a = shared_a(windows, options)
        if a is None:
            continue
        for c in group:
            own = c.extrapolation
            assert own is not None
            shared = extrapolate(
                c.curve_data(), options.replace(fix_a=a), fit_until=own.fit_until, predict_at=own.predict_at,
                n_boot=n_boot, seed=seed, level=level, window=window,
            )  # fmt: skip
            if not shared.predicts:
                continue
            band = Interval(min(own.band.lo, shared.band.lo), max(own.band.hi, shared.band.hi))
            within = None if shared.observed is None else band.contains(shared.observed)
            extrapolation = replace(shared, band=band, within_band=within, shared_with=len(group))
            refitted[id(c)] = replace(c, extrapolation=extrapolation)
    return [refitted.get(id(c), c) for c in configs]
