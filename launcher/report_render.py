"""Rendering a Report: rich table and JSON (schema: docs/report-schema.md, report.schema.json)."""

from __future__ import annotations

import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from analysis import AxisEffect, Comparison, Extrapolation, Interval
from launcher.report import SCHEMA_VERSION, ConfigResult, Report

PARAMS = ("A", "B", "Cmid")


# ---------------------------------------------------------------------------------------------
# JSON


def to_json_dict(report: Report) -> dict[str, Any]:
    opts = report.options
    return {
        "schema": "scalesweep.report",
        "schema_version": SCHEMA_VERSION,
        "sweep": report.sweep,
        "generated_at": report.generated_at.isoformat(),
        "compute_axis": report.compute,
        "fit": {"method": opts.method, "r0": opts.r0, "cutoff": opts.cutoff, "include_flagged": opts.include_flagged},
        "intervals": {"level": opts.level, "n_boot": opts.n_boot} if opts.n_boot else None,
        "margin": opts.margin,
        "runs": [_config_json(c) for c in report.configs],
        "comparisons": [_comparison_json(c) for c in report.comparisons],
        "effects": [_effect_json(e) for e in report.effects],
    }


def render_json(report: Report) -> str:
    return json.dumps(to_json_dict(report), indent=2, allow_nan=False)


def _config_json(c: ConfigResult) -> dict[str, Any]:
    fit = c.fit
    return {
        "rank": c.rank,
        "label": c.label,
        "axes": c.axes,
        "run_ids": c.runs,
        "seeds": c.seeds,
        "states": [curve.state for curve in c.curves],
        **{name: _num(getattr(fit, name)) for name in ("A", "B", "Cmid", "R0", "r2", "sse")},
        "n_points": fit.n_points,
        "compute_range": [_num(fit.compute_min), _num(fit.compute_max)],
        "method": fit.method,
        "flags": list(fit.flags),
        "intervals": {name: _interval(getattr(c.boot, name)) for name in PARAMS} if c.boot else None,
        "extrapolation": _extrapolation_json(c.extrapolation) if c.extrapolation else None,
    }


def _extrapolation_json(e: Extrapolation) -> dict[str, Any]:
    return {
        "fit_until": e.fit_until,
        "predict_at": e.predict_at,
        "predicted": _num(e.predicted),
        "band": _interval(e.band),
        "observed": _num(e.observed),
        "error": _num(e.error),
        "within_band": e.within_band,
    }


def _comparison_json(c: Comparison) -> dict[str, Any]:
    return {
        "labels": list(c.labels),
        "rule": c.rule,
        "winner": c.winner,
        "resolved": c.resolved,
        "reason": c.reason,
        "A": [_num(a) for a in c.A],
        "shared_A": _num(c.shared_A),
        "B_shared": [_num(b) for b in c.B] if c.B else None,
    }


def _effect_json(e: AxisEffect) -> dict[str, Any]:
    return {
        "axis": e.axis,
        "reference": e.reference,
        "verdict": e.verdict,
        "max_delta_A": _num(e.max_delta_A),
        "max_B_ratio": _num(e.max_B_ratio),
        "max_Cmid_ratio": _num(e.max_Cmid_ratio),
        "values": [
            {
                "value": g.value,
                "n_fits": g.n_fits,
                **{name: _num(getattr(g, name)) for name in PARAMS},
                **{f"{name}_interval": _interval(getattr(g, f"{name}_interval")) for name in PARAMS},
                "delta_A": _num(g.delta_A),
                "B_ratio": _num(g.B_ratio),
                "Cmid_ratio": _num(g.Cmid_ratio),
            }
            for g in e.groups
        ],
    }


def _num(value: float | None) -> float | None:
    """JSON has no NaN: unknown numbers are null."""
    return None if value is None or not math.isfinite(value) else float(value)


