"""`sweep report SWEEP --backtest`: the backtest of a finished sweep as a table, JSON and a plot.

The numbers come from `analysis.backtest`; this module reads the sweep's curves from the store,
runs it, and renders: a table per cut (share within 0.02, median and max |error|, band coverage,
Kendall tau, p_best of the eventual winner), the same as JSON, and one PNG of the share within
0.02, the median |error| and tau against the fraction of compute.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from analysis.backtest import Backtest, BacktestOptions, CutSummary, backtest
from analysis.data import CurveLike
from analysis.options import FitOptions, Method, R0Mode
from analysis.report.build import read_configurations, sweep_ceiling_axes, sweep_task_ceilings
from analysis.report.plots import _new_figure, to_png
from store import RunState, Store

SCHEMA = "scalesweep.backtest/1"


def sweep_backtest(
    store: Store,
    sweep: str,
    options: BacktestOptions,
    compute: str | None = None,
    *,
    ceiling_axes: tuple[str, ...] | None = None,
    own_ceilings: bool = False,
) -> tuple[str, Backtest]:
    """(compute axis, backtest) of every configuration of SWEEP whose runs have all completed (a
    backtest checks predictions against finals; a run still going has none). Ceilings are shared
    as `sweep report --fit-until` shares them (`ceiling_axes`, else the task's; `own_ceilings`: not)."""
    axis, groups, axes = read_configurations(store, sweep, compute)
    options = replace(options, ceiling_axes=sweep_ceiling_axes(store, sweep, axes, ceiling_axes, own=own_ceilings))
    configs: dict[str, list[CurveLike]] = {
        label: [(c.compute, c.pass_rate) for c in curves if c.compute]
        for label, curves in groups.items()
        if all(c.state == RunState.COMPLETED for c in curves) and any(c.compute for c in curves)
    }
    if not configs:
        raise ValueError(f"sweep {sweep!r} has no completed configuration with evaluation points on {axis!r} to backtest")
    return axis, backtest(configs, options, axes, None if own_ceilings else sweep_task_ceilings(store, sweep))


def backtest_table(sweep: str, result: Backtest) -> Table:
    tol = result.options.tol
    table = Table(
        title=f"{sweep}: backtest (fit up to each cut of every configuration's compute, predict its final pass rate)",
        title_justify="left",
        caption=f"tau apart: Kendall's tau over the pairs whose finals differ by more than {tol:g}",
        caption_justify="left",
    )
    for name in ("cut", "predicted", f"|err|<={tol:g}", "median |err|", "max |err|", "band covers", "tau", "tau apart", "winner p_best"):
        table.add_column(name, justify="right")
    for row in backtest_rows(result):
        table.add_row(*(Text(cell) for cell in row))
    return table


def backtest_rows(result: Backtest) -> list[list[str]]:
    rows = []
    for c in result.cuts:
        judged = [x for x in c.configs if x.covered is not None]
        rows.append(
            [
                f"{c.fraction:.0%}",
                f"{c.n_predicted}/{c.n}",
                f"{c.n_within}/{c.n} ({c.share_within:.0%})",
                _fmt(c.median_abs_error, ".3f"),
                _fmt(c.max_abs_error, ".3f"),
                "-" if c.coverage is None else f"{sum(bool(x.covered) for x in judged)}/{len(judged)}",
                _fmt(c.tau, ".2f"),
                _fmt(c.tau_separated, ".2f"),
                _fmt(c.p_best_winner, ".2f"),
            ]
        )
    return rows


def render_backtest_table(sweep: str, result: Backtest, console: Console) -> None:
    console.print(backtest_table(sweep, result))
    winner = next((c.winner for c in result.cuts if c.winner), None)
    earliest = result.earliest()
    console.print(
        Text(
            f"winner (highest final): {winner or '-'}; "
            + (
                f"from {earliest:.0%} of compute on, every cut has >= 90% within {result.options.tol:g} and tau >= 0.8 over the pairs whose finals differ by more than {result.options.tol:g} (where any do)"
                if earliest is not None
                else f"no cut from which on >= 90% are within {result.options.tol:g} and tau >= 0.8 (pairs apart)"
            )
        )
    )


def backtest_json(sweep: str, compute: str, result: Backtest) -> str:
    return json.dumps(to_json_dict(sweep, compute, result), indent=2, allow_nan=False) + "\n"


def to_json_dict(sweep: str, compute: str, result: Backtest) -> dict[str, Any]:
    o = result.options
    return {
        "schema": SCHEMA,
        "sweep": sweep,
        "compute": compute,
        "tol": o.tol,
        "level": o.level,
        "n_boot": o.n_boot,
        "ceiling_axes": None if o.ceiling_axes is None else list(o.ceiling_axes),
        "earliest": result.earliest(),
        "cuts": [_cut_json(c) for c in result.cuts],
    }


def _cut_json(c: CutSummary) -> dict[str, Any]:
    return {
        "fraction": c.fraction,
        "n": c.n,
        "n_predicted": c.n_predicted,
        "n_within": c.n_within,
        "share_within": _num(c.share_within),
        "median_abs_error": _num(c.median_abs_error),
        "max_abs_error": _num(c.max_abs_error),
        "coverage": _num(c.coverage),
        "tau": _num(c.tau),
        "tau_separated": _num(c.tau_separated),
        "winner": c.winner,
        "p_best_winner": _num(c.p_best_winner),
        "configs": [
            {
                "label": x.label,
                "predicted": _num(x.predicted),
                "band": [_num(x.lo), _num(x.hi)] if x.predicts else None,
                "final": _num(x.final),
                "error": _num(x.error),
                "covered": x.covered,
                "withheld": x.withheld,
                "shared_with": x.shared_with,
                "task_ceiling": _num(x.task_ceiling),
            }
            for x in c.configs
        ],
    }


def backtest_png(sweep: str, result: Backtest) -> bytes:
    """Share within tol, median |error| and Kendall tau against the fraction of compute."""
    figure, ax = _new_figure()
    figure.subplots_adjust(right=0.9)  # room for the error axis on the right
    x = [100 * c.fraction for c in result.cuts]
    tol = result.options.tol
    ax.plot(x, [c.share_within for c in result.cuts], "o-", color="#2ca02c", label=f"share within {tol:g}")
    ax.plot(x, [_nan(c.tau) for c in result.cuts], "s-", color="#1f77b4", label="Kendall tau (predicted vs final order)")
    ax.plot(x, [_nan(c.tau_separated) for c in result.cuts], "s--", color="#17becf", label=f"tau, finals > {tol:g} apart")
    ax.plot(x, [_nan(c.coverage) for c in result.cuts], "^:", color="#7f7f7f", label=f"{result.options.level:.0%} band coverage")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("fit on the first x% of each configuration's compute")
    ax.set_ylabel("share / tau")
    err = ax.twinx()
    err.plot(x, [_nan(c.median_abs_error) for c in result.cuts], "d--", color="#d62728", label="median |error|")
    err.plot(x, [_nan(c.max_abs_error) for c in result.cuts], "x--", color="#ff9896", label="max |error|")
    err.axhline(tol, color="#d62728", linewidth=0.8, linestyle=":")
    err.set_ylabel("|predicted - final pass rate|")
    err.set_ylim(bottom=0)
    lines = ax.get_lines() + err.get_lines()[:2]
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="center right", fontsize=8)
    ax.set_title(f"{sweep}: how early could it have been called?")
    return to_png(figure)


def write_backtest_plot(sweep: str, result: Backtest, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{sweep}-backtest.png"
    path.write_bytes(backtest_png(sweep, result))
    return path


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def report_backtest(
    store: Store,
    sweep: str,
    *,
    fmt: str,
    out: Path,
    compute: str | None,
    method: Method,
    r0: R0Mode,
    cutoff: float,
    n_boot: int,
    level: float,
    console: Console,
    ceiling_axes: tuple[str, ...] | None = None,
    own_ceilings: bool = False,
) -> Path:
    """`sweep report SWEEP --backtest`: print the table (or JSON) and write the plot into `out`."""
    options = BacktestOptions(fit=FitOptions(method=method, r0=r0, cutoff=cutoff), n_boot=max(n_boot, 50), level=level)
    axis, result = sweep_backtest(store, sweep, options, compute, ceiling_axes=ceiling_axes, own_ceilings=own_ceilings)
    path = write_backtest_plot(sweep, result, out)
    if fmt == "json":
        console.file.write(backtest_json(sweep, axis, result))
    else:
        render_backtest_table(sweep, result, console)
        console.print(Text(f"wrote {path}"))
    return path
