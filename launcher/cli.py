"""The `sweep` command: a thin layer that parses, calls one library function, renders."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from functools import wraps
from pathlib import Path
from typing import Any, Literal, TypeVar

import click
from rich.markup import escape

from launcher import render
from launcher.grid import MAX_RUNS, GridError, check_size, expand_with_warnings, load_sweep
from launcher.preflight import check_plans, check_root
from launcher.target import check_target
from launcher.importer import IMPORT_FORMATS, import_curves
from launcher.launch import EXECUTORS, LaunchError, default_executor, default_root, launch
from launcher.slurm import SlurmError
from launcher.status import collect, pruned_lines, summary, watch
from store import (
    COMPUTE_AXES,
    MEASURED_COMPUTE_AXES,
    TERMINAL_STATES,
    BadURLError,
    NotFoundError,
    Store,
    StoreError,
)

F = TypeVar("F", bound=Callable[..., Any])
REPORT_FORMATS = ("table", "md", "csv", "json", "html")


def _fail(message: str, code: int = 1) -> None:
    """Print `message` (plain text: brackets in it are not markup) and exit with `code`."""
    render.console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    sys.exit(code)


def _errors(func: F) -> F:
    """Known failures become one-line errors with a non-zero exit, not tracebacks."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (GridError, BadURLError) as exc:
            _fail(str(exc), 2)
        except (StoreError, LaunchError, SlurmError) as exc:  # NotFoundError is a StoreError
            _fail(str(exc))

    return wrapper  # type: ignore[return-value]


def _store(ctx: click.Context, *, create: bool = False) -> Store:
    """The store named by --db. Only writing commands (launch, import) pass `create`: the others
    never create a database or migrate one (store.Store)."""
    return Store(ctx.obj["db"], create=create)


def _sweep_name(store: Store, name: str | None) -> str:
    if name:
        if store.get_sweep(name) is None:
            names = [s.name for s in store.list_sweeps()]
            raise NotFoundError(f"no sweep named {name!r} in {store.display_url}; sweeps: {', '.join(names) or 'none'}")
        return name
    sweeps = store.list_sweeps()
    if len(sweeps) == 1:
        return sweeps[0].name
    if not sweeps:
        raise NotFoundError(f"no sweeps in {store.display_url}; start one with `sweep launch GRID.yaml`")
    raise NotFoundError(f"several sweeps in {store.display_url}; name one of: {', '.join(s.name for s in sweeps)}")


