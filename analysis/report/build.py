"""`sweep report`: fit every configuration's curve, rank, compare, extrapolate, judge each axis.

This module reads the store and computes (the pure ranking, comparisons and effects are
`analysis.ranking`); `analysis.report.render` turns a Report into a table, Markdown, CSV, JSON,
HTML and plots. A configuration is a run's axis values without its seed: the seeds of one
configuration are fitted jointly (one A, B, Cmid) and bootstrapped together.

Ranking (the paper's question, "which choice raises the ceiling"): by A, then B, among the
configurations whose fit carries no flag (`--include-flagged` ranks those too). Adjacent ranked
configurations are compared with the paper's rule: A's within the margin (or with overlapping
intervals) are refitted with a shared A and compared on B.
"""

from __future__ import annotations

import difflib
import math
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal

from analysis import (
    PAPER_MARGIN,
    AxisEffect,
    Comparison,
    FitOptions,
    bootstrap,
    extrapolate,
    fit_curves,
)
from analysis.trackers import tracker_links
from analysis.ceilings import share_ceilings, task_ceiling_axes
from analysis.effects import EffectOptions
from analysis.ranking import ConfigResult, Curve, comparisons, config_label, effects, rank, rank_at_predict
from store import COMPUTE_AXES, EvalRecord, Store, same_seed_reruns

SCHEMA_VERSION = 2
MAX_BOOTSTRAP = 100_000
"""Bootstrap samples at most: the intervals' Monte Carlo error is ~1% of their width by 10,000;
a billion would allocate gigabytes for nothing."""
PARALLEL_ABOVE = 8  # configurations; below this a process pool costs more than it saves


@dataclass(frozen=True)
class ReportOptions:
    compute: str | None = None  # None: gpu_hours where every run has them, else flops
    method: Literal["fast", "reference"] = "fast"
    r0: Literal["first", "fit"] = "first"
    cutoff: float = 0.0
    n_boot: int = 200
    level: float = 0.95
    margin: float = PAPER_MARGIN
    include_flagged: bool = False
    fit_until: float | None = None
    predict_at: float | None = None
    relative: bool = False
    """fit_until and predict_at are fractions of each configuration's own compute range (its
    largest compute), as `--fit-until 50% --predict 100%` gives them."""
    workers: int | None = None  # None: the number of cores
    ceiling_axes: tuple[str, ...] | None = None
    """The axes that set the ceiling (`--ceiling-axes`): extrapolations of configurations that agree
    on them share one A (analysis.ceilings); None: what the sweep's task knows (`--own-ceilings`
    turns sharing off)."""
    own_ceilings: bool = False

    def __post_init__(self) -> None:
        if self.compute is not None and self.compute not in COMPUTE_AXES:
            raise ValueError(f"compute must be one of {', '.join(COMPUTE_AXES)}, got {self.compute!r}")
        if self.fit_until is not None and self.predict_at is None:
            raise ValueError("--fit-until needs --predict (the compute to predict at)")
        for name, value in (("--cutoff", self.cutoff), ("--fit-until", self.fit_until), ("--predict", self.predict_at)):
            if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and name != "--cutoff")):
                raise ValueError(f"{name} must be a finite number {'>= 0' if name == '--cutoff' else '> 0'}, got {value}")
        show = (lambda v: f"{v * 100:g}%") if self.relative else (lambda v: f"{v:g}")
        if self.relative and self.fit_until is not None and self.fit_until >= 1:
            raise ValueError(f"--fit-until {show(self.fit_until)} must be below 100% (of each configuration's compute)")
        if self.fit_until is not None and self.predict_at is not None and self.predict_at <= self.fit_until:
            raise ValueError(f"--predict ({show(self.predict_at)}) must lie beyond --fit-until ({show(self.fit_until)})")
        if not self.relative and self.fit_until is not None and self.cutoff >= self.fit_until:
            raise ValueError(f"--cutoff ({self.cutoff:g}) must lie below --fit-until ({self.fit_until:g}): nothing left to fit")
        if not 0 <= self.n_boot <= MAX_BOOTSTRAP:
            raise ValueError(f"--bootstrap must be in [0, {MAX_BOOTSTRAP}], got {self.n_boot}")

    def fit_options(self) -> FitOptions:
        return FitOptions(method=self.method, r0=self.r0, cutoff=self.cutoff)


@dataclass(frozen=True)
class Report:
    sweep: str
    options: ReportOptions
    compute: str
    configs: tuple[ConfigResult, ...]
    comparisons: tuple[Comparison, ...] = ()
    effects: tuple[AxisEffect, ...] = ()
    generated_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    reruns: dict[str, str] = field(default_factory=dict)
    """Same-seed reruns kept out of the fits: {rerun id: the run it reproduces} (split_reruns)."""
    trackers: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    """Each run's experiment-tracker entries (the sweep file's `tracking:` block), by run id."""

    @property
    def ranked(self) -> list[ConfigResult]:
        return [c for c in self.configs if c.rank is not None]


# ---------------------------------------------------------------------------------------------
# Building


