"""Rendering a Report: rich table, Markdown, CSV, JSON (schema: docs/report-schema.md,
report.schema.json), one self-contained HTML page, and the files of `--out DIR`.

Rendering only: every number comes from the Report, nothing is refitted. The table, Markdown and
HTML share one grid of cells (`fit_grid`), so the three show the same text for the same fit.
Plots (analysis.report.plots, matplotlib) are drawn only for html and --out.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

from analysis import AxisEffect, Comparison, Extrapolation, Interval
from analysis.report.plots import Plot, config_plot_name, percent, render_plots
from analysis.report.build import SCHEMA_VERSION, ConfigResult, Report

PARAMS = ("A", "B", "Cmid")
FILE_NAMES = {"md": "report.md", "csv": "report.csv", "json": "report.json", "html": "report.html"}


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
        "reruns": dict(report.reruns),
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
        "extrapolation": _extrapolation_json(c) if c.extrapolation else None,
    }


def _extrapolation_json(c: ConfigResult) -> dict[str, Any]:
    e = c.extrapolation
    assert e is not None
    return {
        "rank_at_predict": c.rank_at_predict,
        "p_best": _num(c.p_best),
        "fit_until": e.fit_until,
        "predict_at": e.predict_at,
        "predicted": _num(e.predicted),
        "band": _interval(e.band),
        "observed": _num(e.observed),
        "error": _num(e.error),
        "within_band": e.within_band,
        "withheld": e.withheld,
        "shared_with": e.shared_with,
        "task_ceiling": _num(e.task_ceiling),
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
    for line in filter(None, (prediction_summary(report), reruns_line(report))):
        console.print(Text(line), soft_wrap=True)
    if report.comparisons:
        console.print(
            "[bold]Comparisons[/] (paper's rule: A's within the margin are refitted with a shared A and compared on B)"
        )
        for c in report.comparisons:
            console.print(Text(f"  {c.reason}"), soft_wrap=True)
    if report.effects:
        console.print(effects_table(report))


def fit_table(report: Report) -> Table:
    header, rows = fit_grid(report)
    caption = "ranked by A, then B; flagged fits are not ranked"
    if any(c.boot for c in report.configs):
        caption += f"; lo-hi: {percent(report.options.level)} bootstrap intervals"
    table = Table(title=_fit_title(report), title_justify="left", caption=caption)
    text_columns = {*(_axis_headers(report) or ["run"]), "flags"}
    for name in header:
        justify: Literal["left", "right"] = "left" if name in text_columns else "right"
        table.add_column(Text(name), justify=justify, style="yellow" if name == "flags" else None, overflow="fold")
    for row in rows:
        cells = [Text(cell) for cell in row]
        for cell in cells:
            cell.highlight_regex(r" \(.*\)$", "dim")
        table.add_row(*cells)
    return table


def fit_grid(report: Report) -> tuple[list[str], list[list[str]]]:
    """The fit table as plain text: a header and one row per configuration, in report order."""
    configs = report.configs
    axis_keys = _axis_keys(report)
    with_seeds = any(len(c.curves) > 1 for c in configs)
    with_intervals = any(c.boot for c in configs)
    with_extrapolation = any(c.extrapolation for c in configs)
    with_methods = len({c.fit.method for c in configs}) > 1  # else the title names the one method
    header = ["#", *(_axis_headers(report) or ["run"])]
    header += ["seeds"] if with_seeds else []
    header += [f"{name} (lo-hi)" if with_intervals else name for name in PARAMS]
    header += [
        "R0",
        "R²",
        "n",
        *(["predicted", "rank@C", "p_best"] if with_extrapolation else []),
        *(["method"] if with_methods else []),
        "flags",
    ]
    rows = []
    for c in configs:
        fit = c.fit
        row = [str(c.rank) if c.rank else "-"]
        row += [_value(c.axes.get(k)) for k in axis_keys] if axis_keys else [c.runs[0]]
        row += [str(len(c.curves))] if with_seeds else []
        for name, spec in (("A", ".3f"), ("B", ".2f"), ("Cmid", ".3g")):
            text = _fmt(getattr(fit, name), spec)
            if with_intervals:
                text += f" ({_range(getattr(c.boot, name) if c.boot else None, spec)})"
            row.append(text)
        row += [_fmt(fit.R0, ".3f"), _fmt(fit.r2, ".3f"), str(fit.n_points)]
        if with_extrapolation:
            row += [_extrapolation_cell(c.extrapolation), str(c.rank_at_predict or "-"), _fmt(c.p_best, ".2f")]
        row += [fit.method] if with_methods else []
        row.append(", ".join(fit.flags))
        rows.append(row)
    return header, rows


def prediction_summary(report: Report) -> str | None:
    """How the predictions fared where the runs reached --predict: the paper's check of the fits
    (within its noise margin on A), and how many configurations got no prediction and why."""
    made = [c.extrapolation for c in report.configs if c.extrapolation is not None]
    if not made:
        return None
    opts = report.options

    def at(value: float) -> str:
        return f"{value:.0%} of each configuration's compute" if opts.relative else f"{report.compute} {value:g}"

    where = f"fit up to {at(opts.fit_until)}, " if opts.fit_until is not None else ""
    assert opts.predict_at is not None  # extrapolations exist only with --predict
    checked = [e for e in made if e.error is not None]
    close = sum(abs(e.error) <= opts.margin for e in checked if e.error is not None)
    target = f"{opts.predict_at:.0%}" if opts.relative and opts.fit_until is not None else at(opts.predict_at)
    text = f"Predictions ({where}predicted at {target}): "
    reached = sum(e.observed is not None for e in made)
    if checked:
        text += f"within {opts.margin:g} of the observed pass rate for {close} of {len(checked)} configurations"
    elif reached:
        text += f"{reached} of {len(made)} configurations reached it, none with a prediction to check"
    else:
        text += "no configuration has reached it yet"
    withheld = [e for e in made if e.withheld is not None]
    if withheld:
        text += f"; {len(withheld)} withheld (unstable or unfitted before C1)"
    held = [e for e in made if e.task_ceiling is not None]
    if held:
        text += (
            f"; {len(held)} with A held at the task's ceiling (the share of held-out problems the budget "
            "allows), which their windows do not reject"
        )
    return text + "."


def reruns_line(report: Report) -> str | None:
    """Which runs are same-seed reruns, kept out of the fits as reproductions."""
    if not report.reruns:
        return None
    pairs = ", ".join(f"{rerun} (a rerun of {original})" for rerun, original in sorted(report.reruns.items()))
    return f"Same-seed reruns, reproductions kept out of the fits: {pairs}."


def comparison_grid(report: Report) -> tuple[list[str], list[list[str]]]:
    header = ["a", "b", "rule", "winner", "beyond noise", "reason"]
    rows = [
        [c.labels[0], c.labels[1], c.rule, c.winner or "-", "yes" if c.resolved else "no", c.reason]
        for c in report.comparisons
    ]
    return header, rows


def effect_grid(report: Report) -> tuple[list[str], list[list[str]]]:
    header = ["axis", "verdict", "max |ΔA|", "max B ratio", "max Cmid ratio"]
    rows = [
        [e.axis, e.verdict, _fmt(e.max_delta_A, ".3f"), _fmt(e.max_B_ratio, ".2f"), _fmt(e.max_Cmid_ratio, ".2f")]
        for e in report.effects
    ]
    return header, rows


def _fit_title(report: Report) -> str:
    methods = sorted({c.fit.method for c in report.configs})
    method = f", method {methods[0]}" if len(methods) == 1 else ""
    return f"sweep {report.sweep}: fits of R(C) = R0 + (A - R0) / (1 + (Cmid/C)^B), C = {report.compute}{method}"


def _axis_keys(report: Report) -> list[str]:
    keys: list[str] = []
    for c in report.configs:
        keys += [k for k in c.axes if k not in keys]
    return keys


FIT_COLUMNS = ("#", "run", "seeds", *PARAMS, *(f"{name} (lo-hi)" for name in PARAMS), "R0", "R²", "n",
               "predicted", "rank@C", "p_best", "method", "flags")  # fmt: skip


def _axis_headers(report: Report) -> list[str]:
    """The fit table's axis columns: an axis named like a fixed column (`A`, `n`, `flags`) gets
    "axis:" in front, as in the CSV, so that no two columns share a header."""
    return [f"axis:{k}" if k in FIT_COLUMNS else k for k in _axis_keys(report)]


def effects_table(report: Report) -> Table:
    header, rows = effect_grid(report)
    table = Table(title="Effects of each axis (asymptote A, or only efficiency B and Cmid)", title_justify="left")
    for name in header:
        table.add_column(Text(name))
    for row in rows:
        table.add_row(*map(Text, row))
    return table


def _extrapolation_cell(e: Extrapolation | None) -> str:
    if e is None:
        return "-"
    if e.withheld is not None:
        return f"withheld ({e.withheld})"
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


# ---------------------------------------------------------------------------------------------
# Markdown


def render_markdown(report: Report) -> str:
    """GitHub-flavoured Markdown: the fit table, the comparisons and the effects."""
    parts = [f"# sweep {report.sweep}", "", _summary(report), "", "## Fits", "", _md_table(*fit_grid(report))]
    for line in filter(None, (prediction_summary(report), reruns_line(report))):
        parts += ["", line]
    if report.comparisons:
        parts += ["", "## Comparisons", "", COMPARISON_NOTE, "", _md_table(*comparison_grid(report))]
    if report.effects:
        parts += ["", "## Effects of each axis", "", EFFECT_NOTE, "", _md_table(*effect_grid(report))]
    return "\n".join(parts) + "\n"


COMPARISON_NOTE = (
    "The paper's rule, on neighbours in the ranking: A's within the margin are refitted with a shared A "
    "and compared on B."
)
EFFECT_NOTE = "Does an axis move the asymptote A, or only the efficiency (B, Cmid)?"


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [_md_row(header), "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + [_md_row(row) for row in rows])


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") or " " for cell in cells) + " |"


def _summary(report: Report) -> str:
    """One sentence on how the numbers were made: what a reader needs to trust or reuse them."""
    opts = report.options
    text = (
        f"Fits of R(C) = R0 + (A - R0) / (1 + (Cmid/C)^B), C = {report.compute}; method {opts.method}, "
        f"R0 {opts.r0}, cutoff {opts.cutoff:g}"
    )
    if opts.n_boot:
        text += f"; lo-hi: {percent(opts.level)} bootstrap intervals ({opts.n_boot} samples)"
    if opts.fit_until is not None:
        text += f"; predicted: fit up to {opts.fit_until:g}, predicted at {opts.predict_at:g}"
    flagged = "flagged fits are ranked too" if opts.include_flagged else "flagged fits are not ranked"
    return f"{text}. Ranked by A, then B; {flagged}. Generated {report.generated_at:%Y-%m-%d %H:%M} UTC."


# ---------------------------------------------------------------------------------------------
# CSV


CSV_FIXED = (
    "rank", "label", "compute_axis", "seeds", "run_ids", "states",
    "A", "A_lo", "A_hi", "B", "B_lo", "B_hi", "Cmid", "Cmid_lo", "Cmid_hi", "R0", "r2", "sse",
    "n_points", "compute_min", "compute_max", "method", "flags",
    "fit_until", "predict_at", "predicted", "predicted_lo", "predicted_hi", "observed", "error", "within_band",
    "rank_at_predict", "p_best",
)  # fmt: skip


def render_csv(report: Report) -> str:
    """One row per configuration, in report order; columns in docs/report-schema.md.

    Numbers at full precision (a spreadsheet or pandas recomputes from them), unknown ones empty;
    lists (seeds, run ids, states, flags) joined with ";". The axis columns come after `label`,
    each named after its axis ("axis:" in front when that name is a fixed column's).
    """
    axis_keys = _axis_keys(report)
    axis_columns = [f"axis:{k}" if k in CSV_FIXED else k for k in axis_keys]
    header = [*CSV_FIXED[:2], *axis_columns, *CSV_FIXED[2:]]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for c in report.configs:
        row = _csv_row(report, c)
        writer.writerow([*row[:2], *(_csv(c.axes.get(k)) for k in axis_keys), *row[2:]])
    return buffer.getvalue()


def _csv_row(report: Report, c: ConfigResult) -> list[str]:
    fit, boot, e = c.fit, c.boot, c.extrapolation
    row = [_csv(c.rank), c.label, report.compute, ";".join(_csv(s) for s in c.seeds), ";".join(c.runs)]
    row.append(";".join(curve.state for curve in c.curves))
    for name in PARAMS:
        interval = getattr(boot, name) if boot else None
        row += [_csv(getattr(fit, name)), *_csv_interval(interval)]
    row += [_csv(fit.R0), _csv(fit.r2), _csv(fit.sse), _csv(fit.n_points), _csv(fit.compute_min)]
    row += [_csv(fit.compute_max), fit.method, ";".join(fit.flags)]
    if e is None:
        return row + [""] * 10
    return row + [
        _csv(e.fit_until), _csv(e.predict_at), _csv(e.predicted), *_csv_interval(e.band),
        _csv(e.observed), _csv(e.error), _csv(e.within_band), _csv(c.rank_at_predict), _csv(c.p_best),
    ]  # fmt: skip


def _csv_interval(interval: Interval | None) -> list[str]:
    return [_csv(interval.lo), _csv(interval.hi)] if interval is not None and interval.known else ["", ""]


def _csv(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------------------------------------
# HTML


def render_html(report: Report, plots: Sequence[Plot]) -> str:
    """One self-contained page: inline CSS, plots as data: URIs, no external URL, no script."""
    title = html.escape(f"sweep {report.sweep}: scaling report")
    body = [
        f"<h1>{title}</h1>",
        f'<p class="summary">{html.escape(_summary(report))}</p>',
        "<h2>Fits</h2>",
        _html_fit_table(report, plots),
    ]
    if report.comparisons:
        body += ["<h2>Comparisons</h2>", f"<p>{html.escape(COMPARISON_NOTE)}</p>"]
        body.append(_html_table(*comparison_grid(report), table_id="comparisons"))
    if report.effects:
        body += ["<h2>Effects of each axis</h2>", f"<p>{html.escape(EFFECT_NOTE)}</p>"]
        body.append(_html_table(*effect_grid(report), table_id="effects"))
    if report.trackers:
        body += ["<h2>Experiment trackers</h2>", _html_trackers(report)]
    if plots:
        body += ["<h2>Plots</h2>", '<div class="plots">', *map(_html_figure, plots), "</div>"]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{title}</title>\n<style>{HTML_STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


HTML_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1400px;
       padding: 0 1em; color: #1b1b1b; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
.summary { color: #444; }
table { border-collapse: collapse; margin: 0.5em 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d0d0; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f4f7; }
tr.flagged td { background: #fff4d6; }
td.flags { color: #a05a00; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1em; }
figure { margin: 0; border: 1px solid #e2e2e2; padding: 0.5em; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 0.9em; color: #444; }
a { color: #1f5fa8; }
"""


def _html_fit_table(report: Report, plots: Sequence[Plot]) -> str:
    """The fit table; a row's rank links to its plot, flagged rows are highlighted."""
    header, rows = fit_grid(report)
    names = {p.name for p in plots}
    out = ['<table id="fits">', _html_row(header, "th")]
    for i, (c, row) in enumerate(zip(report.configs, rows), start=1):
        anchor = config_plot_name(i, c)
        cells = [html.escape(cell) for cell in row]
        if anchor in names:
            cells[0] = f'<a href="#{html.escape(_anchor(anchor))}">{cells[0]}</a>'
        css = ' class="flagged"' if c.fit.flags else ""
        out.append(
            f"<tr{css}>"
            + "".join(f"<td>{cell}</td>" for cell in cells[:-1])
            + f'<td class="flags">{cells[-1]}</td></tr>'
        )
    out.append("</table>")
    return "\n".join(out)


def _html_trackers(report: Report) -> str:
    label_of = {run: c.label for c in report.configs for run in c.runs}
    lines = ['<table id="trackers">', _html_row(["run", "configuration", "trackers"], "th")]
    for run, links in report.trackers.items():
        anchors = " ".join(f'<a href="{html.escape(link["href"])}">{html.escape(link["label"])}</a>' for link in links)
        lines.append(f"<tr><td>{html.escape(run)}</td><td>{html.escape(label_of.get(run, ''))}</td><td>{anchors}</td></tr>")
    return "\n".join([*lines, "</table>"])


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, table_id: str) -> str:
    lines = [f'<table id="{table_id}">', _html_row(header, "th")]
    lines += [_html_row(row, "td") for row in rows]
    return "\n".join([*lines, "</table>"])


