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

Where the task also knows the ceiling's *value* (its runs record it with each evaluation,
`ceiling`; sumk's is the share of its held-out problems that fit the generation cap, plus a
guess's chance on the rest; `analysis.report.build.sweep_task_ceilings` reads it), a group (one configuration alone included) is first tested against it: the hypothesis
that the recipe learns everything the task allows, A = the task's ceiling, is kept unless the
windows reject it (an F-test at `TASK_CEILING_LEVEL` of A held there against A fitted below it,
`holds_ceiling`); where the group's windows together reject it, each member is tested on its own.
Kept, a configuration is extrapolated with A at the task's ceiling; the members that reject it
share one fitted A below it (two or more) or keep their own. A window that has not yet reached
its plateau cannot reject it, and a fitted A there is what the first quarter or half cannot pin
down (docs/predictions.md); a configuration that stops short of the ceiling rejects it once its
window shows the plateau, and one member's plateau says nothing about the others'. The
members' own tests are made at a level that keeps the group's family-wise error at the pooled
test's (`member_level`). The band is the hull of the configuration's own band and the refit's,
as for a shared A, so a held ceiling never narrows it. A member whose window rejects the ceiling
is predicted by the plateau its window shows, and its band also takes in the band of the held
fit: a window rejects the ceiling by where it flattens, and every sumk run measured that did so
(the budget-9 runs' plateau at 0.30-0.33 of a 0.37 ceiling) climbed on after the cut, beyond its
own band (docs/predictions.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.stats import f as f_dist

from analysis.effects import DEFAULT_EFFECT_OPTIONS, EffectOptions
from analysis.extrapolation import Extrapolation, extrapolate, fit_window
from analysis.fit import fit_curves
from analysis.intervals import Interval
from analysis.options import FitOptions
from analysis.problem import num_free
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


TASK_CEILING_LEVEL = 0.95
"""The F-test's level: the windows reject A = the task's ceiling beyond this quantile."""

_CEILING_TOL = 1e-9
"""Members whose task ceilings differ by more than this have no common one."""


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


Windows = Sequence[Sequence[tuple[np.ndarray, np.ndarray]]]


def _summed_sse(windows: Windows, options: FitOptions) -> Callable[[float], float]:
    """A -> the windows' summed squared error with A held there, each its own B and Cmid."""

    def total(a: float) -> float:
        held = options.replace(fix_a=float(a))
        sse = 0.0
        for window in windows:
            fit = fit_curves(window, held)
            if not fit.ok:
                return math.inf
            sse += fit.sse
        return sse

    return total


def shared_a(windows: Windows, options: FitOptions, *, upper: float | None = None) -> float | None:
    """The A that minimises the summed squared error of the windows, each with its own B and
    Cmid (a coarse grid over A, then a bounded Brent search around its best), at most `upper`;
    None when no A fits every window."""
    total = _summed_sse(windows, options)
    lo, hi = options.a_bounds
    if upper is not None:
        hi = min(hi, upper)
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


def holds_ceiling(windows: Windows, ceiling: float, options: FitOptions, level: float = TASK_CEILING_LEVEL) -> bool:
    """Whether the windows are consistent with A = `ceiling`: an F-test of the summed squared
    error with A held there against one A fitted at most there (each window its own B and Cmid);
    False when nothing fits with A held there.

    An RL curve's residuals are not independent (the policy wanders from eval to eval), and
    correlated residuals make an F-test reject far too often; so the statistic and its degrees of
    freedom are deflated by (1 - rho) / (1 + rho), rho the residuals' lag-1 autocorrelation under
    the fitted A (an AR(1) series' variance inflation)."""
    total = _summed_sse(windows, options)
    held = total(ceiling)
    if not math.isfinite(held):
        return False
    fitted = shared_a(windows, options, upper=ceiling)
    if fitted is None or total(fitted) >= held:
        return True
    free = total(fitted)
    rho = _lag1_autocorrelation(windows, options.replace(fix_a=fitted))
    deflate = (1 - rho) / (1 + rho)
    n = sum(len(c) for window in windows for c, _ in window)
    params = len(windows) * (num_free(options) - 1) + 1
    dof = n * deflate - params
    if dof < 1 or free <= 0:
        return False
    statistic = (held - free) / (free / (n - params)) * deflate
    return statistic <= float(f_dist.ppf(level, 1, dof))


def _lag1_autocorrelation(windows: Windows, options: FitOptions) -> float:
    """The lag-1 autocorrelation of the windows' residuals (each seed's in compute order), in
    [0, 0.9]: a negative one does not widen the test, and above 0.9 nothing is left to test."""
    products, squares = 0.0, 0.0
    for window in windows:
        fit = fit_curves(window, options)
        for c, r in window:
            order = np.argsort(c, kind="stable")
            resid = np.asarray(r, dtype=float)[order] - fit.predict(np.asarray(c, dtype=float)[order])
            products += float(np.sum(resid[1:] * resid[:-1]))
            squares += float(np.sum(resid**2))
    return float(np.clip(products / squares, 0.0, 0.9)) if squares > 0 else 0.0


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
    task_ceilings: Mapping[str, float] | None = None,
) -> list[ConfigResult]:
    """The configurations with each group's extrapolations redone at the group's A (module
    docstring; the same cut, target, bootstrap size and level as their own). `ceiling_axes` None:
    nothing is known about the ceilings, every configuration keeps its own. `task_ceilings`: label
    -> the task's ceiling where its runs report one (`sweep_task_ceilings`); a group whose members
    share one is held there unless its windows reject it (`_ceiling_parts`)."""
    if ceiling_axes is None:
        return list(configs)
    separating = separating_axes(configs, ceiling_axes, effect_options)

    def at_a(c: ConfigResult, a: float) -> Extrapolation:
        own = c.extrapolation
        assert own is not None
        return extrapolate(
            c.curve_data(), options.replace(fix_a=a), fit_until=own.fit_until, predict_at=own.predict_at,
            n_boot=n_boot, seed=seed, level=level, window=window,
        )  # fmt: skip

    refitted: dict[int, ConfigResult] = {}
    for group in ceiling_groups(configs, separating):
        ceiling = _common_ceiling(group, task_ceilings or {})
        parts = _ceiling_parts(group, options, ceiling)
        for members, a, held in parts:
            for c in members:
                shared = at_a(c, a)
                if not shared.predicts:
                    continue
                extrapolation = replace(
                    _hull(shared, c.extrapolation.band), shared_with=len(members), task_ceiling=a if held else None  # type: ignore[union-attr]
                )
                refitted[id(c)] = replace(c, extrapolation=extrapolation)
        if ceiling is None:
            continue
        held_ids = {id(c) for members, _, held in parts if held for c in members}
        for c in group:  # rejected the task's ceiling: its band still reaches the held prediction's
            if id(c) in held_ids:
                continue
            current = refitted.get(id(c), c)
            held_there = at_a(c, ceiling)
            if held_there.predicts:
                refitted[id(c)] = replace(current, extrapolation=_hull(current.extrapolation, held_there.band))  # type: ignore[arg-type]
    return [refitted.get(id(c), c) for c in configs]


def _hull(extrapolation: Extrapolation, other: Interval) -> Extrapolation:
    """The extrapolation with its band widened to cover `other` too (its coverage redone)."""
    band = Interval(min(extrapolation.band.lo, other.lo), max(extrapolation.band.hi, other.hi))
    within = None if extrapolation.observed is None else band.contains(extrapolation.observed)
    return replace(extrapolation, band=band, within_band=within)


def _ceiling_parts(
    group: Sequence[ConfigResult], options: FitOptions, ceiling: float | None
) -> list[tuple[list[ConfigResult], float, bool]]:
    """How one ceiling group is extrapolated: (members, their A, whether it is the task's ceiling).

    Without a task ceiling the group shares its fitted A. With one, the group is held there when
    its windows together do not reject it (pooled, the test is not fooled by one member's slow
    climb); when they do, each member whose own window does not reject it is still held (one
    member's plateau below it says nothing about the others'), and the members that reject it
    share a fitted A below it."""
    windows = {id(c): fit_window(c.curve_data(), c.extrapolation.fit_until) for c in group}  # type: ignore[union-attr]
    held: list[ConfigResult] = []
    if ceiling is not None:
        if holds_ceiling(list(windows.values()), ceiling, options):
            held = list(group)
        elif len(group) > 1:
            level = member_level(len(group))
            held = [c for c in group if holds_ceiling([windows[id(c)]], ceiling, options, level)]
    rest = [c for c in group if all(c is not h for h in held)]
    parts: list[tuple[list[ConfigResult], float, bool]] = [(held, ceiling, True)] if held and ceiling is not None else []
    if len(rest) > 1:
        a = shared_a([windows[id(c)] for c in rest], options, upper=ceiling)
        if a is not None:
            parts.append((rest, a, False))
    return parts


def member_level(members: int, level: float = TASK_CEILING_LEVEL) -> float:
    """The level of each member's own test once its group's pooled test has rejected the ceiling:
    Sidak's level**(1/k), so that k members that all reach the ceiling keep it together with
    probability `level`. At 95% each, one of six true members would be rejected a quarter of the
    time (1 - 0.95**6), and a rejected member is extrapolated with the plateau its window
    happens to show (docs/predictions.md: two of the leave-one-out's six at 25%)."""
    return level ** (1.0 / max(members, 1))


def _common_ceiling(group: Sequence[ConfigResult], task_ceilings: Mapping[str, float]) -> float | None:
    """The task ceiling every member of the group has (within `_CEILING_TOL`), else None."""
    if not all(c.label in task_ceilings for c in group):
        return None
    known = [task_ceilings[c.label] for c in group]
    return known[0] if max(known) - min(known) <= _CEILING_TOL else None