class ReportError(ValueError):
    """The sweep has nothing to fit on the chosen axis; the message says why and what to give."""


def build_report(store: Store, sweep: str, options: ReportOptions = ReportOptions()) -> Report:
    """Read the sweep's curves from the store and analyse them."""
    compute, groups, axes_of = read_configurations(store, sweep, options.compute)
    require_data(store, sweep, compute, groups)
    groups, reruns = split_reruns(store, sweep, groups)
    configs = analyse(
        [(label, axes_of[label], tuple(curves)) for label, curves in groups.items() if any(c.compute for c in curves)],
        options,
    )
    ceilings = sweep_ceiling_axes(store, sweep, axes_of, options.ceiling_axes, own=options.own_ceilings)
    report = finish_report(sweep, options, compute, configs, ceilings, sweep_task_ceilings(store, sweep))
    return replace(report, reruns=reruns, trackers=run_trackers(store, sweep))


def sweep_task_ceilings(store: Store, sweep: str) -> dict[str, float]:
    """Configuration label -> its task's ceiling, for the configurations whose runs all report
    the same one: the highest pass rate their held-out set allows under their generation cap,
    which the run's evaluations record where the task knows it (`ceiling` in an eval point's
    metrics; sumk does, except under interruption)."""
    last = store.last_eval_points(sweep)
    found: dict[str, set[float | None]] = {}
    for run in store.runs(sweep):
        label = config_label({k: v for k, v in run.axes.items() if k != "seed"}) or run.id
        point = last.get(run.id)
        value = None if point is None else point.metrics.get("ceiling")
        found.setdefault(label, set()).add(float(value) if isinstance(value, (int, float)) else None)
    known = {label: next(iter(values)) for label, values in found.items() if len(values) == 1}
    return {label: value for label, value in known.items() if value is not None}


def sweep_ceiling_axes(
    store: Store, sweep: str, axes_of: dict[str, dict[str, Any]], declared: tuple[str, ...] | None, *, own: bool
) -> tuple[str, ...] | None:
    """The axes that set the sweep's ceilings (analysis.ceilings): `declared` (each must be an axis
    of the sweep), else what its task knows; None with `own` or where nothing is known."""
    if own:
        return None
    if declared is not None:
        known = sorted({k for axes in axes_of.values() for k in axes})
        for axis in declared:
            if axis not in known:
                close = difflib.get_close_matches(axis, known, n=1)
                hint = f" (closest: {close[0]})" if close else ""
                raise ReportError(f"--ceiling-axes: {axis!r} is not an axis of sweep {sweep}{hint}; its axes: {', '.join(known)}")
        return declared
    return task_ceiling_axes(str((r.config.get("data") or {}).get("task", "sort6")) for r in store.runs(sweep))


def require_data(store: Store, sweep: str, compute: str, groups: dict[str, list[Curve]]) -> None:
    """Refuse a sweep without a point to fit on `compute`: one line that says what is missing
    (no run has reported, or the axis has no data: every point is 0 there) and what to give."""
    curves = [c for cs in groups.values() for c in cs]
    if not any(c.compute for c in curves):
        states = ", ".join(f"{n} {state}" for state, n in sorted(Counter(str(c.state) for c in curves).items()))
        raise ReportError(
            f"sweep {sweep!r} has no evaluation point yet ({states or 'no runs'}): nothing to fit; "
            f"see `sweep status {sweep}`"
        )
    if any(v > 0 for c in curves for v in c.compute):
        return
    points = [p for pts in store.sweep_eval_points(sweep).values() for p in pts]
    with_data = [axis for axis in COMPUTE_AXES if any((_value(p, axis) or 0) > 0 for p in points)]
    raise ReportError(
        f"the compute axis {compute!r} has no data in sweep {sweep!r} (every point's {compute} is 0); "
        f"give --compute {' or '.join(with_data) if with_data else 'another axis'}"
    )


def split_reruns(store: Store, sweep: str, groups: dict[str, list[Curve]]) -> tuple[dict[str, list[Curve]], dict[str, str]]:
    """Same-seed reruns out of the fits (store.same_seed_reruns): a rerun reproduces its run, it
    is not an independent replicate, and counting its points again would narrow the intervals for
    nothing (docs/decisions.md). Returns the groups without them and {rerun id: the run it reproduces}."""
    reruns = same_seed_reruns(store.runs(sweep))
    kept = {label: [c for c in curves if c.run not in reruns] for label, curves in groups.items()}
    return {label: curves for label, curves in kept.items() if curves}, reruns


def run_trackers(store: Store, sweep: str) -> dict[str, list[dict[str, str]]]:
    """Links to each run's tracker entries; empty without a `tracking:` block."""
    record = store.get_sweep(sweep)
    block = ((record.spec if record else {}).get("grid") or {}).get("tracking")
    if not block:
        return {}
    return {r.id: tracker_links(block, sweep, r.id, r.run_dir) for r in store.runs(sweep)}


