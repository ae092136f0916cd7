"""The training loop end to end on a tiny real model: eval points, checkpoints, resume,
off-policy lag, budgets, filters, and what this engine refuses."""

import importlib.util
from dataclasses import dataclass, field

import pytest
import torch
from conftest import small_recipe

from recipe.config import ConfigError, NotAvailableError, resolve
from recipe.loop import checkpoint
from recipe.loop.checks import check_engine
from recipe.loop.evaluate import is_eval_step
from recipe.loop.rollout import generate_batch, shaped_rewards
from recipe.loop.state import initial_state, uses_deepspeed, uses_vllm
from recipe.loop.train import TrainOutcome, train
from recipe.loop.update import lr_at, policy_update, step_damping
from recipe.tasks.task import load_task
from recipe.telemetry.sinks import MemorySink

# A base that passes often enough (about 40 % sampled) for most groups to carry a signal.


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@dataclass
class RecordingSink(MemorySink):
    """Also keeps every reported eval step in order, so a duplicate report would show."""

    reported: list[int] = field(default_factory=list)

    def eval_point(self, point):
        self.reported.append(point["step"])
        super().eval_point(point)


def run(cfg, run_dir, sink=None, should_stop=lambda: False):
    sink = sink if sink is not None else RecordingSink()
    logs: list[str] = []
    outcome = train(cfg, run_dir, sink, should_stop=should_stop, log=logs.append)
    return outcome, sink, logs


def stop_after(num_steps: int):
    calls = iter(range(1, 10_000))
    return lambda: next(calls) >= num_steps


def saved_weights(run_dir, step):
    return torch.load(checkpoint.checkpoint_path(run_dir, step), weights_only=True)["model"]


# ---------------------------------------------------------------------------------------------
# Schedule


def test_eval_schedule_is_log_spaced_then_regular():
    cfg = resolve({"eval.every": 100})
    steps = [s for s in range(0, 401) if is_eval_step(s, cfg)]
    assert steps == [0, 1, 2, 4, 8, 16, 32, 64, 100, 200, 300, 400]
    linear = resolve({"eval.every": 100, "eval.log_spaced": False})
    assert [s for s in range(0, 401) if is_eval_step(s, linear)] == [0, 100, 200, 300, 400]


