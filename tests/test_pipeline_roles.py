"""The roles of a multi-task run as real local processes (no Slurm): trainer rank 0, a second
trainer rank and one torch generator rank, under PipelineRL-k with k = 2. The run completes
with its eval points, lags within k and above 0, and stops and resumes from its checkpoint."""

from __future__ import annotations

import os
import queue
import time

import pytest
import torch.multiprocessing as mp
from conftest import small_recipe

from recipe.telemetry.sinks import MemorySink

pytestmark = pytest.mark.slow


def pipeline_config(model_dir, **overrides):
    pipeline = {"async.mode": "pipeline", "async.max_lag": 2, "engine.generator_ranks": 1}
    return small_recipe(model_dir, **(pipeline | overrides))


def _task(rank: int, config: dict, run_dir: str, attempt: str, stop_after: int | None, results) -> None:
    os.environ.update(SWEEP_NUM_TASKS="3", SWEEP_TASK_RANK=str(rank), SWEEP_ATTEMPT=attempt)
    from pathlib import Path

    from recipe.config import RecipeConfig
    from recipe.loop.train import train
    from recipe.pipeline.env import layout_of, task_env
    from recipe.pipeline.lead import LeadTeam
    from recipe.pipeline.peer import run_peer

    cfg, run_path, env = RecipeConfig.from_dict(config), Path(run_dir), task_env()
    if rank:
        results.put((rank, run_peer(cfg, run_path, env, lambda _: None)))
        return
    sink, calls = MemorySink(), iter(range(1, 10_000))
    should_stop = (lambda: next(calls) >= stop_after) if stop_after else (lambda: False)
    with LeadTeam(cfg, run_path, env, layout_of(cfg, env), lambda _: None) as team:
        outcome = train(cfg, run_path, sink, should_stop=should_stop, log=lambda _: None, team=team)
    results.put((0, (outcome, sink.eval_points, sink.metrics)))


def run_tasks(cfg, run_dir, attempt: str, stop_after: int | None = None, timeout_s: float = 400) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (cfg.to_dict(), str(run_dir), attempt, stop_after, results)
    procs = [ctx.Process(target=_task, args=(rank, *args)) for rank in range(3)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < 3:
        try:
            rank, value = results.get(timeout=1.0)
            got[rank] = value
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                pytest.fail(f"tasks failed (exit codes {[p.exitcode for p in procs]}), results from {sorted(got)}")
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_three_tasks_train_under_pipeline_k_and_resume_from_a_checkpoint(model_dir, tmp_path):
    cfg = pipeline_config(model_dir)
    got = run_tasks(cfg, tmp_path, "first", stop_after=3)
    assert got[1] == "trainer rank 1 done" and got[2] == "generator 0 done"
    outcome, _, metrics = got[0]
    assert outcome.state == "stopped" and outcome.final_step == 3

    got = run_tasks(cfg, tmp_path, "second")
    outcome, points, metrics = got[0]
    assert outcome.state == "completed" and outcome.final_step == 8 and outcome.resumed_from_step == 3
    assert sorted(points) == [4, 8]  # the first attempt's 0, 1, 2 stay where they were
    assert sorted(metrics) == [4, 5, 6, 7, 8]
    lags = [m["lag_max"] for m in metrics.values()]
    assert all(0 <= lag <= 2 for lag in lags) and max(lags) >= 1, lags
    assert all(0 <= m["lag_mean"] <= m["lag_max"] and m["num_dropped"] >= 0 for m in metrics.values())
    assert all(m["weight_push_seconds"] >= 0 for m in metrics.values())
    assert points[8]["tokens"] > 0 and points[8]["flops"] > 0


def test_ppo_offpolicy_k_on_generator_ranks_trains_round_after_round_on_one_pushed_version(model_dir, tmp_path):
    """PPO-off-policy-k with a real generator rank: one push per round of k steps, so step i of a
    round trains on data exactly i versions old (lags 0, 1, 2, 0, 1, 2 for k = 3), never dropped."""
    cfg = pipeline_config(model_dir, **{"async.mode": "ppo-offpolicy", "async.max_lag": 3, "budget.steps": 6})
    got = run_tasks(cfg, tmp_path, "rounds")
    outcome, _, metrics = got[0]
    assert outcome.state == "completed" and outcome.final_step == 6
    assert [metrics[step]["lag_max"] for step in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    assert [metrics[step]["lag_mean"] for step in range(1, 7)] == [0, 1, 2, 0, 1, 2]
    assert all(m["num_dropped"] == 0 for m in metrics.values())