def _interval(interval: Interval) -> list[float | None] | None:
    return [_num(interval.lo), _num(interval.hi)] if interval.known else None


# ---------------------------------------------------------------------------------------------
# Table


def render_table(report: Report, console: Console) -> None:
    console.print(fit_table(report))
    if report.comparisons:
        console.print(
            "[bold]Comparisons[/] (paper's rule: A's within the margin are refitted with a shared A and compared on B)"
        )
        for c in report.comparisons:
            console.print(f"  {c.reason}", soft_wrap=True)
    if report.effects:
        console.print(effects_table(report))


def fit_table(report: Report) -> Table:
    configs = report.configs
    axis_keys: list[str] = []
    for c in configs:
        axis_keys += [k for k in c.axes if k not in axis_keys]
    with_seeds = any(len(c.curves) > 1 for c in configs)
    with_intervals = any(c.boot for c in configs)
    with_extrapolation = any(c.extrapolation for c in configs)
    caption = "ranked by A, then B; flagged fits are not ranked"
    if with_intervals:
        caption += f"; lo-hi: {report.options.level:.0%} bootstrap intervals"
    table = Table(title=f"sweep {report.sweep}: fits of R(C) = R0 + (A - R0) / (1 + (Cmid/C)^B), C = {report.compute}",
                  title_justify="left", caption=caption)  # fmt: skip
    table.add_column("#", justify="right")
    for key in axis_keys or ["run"]:
        table.add_column(key, overflow="fold")
    if with_seeds:
        table.add_column("seeds", justify="right")
    for name in ("A", "B", "Cmid"):
        table.add_column(f"{name} (lo-hi)" if with_intervals else name, justify="right")
    for name in ("R0", "R²", "n"):
        table.add_column(name, justify="right")
    if with_extrapolation:
        table.add_column("predicted", justify="right")
    table.add_column("flags", style="yellow", overflow="fold")
    for c in configs:
        fit = c.fit
        row = [str(c.rank) if c.rank else "-"]
        row += [_value(c.axes.get(k)) for k in axis_keys] if axis_keys else [c.runs[0]]
        if with_seeds:
            row.append(str(len(c.curves)))
        for name, spec in (("A", ".3f"), ("B", ".2f"), ("Cmid", ".3g")):
            text = _fmt(getattr(fit, name), spec)
            if with_intervals:
                text += f" [dim]({_range(getattr(c.boot, name) if c.boot else None, spec)})[/]"
            row.append(text)
        row += [_fmt(fit.R0, ".3f"), _fmt(fit.r2, ".3f"), str(fit.n_points)]
        if with_extrapolation:
            row.append(_extrapolation_cell(c.extrapolation))
        row.append(", ".join(fit.flags))
        table.add_row(*row)
    return table


def effects_table(report: Report) -> Table:
    table = Table(title="Effects of each axis (asymptote A, or only efficiency B and Cmid)", title_justify="left")
    for name in ("axis", "verdict", "max |ΔA|", "max B ratio", "max Cmid ratio"):
        table.add_column(name)
    for e in report.effects:
        table.add_row(
            e.axis, e.verdict, _fmt(e.max_delta_A, ".3f"), _fmt(e.max_B_ratio, ".2f"), _fmt(e.max_Cmid_ratio, ".2f")
        )
    return table


def _extrapolation_cell(e: Extrapolation | None) -> str:
    if e is None:
        return "-"
    text = f"{_fmt(e.predicted, '.3f')} ({_fmt(e.band.lo, '.3f')}-{_fmt(e.band.hi, '.3f')})"
    if e.observed is not None:
        text += f" (observed {e.observed:.3f}, error {e.error:+.3f})"
    return text


def _range(interval: Interval | None, spec: str) -> str:
    if interval is None or not interval.known:
        return "-"
    return f"{interval.lo:{spec}}-{interval.hi:{spec}}"


def _value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _fmt(value: float | None, spec: str) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return format(value, spec)
