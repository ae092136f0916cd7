"""ScaleRL on the embedded default (sweeps/scalerl-cpu.yaml), shortened: a real two-task local job
(trainer rank + torch generator rank) through `sweep launch --cluster local --wait`, PipelineRL-8
with interruption on the generator rank; and the local executor's multi-task failure path on real
submitit processes."""

from __future__ import annotations

import time
from pathlib import Path

from click.testing import CliRunner

from launcher import local
from launcher.cli import cli
from store import RunState, Store

ROOT = Path(__file__).resolve().parents[1]
SHORT = [
    "budget.steps=12",
    "recipe.batch.prompts=8",
    "recipe.batch.generations=4",
    "recipe.eval.every=6",
    "recipe.eval.samples=1",
    "recipe.data.num_valid_prompts=32",
]


def test_scalerl_cpu_runs_two_tasks_pipelined_with_interruption_on_the_generator_rank(tmp_path):
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    sweep_file = str(ROOT / "sweeps" / "scalerl-cpu.yaml")
    result = CliRunner().invoke(
        cli, ["--db", db, "launch", sweep_file, *SHORT, "--cluster", "local", "--wait"], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    store = Store(db)
    (run,) = store.runs("scalerl-cpu")
    assert run.state == RunState.COMPLETED, run.state_reason
    metrics = [m for _, m in store.train_metrics(run.id)]
    assert len(metrics) == 12
    lags = [m["lag_max"] for m in metrics]
    assert max(lags) >= 1 and all(0 <= lag <= 8 for lag in lags)  # generation ran ahead, within k = 8
    assert any(m["interrupted_fraction"] > 0 for m in metrics)  # budgets forced on the generator rank
    assert all("truncation_rate" in m for m in metrics)
    logs = sorted(p.name for p in (Path(run.run_dir) / "logs").glob("*_log.out"))
    assert len(logs) == 2  # one per task
    assert "generator 0: joined the weight group" in (Path(run.run_dir) / "logs" / logs[1]).read_text()
    assert not (Path(run.run_dir) / "rendezvous.json").exists()  # withdrawn at the end


def _task(seconds: float) -> str:
    import os

    if os.environ["SUBMITIT_LOCAL_GLOBALID"] == "1":
        raise RuntimeError("generator rank exploded")
    time.sleep(seconds)  # task 0 would wait for its peer for a long time
    return "done"


def test_a_failed_task_stops_the_jobs_other_tasks_and_names_its_cause_and_log(tmp_path, monkeypatch):
    import os

    import submitit

    # the tasks unpickle `_task` by reference: they import this module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    executor = submitit.LocalExecutor(folder=tmp_path / "logs")
    executor.update_parameters(timeout_min=5, tasks_per_node=2)
    job = executor.submit(_task, 120)
    deadline = time.monotonic() + 60
    failed = None
    while failed is None and time.monotonic() < deadline:
        failed = local._failed_task(job)
        time.sleep(0.2)
    assert failed is not None, "task 1's failure was not seen"
    cause, log = failed
    assert cause == "RuntimeError: generator rank exploded"
    assert log == job.task(1).paths.stderr and log.exists()
    started = time.monotonic()
    job.cancel()
    while not job.done() and time.monotonic() - started < 30:
        time.sleep(0.2)
    assert job.done() and time.monotonic() - started < 30  # task 0 did not sleep its 120 s out
    assert local._ended_badly(job) is not None
