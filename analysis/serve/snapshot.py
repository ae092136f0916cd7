"""What `sweep serve` shows, read from the store: the runs table and each configuration's points,
fitted sigmoid, band and extrapolation, as one JSON-ready dict per sweep.

Fits are kept by the data they were fitted on, so a new eval point refits only its own
configuration. On a big sweep every configuration gets its point fit, and the `detail` best (by
A) also their bootstrap band, extrapolation and share of p_best; the chart draws those curves and
the other configurations' points as one grey cloud (a thousand sigmoids would be one smear).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from analysis.ranking import ConfigResult, Curve, config_label, rank, rank_at_predict
from analysis.report.build import ReportOptions, _analyse_one, _default_axis, _value, analyse
from store import EvalRecord, RunRecord, Store

GRID_POINTS = 60
"""Points on which each fitted curve and its band are drawn (log-spaced in compute)."""
REREAD_ALL_ABOVE = 100
"""Runs with new points above which the whole sweep's points are read again in one query."""
CLOUD_POINTS = 20_000
"""At most this many points of the undrawn configurations go to the page (evenly thinned)."""


@dataclass(frozen=True)
class ServeOptions:
    compute: str | None = None
    predict_at: float | None = None
    """The target compute for extrapolation and p_best; None: the sweep's flops or GPU-hour
    budget where every run has one, else the largest compute reached so far rounded up to 1, 2
    or 5 x 10^k."""
    n_boot: int = 100
    detail: int = 20
    """Configurations (best by A) that get a band, an extrapolation and a p_best."""