def test_lr_warms_up_linearly_then_stays():
    cfg = resolve({"optim.lr": 1e-3, "optim.warmup_steps": 4})
    assert [lr_at(s, cfg) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert lr_at(0, resolve({"optim.lr": 1e-3, "optim.warmup_steps": 0})) == 1e-3


# ---------------------------------------------------------------------------------------------
# A run


def test_a_run_reports_eval_points_metrics_and_checkpoints(model_dir, tmp_path):
    outcome, sink, logs = run(small_recipe(model_dir), tmp_path)
    assert outcome == TrainOutcome(final_step=8, state="completed", resumed_from_step=None)
    assert sorted(sink.eval_points) == [0, 1, 2, 4, 8]
    points = [sink.eval_points[s] for s in sorted(sink.eval_points)]
    for point in points:
        assert set(point) == {
            "step",
            "pass_rate",
            "num_samples",
            "flops",
            "tokens",
            "device_seconds",
            "gpu_hours",
            "metrics",
        }
        assert 0.0 <= point["pass_rate"] <= 1.0 and point["num_samples"] == 32 and point["gpu_hours"] == 0.0
    assert points[0]["flops"] == 0 and points[0]["tokens"] == 0
    assert all(
        a["flops"] < b["flops"] and a["device_seconds"] < b["device_seconds"] for a, b in zip(points, points[1:])
    )
    assert {"mean_length", "truncation_rate", "entropy", "train_reward_mean", "train_zero_variance_fraction"} <= set(
        points[-1]["metrics"]
    )
    assert sorted(sink.metrics) == list(range(1, 9))
    assert sorted(sink.checkpoints) == [6, 8]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [6, 8]
    assert any("completed at step 8" in m for m in logs)


def test_flops_follow_the_documented_formula(model_dir, tmp_path):
    _, sink, _ = run(small_recipe(model_dir, **{"budget.steps": 1, "filter.zero_variance": False}), tmp_path)
    point, metrics = sink.eval_points[1], sink.metrics[1]
    n = 84_032 - 14 * 64  # every parameter but the input embedding table
    num_sequences, prompt_len = 16, 8
    positions = num_sequences * prompt_len + point["tokens"]
    assert point["tokens"] == pytest.approx(metrics["mean_length"] * num_sequences)
    assert point["flops"] == 2 * n * positions + 6 * n * positions


@pytest.mark.isa
@pytest.mark.parametrize("mode", ["pipeline", "ppo-offpolicy"])
def test_a_stopped_and_resumed_run_matches_an_uninterrupted_one(model_dir, tmp_path, mode):
    cfg = small_recipe(model_dir, **{"budget.steps": 10, "async.mode": mode, "async.max_lag": 3})
    _, straight, _ = run(cfg, tmp_path / "straight")

    outcome, sink, logs = run(cfg, tmp_path / "split", should_stop=stop_after(4))
    assert outcome == TrainOutcome(4, "stopped", None)
    assert 4 in sink.checkpoints and any("stopped at step 4" in m for m in logs)
    outcome, sink, logs = run(cfg, tmp_path / "split", sink=sink)
    assert outcome == TrainOutcome(10, "completed", 4)
    assert sink.resumes == [4] and any("resumed from step 4" in m for m in logs)

    assert sorted(sink.eval_points) == sorted(straight.eval_points) == [0, 1, 2, 4, 8, 10]
    assert sink.reported == [0, 1, 2, 4, 8, 10]  # no gap, no duplicate across the stop
    for step, point in straight.eval_points.items():
        assert sink.eval_points[step]["pass_rate"] == point["pass_rate"], step
        assert sink.eval_points[step]["flops"] == point["flops"], step
    final, final_straight = saved_weights(tmp_path / "split", 10), saved_weights(tmp_path / "straight", 10)
    assert all(torch.equal(final[k], final_straight[k]) for k in final)
    initial = initial_state(cfg, load_task(cfg.data), 7, lambda _: None).model.state_dict()
    assert not all(torch.equal(final[k], initial[k]) for k in final), "the run should have trained"


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(model_dir, tmp_path):
    cfg = small_recipe(model_dir, **{"checkpoint.keep": 3})
    _, first, _ = run(cfg, tmp_path)
    assert sorted(first.checkpoints) == [3, 6, 8]
    newest = checkpoint.checkpoint_path(tmp_path, 8)
    newest.write_bytes(newest.read_bytes()[:1000])

    sink = RecordingSink(eval_points=dict(first.eval_points), checkpoints=dict(first.checkpoints))
    outcome, sink, logs = run(small_recipe(model_dir, **{"checkpoint.keep": 3, "budget.steps": 10}), tmp_path, sink)
    assert outcome.resumed_from_step == 6 and outcome.final_step == 10
    assert any("skipping checkpoint" in m and "step_00000008.pt" in m for m in logs)
    assert sink.resumes == [6]
    assert sorted(sink.checkpoints) == [6, 9, 10]  # the corrupt one reported gone, then rotation
    assert sorted(sink.eval_points) == [0, 1, 2, 4, 8, 10] and sink.reported == [8, 10]
    assert sink.eval_points[8]["pass_rate"] == first.eval_points[8]["pass_rate"]
    assert any("config changed since the checkpoint: budget.steps" in m for m in logs)


# ---------------------------------------------------------------------------------------------
# Off-policy modes


def test_ppo_offpolicy_trains_k_steps_on_batches_of_one_policy(model_dir, tmp_path):
    cfg = small_recipe(model_dir, **{"async.mode": "ppo-offpolicy", "async.max_lag": 3, "budget.steps": 6})
    _, sink, _ = run(cfg, tmp_path)
    metrics = [sink.metrics[s] for s in range(1, 7)]
    assert [m["lag"] for m in metrics] == [0, 1, 2, 0, 1, 2]
    trained = [m for m in metrics if "ratio_max" in m]  # steps where some group was left to train on
    assert all(abs(m["ratio_max"] - 1) < 1e-4 for m in trained if m["lag"] == 0)
    assert any(m["ratio_max"] - m["ratio_min"] > 1e-2 for m in trained if m["lag"] > 0)


def test_pipeline_trains_on_the_current_policy(model_dir, tmp_path):
    _, sink, _ = run(small_recipe(model_dir, **{"budget.steps": 4}), tmp_path)
    assert all(m["lag"] == 0 for m in sink.metrics.values())
    fresh = [m for m in sink.metrics.values() if "ratio_max" in m]
    assert fresh and all(abs(m["ratio_max"] - 1) < 1e-4 and abs(m["ratio_min"] - 1) < 1e-4 for m in fresh)


# ---------------------------------------------------------------------------------------------
# Budgets, filters, length control


def test_a_flops_budget_ends_the_run(model_dir, tmp_path):
    cfg = small_recipe(model_dir, **{"budget.steps": None, "budget.flops": 5e8})
    outcome, sink, logs = run(cfg, tmp_path)
    assert outcome.state == "completed" and outcome.final_step > 1
    steps = sorted(sink.eval_points)
    assert sink.eval_points[steps[-1]]["flops"] >= 5e8 > sink.eval_points[steps[-2]]["flops"]
    assert any("budget.flops=5e+08 reached" in m for m in logs)


def test_no_positive_resampling_can_exhaust_the_training_set(model_dir, tmp_path):
    cfg = small_recipe(model_dir, **{"data.num_train_prompts": 8, "filter.npr_threshold": 0.0, "budget.steps": 100})
    outcome, sink, logs = run(cfg, tmp_path)
    assert outcome == TrainOutcome(2, "completed", None)
    assert max(sink.eval_points) == 2
    assert any("training prompts left after No-Positive-Resampling" in m for m in logs)


def test_zero_variance_groups_leave_the_update(model_dir):
    cfg = small_recipe(model_dir)
    state = initial_state(cfg, load_task(cfg.data), 7, lambda _: None)
    rollout = generate_batch(state)
    before = [p.detach().clone() for p in state.model.parameters()]
    rollout.rewards_PG = torch.ones(4, 4)
    metrics = policy_update(state, rollout)
    assert metrics["num_trained_groups"] == 0 and "loss" not in metrics
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    rollout.rewards_PG = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    metrics = policy_update(state, rollout)
    assert metrics["num_trained_groups"] == 1 and metrics["lr"] == lr_at(state.step, cfg)  # 1 of 4: not damped
    unfiltered = small_recipe(model_dir, **{"filter.zero_variance": False})
    state.cfg = unfiltered
    assert policy_update(state, rollout)["num_trained_groups"] == 4


def test_a_step_on_few_kept_groups_is_damped_in_proportion(model_dir):
    """1 of 4 groups kept under filter.damp_below 0.5: the step takes half the lr, and AdamW's
    first step (lr x sign of the gradient, plus decay) moves the weights half as far."""
    moved = {}
    for damp_below in (0.0, 0.5):
        cfg = small_recipe(model_dir, **{"filter.damp_below": damp_below})
        state = initial_state(cfg, load_task(cfg.data), 7, lambda _: None)
        rollout = generate_batch(state)
        rollout.rewards_PG = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
        before = [p.detach().clone() for p in state.model.parameters()]
        metrics = policy_update(state, rollout)
        assert metrics["lr"] == pytest.approx(lr_at(state.step, cfg) * (0.5 if damp_below else 1.0))
        moved[damp_below] = sum(float((p.detach() - b).abs().sum()) for p, b in zip(state.model.parameters(), before))
    assert moved[0.5] == pytest.approx(0.5 * moved[0.0], rel=0.05)
    assert step_damping(1, 8, resolve({"filter.damp_below": 0.25})) == 0.5
    assert step_damping(1, 8, resolve({"filter.damp_below": 0.25, "filter.zero_variance": False})) == 1.0
    assert step_damping(0, 8, resolve({})) == 0.0


def test_overlong_penalty_is_added_only_under_length_control_penalty():
    passes, lengths = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([3, 5, 6, 7])
    cfg = resolve({"length.control": "penalty", "length.penalty_max": 6, "length.penalty_cache": 2})
    assert shaped_rewards(passes, lengths, cfg).tolist() == [1.0, 0.5, -1.0, 0.0]
    assert torch.equal(shaped_rewards(passes, lengths, resolve({"length.control": "interrupt"})), passes)


# ---------------------------------------------------------------------------------------------
# What this engine refuses, before any work


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {"data.task": "math-jsonl", "data.train": "t.jsonl", "data.valid": "v.jsonl"},
            ConfigError,
            "math-jsonl' needs a Hugging Face model directory",
        ),
        ({"length.interrupt_min": 4, "length.interrupt_max": 6}, NotAvailableError, "interrupt.*not available yet"),
        ({"budget.steps": None, "budget.gpu_hours": 1.0}, ConfigError, "budget.gpu_hours"),
    ],
)
def test_unavailable_settings_fail_fast(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        train(resolve(overrides), tmp_path, MemorySink(), log=lambda _: None)


def test_auto_engine_means_torch_only_without_cuda(monkeypatch):
    cfg = resolve({})
    check_engine(cfg)
    assert not uses_vllm(cfg) and not uses_deepspeed(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # With CUDA, auto is vLLM (colocated with generator_ranks 0) where vllm imports: never refused.
    assert uses_vllm(cfg) == (importlib.util.find_spec("vllm") is not None)
    check_engine(resolve({"engine.generator": "torch", "engine.trainer": "torch"}))