def _html_row(cells: Sequence[str], tag: str) -> str:
    return "<tr>" + "".join(f"<{tag}>{html.escape(cell)}</{tag}>" for cell in cells) + "</tr>"


def _html_figure(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    caption = html.escape(plot.title)
    return (
        f'<figure id="{html.escape(_anchor(plot.name))}"><img src="data:image/png;base64,{data}" alt="{caption}">'
        f"<figcaption>{caption}</figcaption></figure>"
    )


def _anchor(file_name: str) -> str:
    return "plot-" + file_name.removesuffix(".png")


# ---------------------------------------------------------------------------------------------
# Text formats and --out


def render_text(report: Report, fmt: str, plots: Sequence[Plot] | None = None) -> str:
    """The report as md, csv, json or html text; html draws the plots unless given them."""
    if fmt == "md":
        return render_markdown(report)
    if fmt == "csv":
        return render_csv(report)
    if fmt == "json":
        return render_json(report) + "\n"
    if fmt == "html":
        return render_html(report, render_plots(report) if plots is None else plots)
    raise ValueError(f"format must be one of {', '.join(FILE_NAMES)}, got {fmt!r}")


def write_report(report: Report, fmt: str, out: Path) -> list[Path]:
    """Write every plot as PNG into `out`, and the report as report.<fmt> unless fmt is "table".

    Returns the paths written, the report file first. Plots are drawn once and embedded in the
    HTML page as the same bytes.
    """
    out.mkdir(parents=True, exist_ok=True)
    plots = render_plots(report)
    written = []
    if fmt != "table":
        path = out / FILE_NAMES[fmt]
        path.write_text(render_text(report, fmt, plots), encoding="utf-8")
        written.append(path)
    for plot in plots:
        (out / plot.name).write_bytes(plot.png)
        written.append(out / plot.name)
    return written