def read_configurations(
    store: Store, sweep: str, compute: str | None = None
) -> tuple[str, dict[str, list[Curve]], dict[str, dict[str, Any]]]:
    """The sweep's curves grouped by configuration (axis values without the seed), on `compute`
    (default: gpu_hours where every run has them, else generated tokens, else flops): (axis, curves by label, axes by label)."""
    runs = store.runs(sweep)
    points = store.sweep_eval_points(sweep)
    compute = compute or _default_axis(points)
    groups: dict[str, list[Curve]] = {}
    axes_of: dict[str, dict[str, Any]] = {}
    for run in runs:
        axes = {k: v for k, v in run.axes.items() if k != "seed"}
        label = config_label(axes) or run.id
        pts = [p for p in points.get(run.id, []) if _value(p, compute) is not None]
        curve = Curve(
            run.id,
            run.axes.get("seed", run.config.get("seed")),  # a native sweep of one seed has it in the config
            run.state,
            tuple(v for p in pts if (v := _value(p, compute)) is not None),
            tuple(p.pass_rate for p in pts),
        )
        groups.setdefault(label, []).append(curve)
        axes_of[label] = axes
    return compute, groups, axes_of


def analyse(
    groups: Sequence[tuple[str, dict[str, Any], tuple[Curve, ...]]], options: ReportOptions
) -> list[ConfigResult]:
    """Fit (and bootstrap, and extrapolate) every configuration, in parallel when there are many."""
    workers = options.workers or len(os.sched_getaffinity(0))
    if len(groups) >= PARALLEL_ABOVE and workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            return list(
                pool.map(_analyse_one, groups, [options] * len(groups), chunksize=max(1, len(groups) // (4 * workers)))
            )
    return [_analyse_one(g, options) for g in groups]


def finish_report(
    sweep: str,
    options: ReportOptions,
    compute: str,
    configs: list[ConfigResult],
    ceiling_axes: tuple[str, ...] | None = None,
    task_ceilings: dict[str, float] | None = None,
) -> Report:
    if options.predict_at is not None and ceiling_axes is not None:
        configs = share_ceilings(
            configs, options.fit_options(), ceiling_axes=ceiling_axes, n_boot=max(options.n_boot, 50),
            level=options.level, effect_options=EffectOptions(margin=options.margin, level=options.level),
            task_ceilings=task_ceilings,
        )  # fmt: skip
    ranked = rank(configs, include_flagged=options.include_flagged)
    if options.predict_at is not None:
        ranked = rank_at_predict(ranked)
    return Report(
        sweep=sweep,
        options=options,
        compute=compute,
        configs=tuple(ranked),
        comparisons=tuple(
            comparisons(
                ranked, margin=options.margin, n_boot=options.n_boot, level=options.level, options=options.fit_options()
            )
        ),
        effects=tuple(effects(ranked, EffectOptions(margin=options.margin, level=options.level))),
    )


def _analyse_one(group: tuple[str, dict[str, Any], tuple[Curve, ...]], options: ReportOptions) -> ConfigResult:
    label, axes, curves = group
    fit_options = options.fit_options()
    data = [(c.compute, c.pass_rate) for c in curves if c.compute]
    point = fit_curves(data, fit_options)
    boot = None
    if options.n_boot and point.ok:
        boot = bootstrap(data, fit_options, n_boot=options.n_boot, level=options.level, fit=point)
    extrap = None
    if options.predict_at is not None:
        own_range = max(max(c) for c, _ in data)
        scale = own_range if options.relative else 1.0
        fit_until = own_range if options.fit_until is None else options.fit_until * scale  # no --fit-until: all data
        if fit_until <= options.cutoff:
            share = f" = {options.fit_until * 100:g}% of its compute" if options.relative and options.fit_until else ""
            raise ReportError(
                f"configuration {label}: --cutoff ({options.cutoff:g}) lies at or beyond its --fit-until "
                f"({fit_until:g}{share}): nothing left to fit; lower --cutoff"
            )
        extrap = extrapolate(
            data, fit_options, fit_until=fit_until, predict_at=options.predict_at * scale,
            n_boot=max(options.n_boot, 50), level=options.level,
        )  # fmt: skip
    return ConfigResult(label=label, axes=axes, curves=curves, fit=point, boot=boot, extrapolation=extrap)


# ---------------------------------------------------------------------------------------------
# Helpers


def _default_axis(points: dict[str, list[EvalRecord]]) -> str:
    """GPU-hours where every run has them; else generated tokens where every run counts them (a
    CPU run: its FLOPs are mostly training FLOPs, which fall as the zero-variance filter drops
    solved groups, so late steps look cheap and the curve seems to speed up; generation, what a
    GPU run's hours mostly pay for, costs every step the same; docs/predictions.md); else FLOPs."""
    later = [p for pts in points.values() for p in pts if p.step > 0]
    if later and all(p.gpu_hours > 0 for p in later):
        return "gpu_hours"
    return "tokens" if later and all(p.tokens > 0 for p in later) else "flops"


def _value(point: EvalRecord, compute: str) -> float | None:
    value = float(point.step) if compute == "step" else getattr(point, compute)
    return None if value is None or not math.isfinite(value) else float(value)