class _OneLineErrors(click.Group):
    """Usage errors (a bad option value, a missing argument) as one `error:` line with exit 2,
    like every other error of the CLI, instead of click's three-line usage block."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        main: Callable[..., Any] = super().main
        if not kwargs.pop("standalone_mode", True):
            return main(*args, standalone_mode=False, **kwargs)
        try:
            code = main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as exc:
            command = f" {exc.ctx.command_path}" if isinstance(exc, click.UsageError) and exc.ctx else ""
            _fail(f"{exc.format_message()} (see{command} --help)" if command else exc.format_message(), exc.exit_code)
        except click.Abort:
            _fail("aborted", 130)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    envvar="SWEEP_DB",
    default=None,
    help="SQLAlchemy URL of the store [env: SWEEP_DB; default: sqlite:///sweeps.db].",
)
@click.pass_context
def cli(ctx: click.Context, db: str | None) -> None:
    """RL scaling sweeps: launch grids as jobs, track them, fit and rank their curves."""
    ctx.obj = {"db": db}


@cli.command("launch")
@click.argument("grid", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("overrides", nargs=-1)
@click.option("--dry-run", is_flag=True, help="Print the runs (and the sbatch script) and submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the runs as JSON (id and axis values).")
@click.option(
    "--cluster",
    type=click.Choice(EXECUTORS),
    default=None,
    help="Executor [default: slurm if sbatch is on PATH, else local].",
)
@click.option(
    "--retry-failed",
    is_flag=True,
    help="Also resubmit failed, timed-out and cancelled runs; they resume from their newest checkpoint.",
)
@click.option(
    "--resume-pruned",
    is_flag=True,
    help="Also resubmit the runs the sweep's prune policy stopped; they resume from their newest checkpoint "
    "and are not pruned again.",
)
@click.option("--wait", is_flag=True, help="Show live progress until every run has ended (applying the prune policy).")
@click.option(
    "--max-parallel",
    type=int,
    default=None,
    callback=lambda _ctx, _param, value: _at_least_one(value),
    help="Local executor: runs at once, >= 1; kept until changed [default: number of cores].",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where run directories go [env: SWEEP_ROOT; default: ./runs].",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    default=MAX_RUNS,
    show_default=True,
    help="Refuse a grid that expands to more runs than this (counted before expanding).",
)
@click.pass_context
@_errors
def launch_cmd(
    ctx: click.Context,
    grid: Path,
    overrides: Sequence[str],
    dry_run: bool,
    as_json: bool,
    cluster: str | None,
    retry_failed: bool,
    resume_pruned: bool,
    wait: bool,
    max_parallel: int | None,
    root: Path | None,
    max_runs: int,
) -> None:
    """Expand GRID (a sweep YAML) into runs, register them, submit those not done.

    OVERRIDES are KEY=VALUE edits of the sweep file (values in YAML): budget.steps=50 seeds=[0]
    recipe.optim.lr=1e-4 grid.optim.lr=[1e-4,2e-4].
    """
    spec = load_sweep(grid, overrides)
    check_size(spec, max_runs)
    plans, warnings = expand_with_warnings(spec)
    for warning in warnings:
        render.console(stderr=True).print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    executor = cluster or default_executor()
    target = check_target(spec, plans, executor)  # what the jobs would refuse there, before anything else
    check_plans(spec, plans)
    out = render.console()
    if dry_run:
        if as_json:
            click.echo(
                json.dumps({"sweep": spec.name, "runs": [{"id": p.id, "axes": p.axes} for p in plans]}, indent=2)
            )
        else:
            title = f"sweep {spec.name}: {len(plans)} runs (dry run, nothing submitted)"
            if len(plans) > render.PLAIN_ROWS_ABOVE:
                click.echo(render.plan_text(plans, title))
            else:
                out.print(render.plan_table(plans, title))
            resolved = sorted({tuple(target.resolved(p.config).items()) for p in plans})
            for values in resolved:
                click.echo(f"{target.words}: " + ", ".join(f"{k}={v}" for k, v in values))
            if executor == "slurm":
                from launcher import slurm

                script = slurm.dry_run_script(spec, plans, root=check_root(root or default_root()))
                click.echo(f"\n# the sbatch script of the first array:\n{script}")
        return
    store = _store(ctx, create=True)
    result = launch(
        store, spec, plans, executor=executor, root=root, retry_failed=retry_failed, resume_pruned=resume_pruned,
        max_parallel=max_parallel,
    )  # fmt: skip
    if resume_pruned:
        out.print(_resumed_line(result.resumed), soft_wrap=True)
    out.print(
        f"sweep [bold]{escape(result.sweep)}[/]: {result.num_runs} runs, {len(result.new)} new, "
        f"{len(result.submitted)} submitted ({result.executor})"
        + (f", {result.waiting} waiting for room under the cluster's submit limit" if result.waiting else "")
        + f"; run directories in {escape(result.sweep_dir)}"
    )
    if wait:
        _watch(store, spec.name)


def _resumed_line(resumed: Sequence[tuple[str, int | None]]) -> str:
    """What `--resume-pruned` resumed, and from where (markup-escaped)."""
    if not resumed:
        return "resumed 0 pruned run(s)"
    where = ", ".join(
        f"{escape(run_id)} (from its checkpoint at step {step})" if step is not None else f"{escape(run_id)} (from the start)"
        for run_id, step in resumed
    )
    return f"resumed {len(resumed)} pruned run(s): {where}; they are exempt from the prune policy from now on"


@cli.command("status")
@click.argument("sweep", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Refresh until every run has ended.")
@click.option(
    "--compute",
    type=click.Choice(MEASURED_COMPUTE_AXES),
    default=None,
    help="Compute column [default: gpu_hours on GPUs, else flops].",
)
@click.pass_context
@_errors
def status_cmd(ctx: click.Context, sweep: str | None, as_json: bool, watch: bool, compute: str | None) -> None:
    """Every run of SWEEP: state, attempts, step/budget, last pass rate, compute.

    Before reading, a sync step brings the store in line with the executors: local jobs whose
    process is gone fail, Slurm's verdicts are recorded, queued local work gets a scheduler, and
    runs held back by a Slurm submit limit are submitted if there is room now. Then the sweep's
    `prune:` policy, if it has one, is applied live: at its judgment points the configurations
    are fitted (seeds pooled, as `sweep prune --dry-run`) and the runs of a dominated one are
    stopped after a checkpoint and shown as pruned, with the fit that decided
    (docs/pruning.md). It never creates a store or migrates one.
    """
    store = _store(ctx)
    name = _sweep_name(store, sweep)
    if watch:
        _watch(store, name, compute=compute)
        return
    rows = collect(store, name, prune=_live_prune)
    if as_json:
        click.echo(json.dumps({"sweep": name, "runs": [r.to_json() for r in rows]}, indent=2, default=str))
        return
    out = render.console()
    out.print(render.status_table(name, rows, compute=compute or _compute_axis(rows)))
    out.print(_summary_line(rows))
    notes = sorted({note for r in rows for note in r.notes})
    for note in notes:
        count = sum(note in r.notes for r in rows)
        out.print(f"note: {count} run{'s' if count != 1 else ''}: {escape(note)}", soft_wrap=True)
    _print_pruned(out, rows)
    render.print_failures(out, rows)


def _live_prune(store: Store, sweep: str) -> list[str]:
    """The live prune step (analysis.report.prune), stopping runs with launcher.cancel.prune. A
    sweep without a `prune:` block costs one read, and nothing of analysis/ is imported."""
    record = store.get_sweep(sweep)
    if record is None or (record.spec.get("grid") or {}).get("prune") is None:
        return []
    from analysis.report.build import ReportError
    from analysis.report.prune import apply_live_policy
    from launcher.cancel import prune

    try:
        return apply_live_policy(store, sweep, prune)
    except ReportError as exc:
        _fail(f"sweep {sweep}: {exc}")
        raise  # unreachable: _fail exits


def _print_pruned(out: Any, rows: Sequence[Any]) -> None:
    for line in pruned_lines(list(rows)):
        out.print(f"[dark_orange]{escape(line)}[/]", soft_wrap=True)


class ComputeAmount(click.ParamType):
    """A finite compute value (> 0, or >= 0 with `zero`); with `percent`, also `N%`: a fraction
    of each configuration's own compute range. Converts to (value, is_fraction)."""

    name = "compute"

    def __init__(self, *, zero: bool = False, percent: bool = False):
        self.zero, self.percent = zero, percent

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[float, bool]:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        fraction = self.percent and text.endswith("%")
        try:
            number = float(text.removesuffix("%") if fraction else text)
        except ValueError:
            self.fail(f"{value!r} is not a number{' or a percentage (50%)' if self.percent else ''}", param, ctx)
        bound = ">= 0" if self.zero else "> 0"
        if not math.isfinite(number) or number < 0 or (number == 0 and not self.zero):
            self.fail(f"{value!r}: must be a finite number {bound}", param, ctx)
        return (number / 100, True) if fraction else (number, False)