class SweepView:
    """One sweep's page data, refitting only what changed since the last call."""

    def __init__(self, store: Store, sweep: str, options: ServeOptions = ServeOptions()):
        self.store, self.sweep, self.options = store, sweep, options
        self._fits: dict[tuple[str, str], ConfigResult] = {}
        self._detailed: dict[tuple[str, str, float | None], ConfigResult] = {}
        self._points: dict[str, list[EvalRecord]] = {}
        self._newest: dict[str, tuple[Any, ...]] = {}
        self._curves: dict[str, tuple[Any, Curve]] = {}

    def build(self) -> dict[str, Any]:
        store, opts = self.store, self.options
        runs = store.runs(self.sweep)
        last = store.last_eval_points(self.sweep)
        points = self._read_points(last)
        compute = opts.compute or _default_axis(points)
        attempts = store.attempt_counts(self.sweep)
        target = opts.predict_at or _target(runs, last, compute)

        groups: dict[str, list[Curve]] = {}
        axes_of: dict[str, dict[str, Any]] = {}
        curve_keys: dict[str, list[Any]] = {}
        curves_now: dict[str, tuple[Any, Curve]] = {}
        for run in runs:  # as analysis.report.build.read_configurations, from the points kept here
            axes = {k: v for k, v in run.axes.items() if k != "seed"}
            label = config_label(axes) or run.id
            key = (self._newest.get(run.id), run.state, run.axes.get("seed"), compute)
            kept = self._curves.get(run.id)
            if kept is None or kept[0] != key:  # only the runs that moved are rebuilt
                xy = [(x, p.pass_rate) for p in points.get(run.id, []) if (x := _value(p, compute)) is not None]
                kept = (key, Curve(run.id, run.axes.get("seed"), run.state, tuple(x for x, _ in xy), tuple(y for _, y in xy)))
            curves_now[run.id] = kept
            groups.setdefault(label, []).append(kept[1])
            curve_keys.setdefault(label, []).append((run.id, key))
            axes_of[label] = axes
        self._curves = curves_now
        keys = {label: _data_key(curve_keys[label]) for label, curves in groups.items() if any(c.compute for c in curves)}
        missing = [(label, axes_of[label], tuple(groups[label])) for label, key in keys.items() if (label, key) not in self._fits]
        for result in analyse(missing, ReportOptions(compute=compute, n_boot=0)):  # a process pool when many
            self._fits[(result.label, keys[result.label])] = result
        ranked = rank([self._fits[(label, key)] for label, key in keys.items()])
        best = [c for c in ranked if c.rank is not None][: opts.detail]
        detailed = []
        for c in best:
            memo = (c.label, keys[c.label], target)
            full = self._detailed.get(memo)
            if full is None:
                # with a target the band is the extrapolation's own bootstrap (EXTRAPOLATION_BOOT replicates)
                detail = ReportOptions(compute=compute, n_boot=0, predict_at=target) if target else ReportOptions(compute=compute, n_boot=opts.n_boot)
                full = _analyse_one((c.label, c.axes, c.curves), detail)
                self._detailed[memo] = full
            detailed.append(replace(full, rank=c.rank))
        if target:
            detailed = rank_at_predict(detailed)
        by_label = {c.label: c for c in ranked} | {c.label: c for c in detailed}
        live = {(c.label, keys[c.label]) for c in ranked}
        self._fits = {k: v for k, v in self._fits.items() if k in live}
        self._detailed = {k: v for k, v in self._detailed.items() if (k[0], k[1]) in live and k[2] == target}

        label_of = {c.run: label for label, curves in groups.items() for c in curves}
        x_max = max((max(c.compute) for cs in groups.values() for c in cs if c.compute), default=1.0)
        x_hi = max(x_max, target or 0.0)
        drawn = [_config_json(c, x_hi, detailed=True) for c in detailed]
        shown = {d.label for d in detailed}
        others = [c for c in ranked if c.label not in shown]
        cloud = _cloud(others) if len(others) > 0 else None
        if len(ranked) <= opts.detail:  # small sweep: unranked (flagged) configurations are drawn too
            drawn += [_config_json(c, x_hi, detailed=False) for c in others]
            cloud = None
        return {
            "sweep": self.sweep,
            "compute": compute,
            "predict_at": target,
            "runs": [_run_json(r, last.get(r.id), attempts.get(r.id, 0), by_label.get(label_of.get(r.id, "")), compute) for r in runs],
            "configs": drawn,
            "cloud": cloud,
            "n_configs": len(ranked),
        }

    def _read_points(self, last: Mapping[str, EvalRecord]) -> dict[str, list[EvalRecord]]:
        """Every run's eval points; after the first call only the runs whose newest point moved
        are read again (the whole sweep when many did)."""
        newest = {run: (p.step, p.pass_rate, p.flops, p.gpu_hours) for run, p in last.items()}
        changed = [run for run, key in newest.items() if self._newest.get(run) != key]
        if not self._newest or len(changed) > REREAD_ALL_ABOVE:
            self._points = self.store.sweep_eval_points(self.sweep)
        else:
            for run in changed:
                self._points[run] = self.store.eval_points(run)
        for run in set(self._points) - set(newest):  # every point of the run was dropped
            del self._points[run]
        self._newest = newest
        return self._points

    def run_page(self, run_id: str) -> dict[str, Any]:
        """One run: its train metrics by step, its eval points, attempts and provenance."""
        store = self.store
        run = store.get_run(run_id)
        metrics = store.train_metrics(run.id)
        names = sorted({k for _, m in metrics for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        series = {
            name: {"step": [s for s, m in metrics if _num(m.get(name)) is not None], "value": [_num(m.get(name)) for s, m in metrics if _num(m.get(name)) is not None]}
            for name in names
        }
        points = store.eval_points(run.id)
        attempts = store.attempts(run.id)
        return {
            "id": run.id,
            "sweep": run.sweep,
            "state": run.state,
            "reason": run.state_reason,
            "step": run.step,
            "axes": run.axes,
            "budget": run.budget,
            "run_dir": run.run_dir,
            "metrics": series,
            "evals": {
                "step": [p.step for p in points],
                "pass_rate": [p.pass_rate for p in points],
                "flops": [p.flops for p in points],
                "gpu_hours": [p.gpu_hours for p in points],
            },
            "attempts": [
                {
                    "number": a.number, "state": a.state, "executor": a.executor, "job_id": a.job_id, "node": a.node,
                    "reason": a.exit_reason, "resumed_from_step": a.resumed_from_step,
                    "started_at": a.started_at.isoformat() if a.started_at else None,
                    "ended_at": a.ended_at.isoformat() if a.ended_at else None,
                }  # fmt: skip
                for a in attempts
            ],
            "provenance": next((a.provenance for a in reversed(attempts) if a.provenance), None),
            "config": run.config,
        }


def _target(runs: Sequence[RunRecord], last: Mapping[str, EvalRecord], compute: str) -> float | None:
    budgets = [b for r in runs if isinstance(b := r.budget.get(compute), (int, float)) and b > 0]
    if runs and len(budgets) == len(runs):
        return float(max(budgets))
    reached = [v for p in last.values() if (v := _value(p, compute)) is not None and v > 0]
    return _round_up(max(reached)) if reached else None


def _round_up(value: float) -> float:
    """The next of 1, 2, 5 x 10^k at or above `value`: a target that moves rarely as runs advance
    (each move refits every detailed configuration)."""
    decade = 10 ** math.floor(math.log10(value))
    return next(m * decade for m in (1, 2, 5, 10) if m * decade >= value * (1 - 1e-12))


def _data_key(curve_keys: Sequence[Any]) -> str:
    """A configuration's data, as the (run, newest point, state, seed) of each of its runs."""
    return hashlib.blake2b(repr(curve_keys).encode(), digest_size=16).hexdigest()


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _run_json(run: RunRecord, last: EvalRecord | None, attempts: int, config: ConfigResult | None, compute: str) -> dict[str, Any]:
    return {
        "id": run.id,
        "axes": run.axes,
        "config": config.label if config else None,
        "state": run.state,
        "reason": run.state_reason,
        "step": run.step,
        "budget_steps": run.budget.get("steps"),
        "pass_rate": last.pass_rate if last else None,
        "compute": _value(last, compute) if last else None,
        "p_best": config.p_best if config else None,
        "attempts": attempts,
    }


def _config_json(c: ConfigResult, x_hi: float, *, detailed: bool) -> dict[str, Any]:
    pos = [x for curve in c.curves for x in curve.compute if x > 0]
    lo = min(pos) if pos else x_hi / 100
    fit_until = c.extrapolation.fit_until if c.extrapolation else max(pos, default=x_hi)
    grid = np.geomspace(lo, fit_until, GRID_POINTS)
    out: dict[str, Any] = {
        "label": c.label,
        "axes": c.axes,
        "rank": c.rank,
        "p_best": c.p_best,
        "fit": {k: _num(getattr(c.fit, k)) for k in ("A", "B", "Cmid", "R0")} if c.fit.ok else None,
        "flags": list(c.fit.flags),
        "seeds": [{"run": s.run, "seed": s.seed, "x": list(s.compute), "y": list(s.pass_rate)} for s in c.curves],
        "curve": {"x": grid.tolist(), "y": _clean(c.fit.predict(grid))} if c.fit.ok else None,
        "band": None,
        "extrapolation": None,
    }
    boot = c.extrapolation.bootstrap if c.extrapolation else c.boot
    if detailed and boot is not None and c.fit.ok:
        band_lo, band_hi = boot.band(grid)
        out["band"] = {"x": grid.tolist(), "lo": _clean(band_lo), "hi": _clean(band_hi)}
    e = c.extrapolation
    if e is not None and e.predicts and e.predict_at > fit_until:
        ahead = np.geomspace(fit_until, e.predict_at, GRID_POINTS // 2)
        out["extrapolation"] = {
            "x": ahead.tolist(), "y": _clean(e.fit.predict(ahead)), "predict_at": e.predict_at,
            "predicted": _num(e.predicted), "band": [_num(e.band.lo), _num(e.band.hi)],
        }  # fmt: skip
    return out


def _cloud(configs: Sequence[ConfigResult]) -> dict[str, list[float]]:
    """The points of configurations not drawn as curves, thinned evenly to about CLOUD_POINTS;
    each run's newest point is always kept (it is what moved)."""
    curves = [s for c in configs for s in c.curves if s.compute]
    stride = max(1, math.ceil(sum(len(s.compute) for s in curves) / CLOUD_POINTS))
    xs: list[float] = []
    ys: list[float] = []
    for s in curves:
        keep = list(range(len(s.compute) - 1, -1, -stride))
        xs += [s.compute[i] for i in keep]
        ys += [s.pass_rate[i] for i in keep]
    return {"x": xs, "y": ys}


def _clean(values: Any) -> list[float | None]:
    return [_num(float(v)) for v in np.asarray(values, dtype=float)]
