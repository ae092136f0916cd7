"""PNG plots of a Report, on a log compute axis like the paper's Figure 1.

One plot per configuration: each seed's points (one marker per seed), the fitted curve and its
bootstrap band, and with --fit-until/--predict the extrapolation (its fit solid up to C1, dashed
beyond, the prediction with its band at C2 and the value observed there). One plot per axis of
the sweep: every configuration's points and fit, coloured by that axis's value. Flagged fits are
marked: a red frame and a note on a configuration's plot, a dotted curve on an axis plot.

A log axis has no place for compute 0 (the step-0 evaluation): those points are drawn as open
markers on the left edge, at half the smallest positive compute, and a note says so.

Drawing only: the numbers come from the Report, nothing is refitted. matplotlib is imported here
and only when a plot is drawn, through its object API (no pyplot, so no global state and no GUI
backend), so that `sweep` starts fast and works without it until a plot is asked for.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from analysis.report.build import PARALLEL_ABOVE, ConfigResult, Report

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIT_COLOR = "#1f77b4"
EXTRAPOLATION_COLOR = "#d62728"
FLAG_COLOR = "#c00000"
BAND_ALPHA = 0.25
POINT_ALPHA = 0.75
SEED_COLORS = ("#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
SEED_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
CURVE_POINTS = 240
LEGEND_MAX_VALUES = 10  # more values of an axis get a colour bar instead of legend entries
SEQUENTIAL = "viridis"
DPI = 100
AXIS_LABELS = {
    "gpu_hours": "compute (GPU-hours, log scale)",
    "flops": "compute (FLOPs, log scale)",
    "tokens": "compute (generated tokens, log scale)",
    "device_seconds": "compute (device-seconds, log scale)",
    "step": "training step (log scale)",
}
ZERO_NOTE = "open markers on the left edge: evaluations at compute 0"


class PlotError(RuntimeError):
    """A plot cannot be drawn (matplotlib missing)."""


@dataclass(frozen=True)
class Plot:
    """One rendered plot: its file name (unique within a report), a caption, the PNG bytes."""

    name: str
    title: str
    png: bytes


def render_plots(report: Report, workers: int | None = None) -> list[Plot]:
    """Every configuration's plot (in report order: ranked first), then every axis's plot.

    A plot takes ~0.2 s to draw and encode, so a sweep of hundreds of configurations draws them
    in a process pool (`workers`, default: the report's, else every core), like the fits.
    """
    indexed = list(enumerate(report.configs, start=1))
    workers = workers or report.options.workers or len(os.sched_getaffinity(0))
    compute = [report.compute] * len(indexed)
    if len(indexed) >= PARALLEL_ABOVE and workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            plots = list(pool.map(_config_plot, indexed, compute, chunksize=max(1, len(indexed) // (4 * workers))))
    else:
        plots = list(map(_config_plot, indexed, compute))
    for axis in plot_axes(report):
        plots.append(Plot(f"axis-{_slug(axis)}.png", f"axis {axis}", to_png(axis_figure(report, axis))))
    return plots


def _config_plot(indexed: tuple[int, ConfigResult], compute: str) -> Plot:
    index, config = indexed
    return Plot(config_plot_name(index, config), _config_title(config), to_png(config_figure(config, compute)))


def config_plot_name(index: int, config: ConfigResult) -> str:
    return f"fit-{index:03d}-{_slug(config.label)}.png"


def plot_axes(report: Report) -> list[str]:
    """Axes with at least two values among the configurations: the ones worth comparing."""
    keys: list[str] = []
    for c in report.configs:
        keys += [k for k in c.axes if k not in keys]
    return [k for k in keys if len({_text(c.axes.get(k)) for c in report.configs if k in c.axes}) >= 2]


def to_png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# One configuration


def config_figure(config: ConfigResult, compute: str) -> Figure:
    """Points of every seed, the fit and its band, the extrapolation if any; flags marked.
    `compute`: the report's compute axis (gpu_hours, flops, ...), for the x label."""
    figure, ax = _new_figure()
    x_floor, x_max = _x_range([config], config.extrapolation.predict_at if config.extrapolation else None)
    grid = np.geomspace(x_floor, x_max, CURVE_POINTS)
    zeros = _draw_seeds(ax, config, x_floor)
    fit = config.fit
    if fit.ok:
        ax.plot(grid, fit.predict(grid), color=FIT_COLOR, lw=2, label=_fit_label(config), zorder=3)
        if config.boot is not None:
            lo, hi = config.boot.band(grid)
            ax.fill_between(
                grid, lo, hi, color=FIT_COLOR, alpha=BAND_ALPHA, lw=0, label=f"{percent(config.boot.level)} band"
            )
    if config.extrapolation is not None:
        _draw_extrapolation(ax, config, x_floor, x_max)
    if fit.flags:
        _mark_flagged(ax, config)
    _finish(ax, compute, x_floor, x_max, zeros)
    ax.set_title(_config_title(config), loc="left", fontsize=10)
    return figure


def _draw_seeds(ax: Axes, config: ConfigResult, x_floor: float) -> bool:
    """Scatter each seed's points; True if some were at compute 0 (drawn on the left edge)."""
    zeros = False
    for i, curve in enumerate(config.curves):
        compute, rate = np.asarray(curve.compute, dtype=float), np.asarray(curve.pass_rate, dtype=float)
        style = {"color": SEED_COLORS[i % len(SEED_COLORS)], "marker": SEED_MARKERS[i % len(SEED_MARKERS)]}
        label = f"seed {curve.seed} ({curve.run})" if curve.seed is not None else f"run {curve.run}"
        positive = compute > 0
        ax.scatter(compute[positive], rate[positive], s=14, alpha=POINT_ALPHA, lw=0, label=label, zorder=2, **style)  # type: ignore[arg-type]
        if not positive.all():
            zeros = True
            ax.scatter(np.full((~positive).sum(), x_floor), rate[~positive], s=28, facecolors="none",
                       edgecolors=style["color"], marker=style["marker"], clip_on=False, zorder=4)  # fmt: skip
    return zeros


def _draw_extrapolation(ax: Axes, config: ConfigResult, x_floor: float, x_max: float) -> None:
    e = config.extrapolation
    assert e is not None  # the caller checked
    if not e.fit.ok or e.withheld is not None:
        label = "extrapolation: fit failed" if not e.fit.ok else f"extrapolation withheld: {e.withheld}"
        ax.axvline(e.fit_until, color=EXTRAPOLATION_COLOR, ls=":", lw=1, label=label)
        return
    inside = np.geomspace(x_floor, e.fit_until, CURVE_POINTS // 2)
    beyond = np.geomspace(e.fit_until, x_max, CURVE_POINTS // 2)
    label = f"fit up to C1={_num(e.fit_until)}"
    ax.plot(inside, e.fit.predict(inside), color=EXTRAPOLATION_COLOR, lw=1.5, label=label, zorder=3)
    ax.plot(beyond, e.fit.predict(beyond), color=EXTRAPOLATION_COLOR, lw=1.5, ls="--", label="its extrapolation")
    lo, hi = e.bootstrap.band(beyond)
    ax.fill_between(beyond, lo, hi, color=EXTRAPOLATION_COLOR, alpha=BAND_ALPHA / 2, lw=0)
    ax.axvline(e.fit_until, color=EXTRAPOLATION_COLOR, ls=":", lw=1)
    yerr = [[e.predicted - e.band.lo], [e.band.hi - e.predicted]] if e.band.known else None
    ax.errorbar([e.predict_at], [e.predicted], yerr=yerr, fmt="D", color=EXTRAPOLATION_COLOR, capsize=4, ms=6,
                zorder=5, label=f"predicted at C2={_num(e.predict_at)}: {e.predicted:.3f}")  # fmt: skip
    if e.observed is not None and e.error is not None:
        ax.plot([e.predict_at], [e.observed], marker="*", ms=13, color="black", ls="none", zorder=6,
                label=f"observed {e.observed:.3f} (error {e.error:+.3f})")  # fmt: skip


def _mark_flagged(ax: Axes, config: ConfigResult) -> None:
    """A red frame and a note: a flagged fit must not be read like a clean one."""
    for spine in ax.spines.values():
        spine.set_color(FLAG_COLOR)
        spine.set_linewidth(2.5)
    note = f"flagged: {', '.join(config.fit.flags)}" + ("" if config.rank else " (not ranked)")
    ax.text(0.99, 0.04, note, transform=ax.transAxes, va="bottom", ha="right", color="white", fontsize=9, zorder=7,
            bbox={"boxstyle": "round", "facecolor": FLAG_COLOR, "edgecolor": "none"})  # fmt: skip


def _fit_label(config: ConfigResult) -> str:
    fit, boot = config.fit, config.boot
    text = f"fit: A={fit.A:.3f}"
    if boot is not None and boot.A.known:
        text += f" ({boot.A.lo:.3f}-{boot.A.hi:.3f})"
    return text + f", B={fit.B:.2f}, Cmid={_num(fit.Cmid)}, R²={fit.r2:.3f}"


def _config_title(config: ConfigResult) -> str:
    rank = f"#{config.rank}" if config.rank else "unranked"
    return f"{rank}: {config.label}"


# ---------------------------------------------------------------------------------------------
# One axis


def axis_figure(report: Report, axis: str) -> Figure:
    """All configurations with this axis, coloured by its value: which values raise the curve.
    Up to LEGEND_MAX_VALUES values get distinct colours and a legend (report order: best first),
    more get a sequential map over the sorted values and a colour bar."""
    figure, ax = _new_figure()
    configs = [c for c in report.configs if axis in c.axes]
    raw = list({_text(c.axes[axis]): c.axes[axis] for c in configs}.values())
    values = [_text(v) for v in raw]
    if len(values) <= LEGEND_MAX_VALUES:
        colors = _distinct_colors(len(values))
        for value, color in zip(values, colors):
            ax.plot([], [], color=color, lw=2, label=f"{axis}={value}")
    else:
        colors = _value_colorbar(figure, ax, axis, raw)
    color_of = [colors[values.index(_text(c.axes[axis]))] for c in configs]
    x_floor, x_max = _x_range(configs, None)
    zeros = _scatter_all(ax, configs, color_of, x_floor)
    grid = np.geomspace(x_floor, x_max, CURVE_POINTS)
    for c, color in zip(configs, color_of):
        if c.fit.ok:
            ax.plot(grid, c.fit.predict(grid), color=color, lw=1.5, ls=":" if c.fit.flags else "-", alpha=0.9)
    if any(c.fit.flags for c in configs):
        ax.plot([], [], color="black", lw=1.5, ls=":", label="dotted: flagged fit")
    _finish(ax, report.compute, x_floor, x_max, zeros)
    ax.set_title(_axis_title(report, axis, configs), loc="left", fontsize=10)
    return figure


def _scatter_all(ax: Axes, configs: Sequence[ConfigResult], color_of: Sequence[Any], x_floor: float) -> bool:
    """Every point of every configuration in one scatter (one artist, not one per curve: an axis
    of a 1,000-curve sweep draws in a second); True if some were at compute 0."""
    xs, ys, colors = [], [], []
    for c, color in zip(configs, color_of):
        for curve in c.curves:
            xs.append(np.asarray(curve.compute, dtype=float))
            ys.append(np.asarray(curve.pass_rate, dtype=float))
            colors += [color] * len(curve.compute)
    x = np.concatenate(xs or [np.empty(0)])
    ax.scatter(np.where(x > 0, x, x_floor), np.concatenate(ys or [np.empty(0)]), s=6, alpha=0.3, lw=0, c=colors,
               clip_on=False)  # fmt: skip
    return bool((x <= 0).any())


def _value_colorbar(figure: Figure, ax: Axes, axis: str, values: Sequence[Any]) -> list[Any]:
    """Too many values for a legend: a sequential map over the sorted values, and a colour bar
    labelled with some of them. Returns each value's colour, in the order of `values`."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    order = sorted(range(len(values)), key=lambda i: _sort_key(values[i]))
    cmap = colormaps[SEQUENTIAL].resampled(len(values))
    figure.subplots_adjust(right=0.86)
    bar = figure.colorbar(ScalarMappable(Normalize(-0.5, len(values) - 0.5), cmap), ax=ax, pad=0.01, fraction=0.04)
    ticks = np.unique(np.linspace(0, len(values) - 1, min(len(values), 8)).round().astype(int))
    bar.set_ticks(list(ticks), labels=[_text(values[order[i]]) for i in ticks])
    bar.set_label(f"{axis} ({len(values)} values)")
    colors: list[Any] = [None] * len(values)
    for position, i in enumerate(order):
        colors[i] = cmap(position)
    return colors


def _sort_key(value: Any) -> tuple[int, float, str]:
    """Numbers in numeric order, then everything else as text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def _axis_title(report: Report, axis: str, configs: Sequence[ConfigResult]) -> str:
    effect = next((e for e in report.effects if e.axis == axis), None)
    title = f"axis {axis}: {len(configs)} configurations"
    if effect is not None:
        title += f"; moves: {effect.verdict} (max |ΔA| {effect.max_delta_A:.3f}, max B ratio {effect.max_B_ratio:.2f})"
    return title


def _distinct_colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    return [colormaps["tab10"](i) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Shared


def _new_figure() -> tuple[Figure, Axes]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError(f"plots need matplotlib ({exc}); install it with: pip install 'scalesweep[plots]'") from None
    # Fixed margins, not a layout engine: it would draw every figure twice (half the cost).
    figure = Figure(figsize=(8, 5), dpi=DPI)
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.1, top=0.94)
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _x_range(configs: Sequence[ConfigResult], predict_at: float | None) -> tuple[float, float]:
    """(left edge, right edge) of a log axis: half the smallest positive compute, the largest."""
    compute = np.concatenate([np.asarray(c.compute, dtype=float) for cfg in configs for c in cfg.curves] or [np.zeros(0)])
    positive = compute[compute > 0]
    lo, hi = (float(positive.min()), float(positive.max())) if positive.size else (1.0, 10.0)
    hi = max(hi, predict_at or 0.0, lo * 10)
    return lo / 2, hi * 1.05


def _finish(ax: Axes, compute: str, x_floor: float, x_max: float, zeros: bool) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    ax.set_xlim(x_floor, x_max)
    # Plain-text tick labels (1k, 2k, 10k): the default 10^x labels go through mathtext, whose
    # parser is a third of the time of a plot. Short axes also label 2x and 5x of each decade.
    ax.xaxis.set_major_formatter(FuncFormatter(_compact))
    few_decades = x_max / x_floor < 300
    ax.xaxis.set_minor_formatter(FuncFormatter(_compact_2_5) if few_decades else NullFormatter())
    ax.set_xlabel(AXIS_LABELS.get(compute, compute))
    ax.set_ylabel("pass rate")
    ax.grid(True, which="both", alpha=0.25)
    if zeros:
        ax.text(0.01, 0.01, ZERO_NOTE, transform=ax.transAxes, fontsize=7, color="dimgray", va="bottom")
    if ax.get_legend_handles_labels()[0]:
        # Upper left: a rising curve leaves it empty (the flag note and the compute-0 note sit low).
        ax.legend(loc="upper left", fontsize=7, framealpha=0.85)


def _compact(value: float, _position: int | None = None) -> str:
    """100, 2.5k, 16k, 3M: a tick label as short as the paper's."""
    if abs(value) >= 1e15:
        return f"{value:.0e}"
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:g}{suffix}"
    return f"{value:g}"


def _compact_2_5(value: float, _position: int | None = None) -> str:
    """Minor ticks: label only 2x and 5x of a decade, or they would overlap."""
    mantissa = value / 10 ** np.floor(np.log10(value)) if value > 0 else 0.0
    return _compact(value) if round(mantissa, 6) in (2.0, 5.0) else ""


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _num(value: float) -> str:
    """Compute for a legend: 16,000 and 2,542 rather than 1.6e+04; 2.5e+18 FLOPs stay short."""
    return f"{value:,.0f}" if 1e3 <= abs(value) < 1e7 else f"{value:.4g}"


def _slug(text: str) -> str:
    """A file-name-safe version of a label, short enough for any file system."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")[:80] or "config"


def percent(level: float) -> str:
    """An interval level as a percentage with the digits it has: 0.95 -> 95%, 0.999 -> 99.9%."""
    return f"{level * 100:.4g}%"
