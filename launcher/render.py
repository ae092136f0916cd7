"""Rendering for the CLI: rich tables and plain text. Nothing here computes or writes state."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.segment import Segment
from rich.markup import escape
from rich.table import Table

from launcher.grid import RunPlan
from launcher.status import StatusRow
from store import FAILED_STATES, RunState

PIPE_WIDTH = 160
STATE_STYLE = {
    RunState.COMPLETED: "green",
    RunState.RUNNING: "cyan",
    RunState.FAILED: "bold red",
    RunState.CANCELLED: "yellow",
    RunState.TIMEOUT: "red",
    RunState.PREEMPTED: "magenta",
    RunState.QUEUED: "blue",
    RunState.PENDING: "blue",
    RunState.SUBMITTING: "blue",
    RunState.REGISTERED: "dim",
    RunState.PRUNED: "dark_orange",
}


def fmt_value(value: Any) -> str:
    """A value for a table cell; user-controlled text is escaped, so `[/]` in a label is shown,
    never parsed as markup."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else escape(str(value))


def fmt_compute(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def plan_table(plans: Sequence[RunPlan], title: str) -> Table:
    axis_keys = _axis_keys([p.axes for p in plans])
    table = Table(title=escape(title), title_justify="left")
    table.add_column("run", no_wrap=True, min_width=12)
    for key in axis_keys:
        table.add_column(escape(key))
    table.add_column("budget")
    for plan in plans:
        budget = ", ".join(f"{escape(k)}={fmt_value(v)}" for k, v in plan.budget.items() if v is not None)
        table.add_row(escape(plan.id), *(fmt_value(plan.axes.get(k)) for k in axis_keys), budget)
    return table


PLAIN_ROWS_ABOVE = 500
"""Runs beyond which a table is printed as plain aligned text: rich lays out every cell, which
for a 10,000-run dry run costs seconds."""


def plan_text(plans: Sequence[RunPlan], title: str) -> str:
    """`plan_table` as plain text columns (no markup, nothing escaped: it is not parsed)."""
    axis_keys = _axis_keys([p.axes for p in plans])
    header = ["run", *axis_keys, "budget"]
    rows = [
        [
            plan.id,
            *("-" if plan.axes.get(k) is None else f"{v:.4g}" if isinstance(v := plan.axes.get(k), float) else str(v)
              for k in axis_keys),
            ", ".join(f"{k}={v}" for k, v in plan.budget.items() if v is not None),
        ]
        for plan in plans
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    return "\n".join([title, *lines])


def status_table(sweep: str, rows: Sequence[StatusRow], *, compute: str) -> Table:
    axis_keys = _axis_keys([r.run.axes for r in rows])
    table = Table(title=f"sweep {escape(sweep)}", title_justify="left")
    table.add_column("run", no_wrap=True, min_width=12)
    for key in axis_keys:
        table.add_column(escape(key))
    with_seed = "seed" not in axis_keys  # every run's seed is shown: a same-seed rerun reads as one
    if with_seed:
        table.add_column("seed", justify="right")
    for name in ("state", "att.", "step", "pass rate", compute, "job"):
        table.add_column(name, justify="right" if name in ("att.", "step", "pass rate", compute) else "left")
    for row in rows:
        state = row.run.state
        budget = row.budget_steps
        step = f"{row.run.step}/{budget}" if budget else str(row.run.step)
        last = row.last
        table.add_row(
            escape(row.run.id),
            *(fmt_value(row.run.axes.get(k)) for k in axis_keys),
            *([fmt_value(row.seed)] if with_seed else []),
            f"[{STATE_STYLE[state]}]{state}[/]" if state in STATE_STYLE else str(state),
            str(row.num_attempts),
            step,
            f"{last.pass_rate:.3f}" if last else "-",
            fmt_compute(getattr(last, compute) if last else None),
            escape(row.attempt.job_id or "-") if row.attempt else "-",
        )
    return table


def failures(rows: Sequence[StatusRow]) -> list[str]:
    """One line per failed/timed-out run: its reason and where its log is (plain text: print it
    with `print_failures`, or escape it, since a reason may hold `[/]`)."""
    lines = []
    for row in rows:
        if row.run.state in FAILED_STATES and row.run.state_reason:
            lines.append(f"{row.run.id}: {row.run.state_reason}")
    return lines


def print_failures(out: Console, rows: Sequence[StatusRow]) -> None:
    for line in failures(rows):
        out.print(f"[red]{escape(line)}[/]", soft_wrap=True)


def _axis_keys(axes: Sequence[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for a in axes:
        keys += [k for k in a if k not in keys]
    return keys


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with its control characters (ESC of a terminal escape sequence, BEL, CR, ...) shown
    as `\\x1b`, never sent to the terminal; newlines and tabs stay."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class _PrintableConsole(Console):
    """A console whose text never carries a label's or a log's terminal escape sequences: every
    text segment goes through `printable`; rich's own styling and cursor control (its control
    segments, and the codes it makes from styles) are untouched."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            segment if segment.control else Segment(printable(segment.text), segment.style, segment.control)
            for segment in buffer
        )


def console(stderr: bool = False) -> Console:
    """A terminal gets its own width; a pipe or file gets a wide one, so tables stay readable."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else PIPE_WIDTH
    return _PrintableConsole(stderr=stderr, highlight=False, width=width)


def run_details(data: dict[str, Any]) -> str:
    """`sweep show` as text (markup-escaped: labels and reasons are user text)."""
    prov = data.get("provenance") or {}
    code = prov.get("code") or {}
    packages = ", ".join(f"{k} {v}" for k, v in (prov.get("packages") or {}).items() if v)
    gpus = prov.get("gpus") or {}
    lines = [
        f"[bold]run {escape(data['run'])}[/] of sweep {escape(data['sweep'])}: {escape(str(data['state']))}"
        + (f" ({escape(data['reason'])})" if data.get("reason") else ""),
        f"  step {data['step']}, budget {escape(json.dumps(data['budget']))}, dir {escape(data['run_dir'])}",
        f"  axes: {escape(json.dumps(data['axes'], default=str))}, seed {escape(str(data.get('seed')))}"
        + (f"; a same-seed rerun of {escape(data['rerun_of'])} (kept out of the fits)" if data.get("rerun_of") else ""),
        "attempts:",
        *(
            f"  #{a['number']} {escape(a['executor'])} {escape(str(a['state']))}"
            + (f" job {escape(str(a['job_id']))}" if a["job_id"] else "")
            + (f" on {escape(str(a['node']))}" if a["node"] else "")
            + (f": {escape(a['exit_reason'])}" if a["exit_reason"] else "")
            for a in data["attempts"]
        ),
        "checkpoints: " + (", ".join(str(c["step"]) for c in data["checkpoints"]) or "none"),
        "last eval points: "
        + (", ".join(f"step {p['step']}: {p['pass_rate']:.3f}" for p in data["eval_points"]) or "none"),
        "provenance: "
        + (
            f"commit {escape(str(code.get('commit')))}{' (dirty)' if code.get('dirty') else ''}, "
            f"python {escape(str(prov.get('python')))}, {escape(packages)}, host {escape(str(prov.get('host')))}, "
            f"{gpus.get('count', 0)} GPUs {escape(', '.join(gpus.get('models') or []))}"
            + (f", Slurm job {escape(str(prov['slurm_job_id']))}" if prov.get("slurm_job_id") else "")
            if prov
            else "none recorded"
        ),
    ]
    return "\n".join(lines)


def prune_text(data: dict[str, Any]) -> str:
    """`sweep prune` as plain text."""
    lines = [f"sweep {data['sweep']}: pruning on {data['compute_axis']}, policy {json.dumps(data['policy'])}"]
    for verdict in data.get("configurations", []):
        lines.append(f"  {verdict['label']}: " + (f"prune ({verdict['reason']})" if verdict["pruned"] else "keep"))
    for sim in data.get("simulations", []):
        lines.append(
            f"{sim['pruner']} pruner: saves {sim['saved_fraction']:.0%} of the compute; the best configuration "
            f"({sim['best']}) {'survives' if sim['best_survived'] else 'is PRUNED'}"
        )
        for run in sim["runs"]:
            lines.append(f"  {run['label']}: " + (f"pruned at {run['pruned_at']:.4g}" if run["pruned"] else "kept"))
    return "\n".join(lines)