def _at_least_one(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1 (runs at once), got {value}", param_hint="'--max-parallel'")
    return value


def _nonblank(_ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Run ids and sweep names are matched as given: an empty one would match everything."""
    if not value.strip():
        what = "a run id (or a unique prefix of one)" if param.name == "run" else "a sweep name or a run id (prefix)"
        raise click.BadParameter(f"{value!r} is empty; give {what}", param_hint=param.name)
    return value


@cli.command("cancel")
@click.argument("target", callback=_nonblank)
@click.pass_context
@_errors
def cancel_cmd(ctx: click.Context, target: str) -> None:
    """Cancel every active run of a sweep, or one run (TARGET is a sweep name or a run id)."""
    from launcher.cancel import cancel

    store = _store(ctx)
    cancelled = cancel(store, target)
    render.console().print(f"cancelled {len(cancelled)} run(s): {', '.join(cancelled) or '-'}")


@cli.command("prune")
@click.argument("sweep", required=False)
@click.option("--simulate", is_flag=True, help="Replay the sweep's curves in compute order as if it were running.")
@click.option("--dry-run", is_flag=True, help="What would be pruned now, and why (nothing is changed).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--compute", type=click.Choice(MEASURED_COMPUTE_AXES), default=None, help="Compute axis [default: as report].")
@click.pass_context
@_errors
def prune_cmd(ctx: click.Context, sweep: str | None, simulate: bool, dry_run: bool, as_json: bool, compute: str | None) -> None:
    """Scaling-aware pruning of SWEEP's configurations (seeds pooled): one is dominated when the
    upper bound of its fitted asymptote lies below the best configuration's lower bound by more
    than the margin (the sweep file's `prune:` block; docs/pruning.md). --simulate also shows a
    current-value pruner (what ASHA-style tools judge) beside it. The policy is applied live by
    `sweep status` (and `--watch`, `sweep launch --wait`, the local scheduler): pruned runs stop
    after a checkpoint; `sweep launch --resume-pruned` resumes them."""
    from analysis.report.build import ReportError
    from analysis.report.prune import prune_data

    if simulate == dry_run:
        raise click.UsageError("give one of --simulate and --dry-run")
    store = _store(ctx)
    try:
        data = prune_data(store, _sweep_name(store, sweep), simulate=simulate, compute=compute)
    except ReportError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(render.prune_text(data))


@cli.command("show")
@click.argument("run", callback=_nonblank)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
@_errors
def show_cmd(ctx: click.Context, run: str, as_json: bool) -> None:
    """RUN (an id or unique prefix): its resolved config, axis values, attempts with their states
    and exit reasons, checkpoints, last eval points, and the provenance of its latest attempt
    (code commit, packages, host, GPUs, Slurm job)."""
    from launcher.runs import show

    data = show(_store(ctx), run)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    render.console().print(render.run_details(data), soft_wrap=True)


@cli.command("rerun")
@click.argument("run", callback=_nonblank)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=None, help="Another seed [default: the run's].")
@click.pass_context
@_errors
def rerun_cmd(ctx: click.Context, run: str, seed: int | None) -> None:
    """Register RUN's resolved config again as a new run of its sweep (with --seed, another
    seed) and submit it; says so when the code commit differs from the one RUN ran."""
    from launcher.runs import rerun

    result = rerun(_store(ctx, create=True), run, seed=seed)
    out = render.console()
    if result.code_note:
        out.print(f"[yellow]note:[/] {escape(result.code_note)}", soft_wrap=True)
    out.print(
        f"run {escape(result.run)}: a rerun of {escape(result.original)} in sweep {escape(result.sweep)}, "
        + ("submitted" if result.submitted else "registered (waiting for room to submit)")
    )


@cli.command("logs")
@click.argument("run", callback=_nonblank)
@click.option("--stderr", "which", flag_value="stderr", default=True, help="Show stderr (default).")
@click.option("--stdout", "which", flag_value="stdout", help="Show stdout.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the log grows.")
@click.option(
    "--task", type=click.IntRange(min=0), default=0, show_default=True,
    help="Which task of a multi-task run (0 is trainer rank 0; `sweep show RUN --json` lists them under hosts).",
)  # fmt: skip
@click.pass_context
@_errors
def logs_cmd(ctx: click.Context, run: str, which: str, follow: bool, task: int) -> None:
    """The latest attempt's log of RUN (a run id or unique prefix)."""
    from launcher.runs import log_path, read_log

    store = _store(ctx)
    record, path = log_path(store, run, which, task)
    try:
        for chunk in read_log(store, record.id, path, follow=follow):
            sys.stdout.write(render.printable(chunk))
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass


@cli.command("report")
@click.argument("sweep", required=False)
@click.option("--format", "fmt", type=click.Choice(REPORT_FORMATS), default="table", show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write PNG plots and the report file (report.md/.csv/.json/.html) into this directory.",
)
@click.option(
    "--compute",
    type=click.Choice(COMPUTE_AXES),
    default=None,
    help="Compute axis [default: gpu_hours on GPUs, else tokens (generated), else flops].",
)
@click.option(
    "--method",
    type=click.Choice(["fast", "reference"]),
    default="fast",
    show_default=True,
    help="reference: the paper's grid search.",
)
@click.option(
    "--r0",
    type=click.Choice(["first", "fit"]),
    default="first",
    show_default=True,
    help="R0 from the first evaluation, or fitted.",
)
@click.option(
    "--cutoff", type=ComputeAmount(zero=True), default="0", show_default=True, help="Fit only points with compute >= this."
)
@click.option(
    "--bootstrap",
    "n_boot",
    type=click.IntRange(0, 100_000),
    default=200,
    show_default=True,
    help="Bootstrap samples for intervals (0: none; at most 100,000).",
)
@click.option("--level", type=click.FloatRange(0.5, 0.999), default=0.95, show_default=True, help="Interval level.")
@click.option("--include-flagged", is_flag=True, help="Rank flagged fits too.")
@click.option(
    "--fit-until",
    type=ComputeAmount(percent=True),
    default=None,
    help="Extrapolate: fit compute up to this (or N%: of each configuration's own compute range) ...",
)
@click.option(
    "--predict",
    "predict_at",
    type=ComputeAmount(percent=True),
    default=None,
    help="... and predict the pass rate here (same units as --fit-until).",
)
@click.option(
    "--ceiling-axes",
    default=None,
    help="Axes that set the ceiling, comma-separated: --fit-until/--backtest extrapolate configurations "
    "that agree on them with one shared A (default: what the task knows; sumk: its length budget).",
)
@click.option("--own-ceilings", is_flag=True, help="Extrapolate every configuration with its own A (no sharing).")
@click.option(
    "--backtest",
    is_flag=True,
    help="Replay the fit at 10%..90% of each configuration's compute and check the predicted final "
    "pass rates against the finals (table or json; the plot goes to --out, default: here).",
)
@click.pass_context
@_errors
def report_cmd(
    ctx: click.Context,
    sweep: str | None,
    fmt: str,
    out: Path | None,
    compute: str | None,
    method: Literal["fast", "reference"],
    r0: Literal["first", "fit"],
    cutoff: tuple[float, bool],
    n_boot: int,
    level: float,
    include_flagged: bool,
    fit_until: tuple[float, bool] | None,
    predict_at: tuple[float, bool] | None,
    ceiling_axes: str | None,
    own_ceilings: bool,
    backtest: bool,
) -> None:
    """Fit the sigmoid to every configuration's curve; rank by A, then B; compare; judge each axis.

    Without --out the report goes to stdout (html too: one self-contained page). With --out DIR,
    DIR gets one PNG per configuration and per axis, and the report file in the chosen format
    (table: the table is printed, plots only).
    """
    from analysis.report.build import ReportError, ReportOptions, build_report
    from analysis.report.plots import PlotError
    from analysis.report.render import render_table, render_text, write_report

    if fit_until is not None and predict_at is not None and fit_until[1] != predict_at[1]:
        raise click.UsageError("give --fit-until and --predict both as percentages or both as compute")
    declared = None if ceiling_axes is None else tuple(a.strip() for a in ceiling_axes.split(",") if a.strip())
    if declared is not None and own_ceilings:
        raise click.UsageError("give --ceiling-axes or --own-ceilings, not both")
    if backtest:
        from analysis.report.backtest import report_backtest

        if fmt not in ("table", "json") or fit_until is not None or predict_at is not None:
            raise click.UsageError("--backtest takes --format table or json, and no --fit-until or --predict")
        store = _store(ctx)
        try:
            report_backtest(
                store, _sweep_name(store, sweep), fmt=fmt, out=out or Path("."), compute=compute,
                method=method, r0=r0, cutoff=cutoff[0], n_boot=n_boot, level=level, console=render.console(),
                ceiling_axes=declared, own_ceilings=own_ceilings,
            )  # fmt: skip
        except (PlotError, OSError, ValueError) as exc:
            _fail(str(exc))
        return
    try:
        options = ReportOptions(
            compute=compute, method=method, r0=r0, cutoff=cutoff[0], n_boot=n_boot, level=level,
            include_flagged=include_flagged, fit_until=fit_until and fit_until[0],
            predict_at=predict_at and predict_at[0], relative=bool(predict_at and predict_at[1]),
            ceiling_axes=declared, own_ceilings=own_ceilings,
        )  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    store = _store(ctx)
    try:
        report = build_report(store, _sweep_name(store, sweep), options)
    except ReportError as exc:
        _fail(str(exc))
    try:
        if out is None:
            if fmt == "table":
                render_table(report, render.console())
            else:
                click.echo(render_text(report, fmt), nl=False)
            return
        written = write_report(report, fmt, out)
    except (PlotError, OSError) as exc:
        _fail(str(exc))
    if fmt == "table":
        render_table(report, render.console())
    plots = [p for p in written if p.suffix == ".png"]
    report_file = "" if fmt == "table" else f"{written[0].name} and "
    click.echo(f"wrote {report_file}{len(plots)} plots into {out}")


@cli.command("serve")
@click.argument("sweep", required=False)
@click.option("--port", type=click.IntRange(1, 65535), default=8050, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Any other address needs the token printed at start.")
@click.option("--compute", type=click.Choice(COMPUTE_AXES), default=None, help="Compute axis [default: as report].")
@click.option("--predict", "predict_at", type=ComputeAmount(), default=None, help="Target compute of the extrapolations and p_best.")
@click.pass_context
@_errors
def serve_cmd(ctx: click.Context, sweep: str | None, port: int, host: str, compute: str | None, predict_at: tuple[float, bool] | None) -> None:
    """A live page of the sweep's runs, curves and fits in the browser (every sweep without SWEEP)."""
    from analysis.serve.cli import serve_command

    serve_command(_store(ctx), sweep and _sweep_name(_store(ctx), sweep), host, port, compute, predict_at and predict_at[0])


@cli.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--sweep", "sweep", required=True, help="Sweep to import into (created if it does not exist).")
@click.option(
    "--compute-axis",
    type=click.Choice(MEASURED_COMPUTE_AXES),
    default="gpu_hours",
    show_default=True,
    help="Which compute column the file's `compute` is.",
)
@click.option(
    "--format", "fmt", type=click.Choice(IMPORT_FORMATS), default=None, help="[default: from the file's extension]"
)
@click.pass_context
@_errors
def import_cmd(ctx: click.Context, file: Path, sweep: str, compute_axis: str, fmt: str | None) -> None:
    """Import pass-rate curves from FILE (CSV or JSONL) into a sweep, to fit and rank them.

    \b
    One row per evaluation, with the columns:
      run        the run's name (required)
      compute    compute spent at the evaluation, >= 0 (required)
      pass_rate  held-out pass rate in [0, 1] (required)
      step       training step, an integer (optional; default: the row's order within its run)
      any other  a label of the run (constant within the run), e.g. loss, lr, seed

    Labels are the run's axes: runs that differ only in `seed` are one configuration, fitted
    together. A run with no label but `seed` gets the label run=<its name>. Each run's id is a
    hash of the sweep and run name: importing again updates, never duplicates. A bad row (each
    is named by line) means nothing is written.
    """
    store = _store(ctx, create=True)
    try:
        result = import_curves(store, file, sweep, compute_axis=compute_axis, fmt=fmt)
    except ValueError as exc:  # ImportFileError included: every bad line, nothing written
        _fail(str(exc))
    hint = "" if compute_axis == "gpu_hours" else f" --compute {compute_axis}"
    render.console().print(
        f"imported {result.num_runs} runs ({result.new_runs} new) and {result.num_points} points into "
        f"{'new ' if result.created_sweep else ''}sweep [bold]{escape(result.sweep)}[/]; "
        f"fit them with `sweep report {escape(result.sweep)}{hint}`",
        soft_wrap=True,
    )


# ---------------------------------------------------------------------------------------------


def _compute_axis(rows: Sequence[Any]) -> str:
    lasts = [r.last for r in rows if r.last is not None]
    return "gpu_hours" if lasts and all(p.gpu_hours > 0 for p in lasts) else "flops"


def _summary_line(rows: Sequence[Any]) -> str:
    counts = summary(list(rows))
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no runs"


def _watch(store: Store, sweep: str, *, compute: str | None = None) -> None:
    """Live table until every run has ended (launcher.status.watch); Ctrl-C stops watching, not the runs."""
    from rich.live import Live

    out = render.console()
    rows: list[Any] = []
    try:
        with Live(console=out, auto_refresh=False) as live:
            for rows in watch(store, sweep, prune=_live_prune):
                done = sum(r.run.state in TERMINAL_STATES for r in rows)
                table = render.status_table(sweep, rows, compute=compute or _compute_axis(rows))
                table.caption = f"{done}/{len(rows)} runs ended · {_summary_line(rows)}"
                live.update(table, refresh=True)
    except KeyboardInterrupt:
        out.print("\nstopped watching; the runs go on")
        return
    out.line()  # Live leaves its last line open when the output is not a terminal
    _print_pruned(out, rows)
    render.print_failures(out, rows)


def main() -> None:
    cli(prog_name="sweep")


if __name__ == "__main__":
    main()
