"""The whole loop through the `sweep` CLI on the embedded default: local executor, SQLite, the
tiny CPU model, real training jobs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from store import Store

TINY = """\
name: tiny
recipe:
  batch: {prompts: 4, generations: 4}
  optim: {lr: 3.0e-4, warmup_steps: 0}
  eval: {every: 10, samples: 2}
  data: {num_valid_prompts: 32}
  checkpoint: {every: 10}
grid:
  loss.type: [cispo, grpo]
budget: {steps: 30}
"""


def sweep(db: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--db", db, *args], terminal_width=200)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def wait_for(condition, timeout_s: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def launch_one_run(sweep_file, db: str, *, steps: int):
    """Launch a one-run version of TINY with `steps` steps; (grid path, store, the run)."""
    grid = str(
        sweep_file(
            TINY.replace("loss.type: [cispo, grpo]", "loss.type: [cispo]").replace("steps: 30", f"steps: {steps}")
        )
    )
    code, out = sweep(db, "launch", grid, "--cluster", "local")
    assert code == 0, out
    store = Store(db)
    (run,) = store.runs("tiny")
    return grid, store, run


def test_misspelled_key_fails_before_anything_is_registered(sweep_file, sqlite_url, tmp_path):
    grid = sweep_file("name: typo\ngrid:\n  loss.agregation: [prompt, token]\n")
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "local")
    assert code == 2
    assert str(grid) in out and "grid.loss.agregation" in out and "did you mean 'loss.aggregation'?" in out
    assert not (tmp_path / "sweeps.db").exists()  # the store was never opened
    assert not (tmp_path / "runs").exists()


def test_dry_run_json_lists_ids_and_axes_and_submits_nothing(sweep_file, sqlite_url, tmp_path):
    code, out = sweep(sqlite_url, "launch", str(sweep_file(TINY)), "--dry-run", "--json", "--cluster", "local")
    assert code == 0
    plan = json.loads(out)
    assert plan["sweep"] == "tiny"
    assert [r["axes"] for r in plan["runs"]] == [{"loss.type": "cispo"}, {"loss.type": "grpo"}]
    assert all(len(r["id"]) == 12 for r in plan["runs"])
    assert not (tmp_path / "sweeps.db").exists()


@pytest.mark.slow
def test_sweep_runs_to_completion_and_relaunch_is_a_no_op(sweep_file, sqlite_url):
    grid = str(sweep_file(TINY))
    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--max-parallel", "2", "--wait")
    assert code == 0, out
    assert "2 runs, 2 new, 2 submitted (local)" in out

    code, out = sweep(sqlite_url, "status", "--json")
    status = json.loads(out)
    assert [r["state"] for r in status["runs"]] == ["completed", "completed"]
    assert all(r["step"] == 30 and 0 <= r["pass_rate"] <= 1 and r["attempts"] == 1 for r in status["runs"])
    for run in status["runs"]:
        run_dir = Path(run["run_dir"])
        assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints").is_dir()
        assert Path(run["stdout"]).is_file()
        # async.mode=pipeline (the default) in one task: the log and status say it is synchronous
        assert "synchronous (lag 0" in Path(run["stdout"]).read_text() + Path(run["stderr"]).read_text()
        assert run["notes"] == ["async.mode=pipeline with engine.generator_ranks=0: synchronous (lag 0)"]
    code, out = sweep(sqlite_url, "status")
    assert "note: 2 runs: async.mode=pipeline with engine.generator_ranks=0: synchronous (lag 0)" in out

    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local")
    assert code == 0 and "2 runs, 0 new, 0 submitted" in out
    store = Store(sqlite_url)
    assert all(len(store.attempts(r.id)) == 1 for r in store.runs("tiny"))

    code, out = sweep(sqlite_url, "report", "--format", "json")
    assert code == 0, out
    report = json.loads(out)
    assert sorted(rid for r in report["runs"] for rid in r["run_ids"]) == sorted(r["run"] for r in status["runs"])
    assert all(r["n_points"] == 8 for r in report["runs"])  # evals at steps 0, 1, 2, 4, 8, 10, 20, 30

    # A larger budget continues the same runs from their last checkpoint.
    code, out = sweep(sqlite_url, "launch", grid, "budget.steps=40", "--cluster", "local", "--wait")
    assert code == 0 and "2 runs, 0 new, 2 submitted" in out, out
    for run in store.runs("tiny"):
        assert (run.state, run.budget["steps"]) == ("completed", 40)
        assert [a.resumed_from_step for a in store.attempts(run.id)] == [None, 30]
        assert [p.step for p in store.eval_points(run.id)] == [0, 1, 2, 4, 8, 10, 20, 30, 40]


@pytest.mark.slow
def test_sigkilled_job_fails_and_retry_resumes_from_its_checkpoint(sweep_file, sqlite_url):
    grid, store, run = launch_one_run(sweep_file, sqlite_url, steps=1000)

    def running_with_a_checkpoint():
        checkpoints = store.checkpoints(run.id)
        return store.get_run(run.id).state == "running" and checkpoints

    checkpoints = wait_for(running_with_a_checkpoint, what="a checkpoint")
    os.kill(store.attempts(run.id)[-1].pid, signal.SIGKILL)

    def failed():
        code, out = sweep(sqlite_url, "status", "--json")
        (row,) = json.loads(out)["runs"]
        return row if row["state"] == "failed" else None

    row = wait_for(failed, 30, "the run to show as failed")
    assert "kill" in row["reason"].lower() and "log:" in row["reason"]
    code, out = sweep(sqlite_url, "status")
    assert "failed" in out

    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--retry-failed", "--wait")
    assert code == 0, out
    attempts = store.attempts(run.id)
    assert [a.state for a in attempts] == ["failed", "completed"]
    assert attempts[1].resumed_from_step is not None and attempts[1].resumed_from_step >= checkpoints[-1].step
    steps = [p.step for p in store.eval_points(run.id)]
    expected = [0, 1, 2, 4, 8, *range(10, 1001, 10)]
    assert steps == expected  # nothing lost, nothing stored twice


@pytest.mark.slow
def test_cancel_checkpoints_the_running_job_and_retry_resumes_it(sweep_file, sqlite_url):
    grid, store, run = launch_one_run(sweep_file, sqlite_url, steps=600)
    wait_for(lambda: store.get_run(run.id).state == "running" and store.get_run(run.id).step > 50, what="training")

    code, out = sweep(sqlite_url, "cancel", "tiny")
    assert code == 0 and f"cancelled 1 run(s): {run.id}" in out
    attempt = wait_for(lambda: (a := store.attempts(run.id)[-1]).state == "cancelled" and a, what="the job to stop")
    stopped_at = int(attempt.exit_reason.rsplit(" ", 1)[-1])  # "cancelled at step N"
    assert store.get_run(run.id).state == "cancelled"
    assert store.checkpoints(run.id)[-1].step == stopped_at  # it checkpointed before stopping

    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--retry-failed", "--wait")
    assert code == 0, out
    attempts = store.attempts(run.id)
    assert [a.state for a in attempts] == ["cancelled", "completed"]
    assert attempts[1].resumed_from_step == stopped_at
