"""What pipelining buys on the embedded default: the ScaleRL CPU run (sweeps/scalerl-cpu.yaml) as
one task against PipelineRL-8 with one trainer task and one generator task, on the same cores.

    python bench/bench_pipeline.py [--steps 300] [--target 0.45]    # ~10 minutes on 2 idle cores
    python bench/bench_pipeline.py --smoke                           # a few steps: the script works

Both runs go through `sweep launch --cluster local --wait` (real jobs, a private SQLite store),
one after the other, so neither competes with the other for the cores:

- one task: `engine.generator_ranks: 0`, `resources.tasks_per_node: 1`, `engine.threads` = the
  cores (it has them all; generation and training alternate in it, lag 0);
- PipelineRL-8: the file as it is, two tasks of one thread each (the generator streams while the
  trainer trains; weights pushed in flight, lag up to 8);
- for reference, one task on one thread: how much of the one-task run's speed is its second
  thread (intra-op parallelism), which the pipeline's tasks do not have.

Figures, from the store: steps/s over the whole job (the attempt's start to its end: loading,
evaluations and checkpoints included, the same work in both), the step at which the held-out
pass rate first reaches `--target`, and the wall-clock to it (that step at the job's rate), with
the ratio one-task / pipeline of each (target >= 1.6x for steps/s). The train steps' own time
(`step_seconds`) is no fair clock here: under PipelineRL the generator keeps generating while
trainer rank 0 evaluates, so the steps after an evaluation find their batches waiting. Prints a
Markdown table for bench/RESULTS.md with the machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "sweeps" / "scalerl-cpu.yaml"
TARGET_RATIO = 1.6


def run(name: str, edits: list[str], workdir: Path) -> dict[str, float | None]:
    """Launch the sweep file with `edits` under a sweep named `name`; its figures."""
    from launcher.cli import cli
    from store import RunState, Store

    db = f"sqlite:///{workdir / (name + '.sqlite')}"
    os.environ["SWEEP_ROOT"] = str(workdir / "runs")
    args = ["--db", db, "launch", str(SWEEP), f"name={name}", *edits, "--cluster", "local", "--wait"]
    result = CliRunner().invoke(cli, args, terminal_width=200)
    if result.exit_code != 0:
        raise SystemExit(f"{name}: the launch failed:\n{result.output}")
    store = Store(db)
    (record,) = store.runs(name)
    if record.state != RunState.COMPLETED:
        raise SystemExit(f"{name}: the run ended {record.state}: {record.state_reason}")
    metrics = [m for _, m in store.train_metrics(record.id)]
    points = sorted(store.eval_points(record.id), key=lambda p: p.step)
    (attempt,) = store.attempts(record.id)
    return {
        "steps": float(len(metrics)),
        "job_seconds": (attempt.ended_at - attempt.started_at).total_seconds(),
        "lag_max": max(m["lag_max"] for m in metrics),
        "interrupted": sum(m["interrupted_fraction"] for m in metrics) / len(metrics),
        "points": [(p.step, p.pass_rate) for p in points],  # type: ignore[dict-item]
    }


def step_reaching(points: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, rate in points if rate >= target), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.45, help="held-out pass rate to reach")
    parser.add_argument("--smoke", action="store_true", help="a few small steps: the script runs end to end")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    edits = [f"budget.steps={args.steps}"]
    if args.smoke:
        edits = ["budget.steps=6", "recipe.batch.prompts=4", "recipe.batch.generations=4", "recipe.eval.every=3",
                 "recipe.eval.samples=1", "recipe.data.num_valid_prompts=16"]  # fmt: skip
    one_task = [*edits, "recipe.engine.generator_ranks=0", "resources.tasks_per_node=1"]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        workdir = Path(tmp)
        alone = run("bench-one-task", [*one_task, f"recipe.engine.threads={cores}"], workdir)
        piped = run("bench-pipeline-8", edits, workdir)
        single = run("bench-one-task-1-thread", [*one_task, "recipe.engine.threads=1"], workdir)
    runs = {"one": alone, "pipe": piped, "single": single}
    rate = {k: v["steps"] / v["job_seconds"] for k, v in runs.items()}
    step = {k: step_reaching(v["points"], args.target) for k, v in runs.items()}
    reach = {k: None if step[k] is None else step[k] / rate[k] for k in runs}
    ratio = rate["pipe"] / rate["one"]
    reach_ratio = reach["one"] / reach["pipe"] if reach["one"] and reach["pipe"] else None
    print(f"## What pipelining buys: `python bench/bench_pipeline.py{' --smoke' if args.smoke else ''}` "
          f"({datetime.date.today()})\n")  # fmt: skip
    print(f"{platform.processor() or platform.machine()}, {cores} cores, Python {sys.version.split()[0]}; "
          f"sweeps/scalerl-cpu.yaml, {int(alone['steps'])} steps each, one run at a time.\n")  # fmt: skip
    print(f"| run | steps/s (whole job) | job seconds | step reaching {args.target} | wall-clock to it | lag_max "
          "| interrupted |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = (("one", f"one task (alternating, lag 0), {cores} threads"), ("pipe", "PipelineRL-8 (1 trainer + 1 generator, 1 thread each)"),
            ("single", "one task, 1 thread (for reference: what each pipeline task has)"))  # fmt: skip
    for key, name in rows:
        figures = runs[key]
        reached = "not reached" if step[key] is None else str(step[key])
        seconds = "-" if reach[key] is None else f"{reach[key]:.0f} s"
        print(f"| {name} | {rate[key]:.3f} | {figures['job_seconds']:.0f} | {reached} | {seconds} | "
              f"{figures['lag_max']:.0f} | {figures['interrupted']:.2f} |")  # fmt: skip
    verdict = "PASS" if ratio >= TARGET_RATIO else "below target"
    reach_text = "n/a (a run did not reach it)" if reach_ratio is None else f"{reach_ratio:.2f}x"
    print(f"\nsteps/s ratio PipelineRL-8 / one task: **{ratio:.2f}x** (target >= {TARGET_RATIO}x: {verdict}); "
          f"wall-clock to the target pass rate, one task / PipelineRL-8: {reach_text}; "
          f"PipelineRL-8 / one task on 1 thread: {rate['pipe'] / rate['single']:.2f}x")  # fmt: skip

if __name__ == "__main__":
    main()
