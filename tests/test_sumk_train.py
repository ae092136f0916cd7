"""sumk in the training loop: the built-in base, forced interruption at the drawn budget through
the real sampler in training and evaluation, forced tokens left out of the loss, and what this
engine refuses."""

import pytest
import torch

from recipe.config import ConfigError, NotAvailableError, resolve
from recipe.loop.checks import generation_cap, interrupt_rule
from recipe.loop.rollout import generate_batch, rollout_metrics
from recipe.loop.state import initial_state
from recipe.loop.train import train
from recipe.loop.update import train_batch
from recipe.tasks import builtin, sumk
from math_tiny import build_char_tokenizer
from recipe.tasks.task import MATH_INTERRUPT_PHRASE, Task, load_task
from recipe.telemetry.sinks import MemorySink

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.isa]

# A quick base (a few warm-up steps): enough for the mechanics, not for the task.
TEST_BASE = builtin.SumkWarmupRecipe(num_steps=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return builtin.builtin_model_dir("sumk-test", TEST_BASE, tmp_path_factory.mktemp("cache"), lambda _: None)


def sumk_recipe(model_dir, **overrides):
    flat = {
        "model.path": str(model_dir),
        "data.task": "sumk",
        "data.num_train_prompts": 200,
        "data.num_valid_prompts": 24,
        "batch.prompts": 4,
        "batch.generations": 4,
        "optim.lr": 1e-3,
        "optim.warmup_steps": 2,
        "eval.every": 2,
        "eval.samples": 2,
        "checkpoint.every": 100,
        "budget.steps": 2,
    }
    return resolve(flat | overrides)


def start(cfg):
    task = load_task(cfg.data)
    state = initial_state(cfg, task, generation_cap(cfg, task, lambda _: None), lambda _: None)
    state.interrupt = interrupt_rule(cfg, task, state.tokenizer, state.max_new_tokens, lambda _: None)
    return state


def test_the_built_in_base_is_a_sumk_llama_with_head_dim_64(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert (config.head_dim, config.num_attention_heads, config.hidden_size) == (64, 1, 64)
    assert config.vocab_size == len(sumk.VOCABULARY)
    assert builtin.BUILTINS["sumk-tiny"].cache_key() != builtin.BUILTINS["sort6-tiny"].cache_key()


def test_training_batches_are_interrupted_at_the_drawn_budget_and_forced_tokens_leave_the_loss(model_dir):
    cfg = sumk_recipe(model_dir, **{"length.interrupt_min": 3, "length.interrupt_max": 3})
    state = start(cfg)
    close_id = state.tokenizer.convert_tokens_to_ids(sumk.THINK_CLOSE)
    assert state.interrupt is not None and (state.interrupt.low, state.interrupt.high) == (3, 3)
    rollout = generate_batch(state)
    c = rollout.completions
    thought_B = torch.where(c.tokens_BT == close_id, torch.arange(c.tokens_BT.shape[1]), 99).min(dim=1).values
    ended_early_B = (c.tokens_BT[:, :3] == state.tokenizer.eos_token_id).any(dim=1)
    assert torch.equal(c.interrupted_B, (thought_B >= 3) & ~ended_early_B)
    assert c.interrupted_B.any()
    assert (c.forced_BT.nonzero()[:, 1] == 3).all()  # forced exactly after 3 thinking tokens
    assert (c.tokens_BT[c.forced_BT] == close_id).all()
    batch = train_batch(rollout, torch.ones(cfg.batch.prompts, dtype=torch.bool), None, cfg)
    assert torch.equal(batch.mask_BT, c.mask_BT & ~c.forced_BT)
    assert rollout_metrics(rollout)["interrupted_fraction"] == pytest.approx(float(c.interrupted_B.float().mean()))


def test_a_sumk_run_with_interrupts_reports_them(model_dir, tmp_path):
    cfg = sumk_recipe(model_dir, **{"length.interrupt_min": 2, "length.interrupt_max": 4})
    sink, logs = MemorySink(), []
    train(cfg, tmp_path, sink, log=logs.append)
    assert sorted(sink.eval_points) == [0, 1, 2]
    for point in sink.eval_points.values():
        assert 0 < point["metrics"]["interrupted_fraction"] <= 1 and point["num_samples"] == 48
        by_k = {k: v for k, v in point["metrics"].items() if k.startswith("pass_rate_k")}
        assert set(by_k) <= {f"pass_rate_k{k}" for k in range(2, 13)} and len(by_k) >= 5
        assert all(0 <= v <= 1 for v in by_k.values())
    assert any("thinking budgets drawn from 2-4 tokens" in line for line in logs)
    assert all("ceiling" not in p["metrics"] for p in sink.eval_points.values())  # the draw decides it


@pytest.mark.parametrize("budget", [9, 13, 16])
def test_a_sumk_run_reports_the_ceiling_of_its_held_out_set(model_dir, tmp_path, budget):
    """Each eval point's `ceiling`: the share of the run's own held-out problems that fit its
    generation cap, plus a guess's 1 in 100 on the rest (what `sweep report` holds predictions to)."""
    cfg = sumk_recipe(model_dir, **{"length.control": "none", "length.max_new_tokens": budget, "budget.steps": 1})
    sink = MemorySink()
    train(cfg, tmp_path, sink, log=lambda _: None)
    valid = load_task(cfg.data).valid_prompts
    fits = sum(sumk.tokens_needed(p) <= budget for p in valid) / len(valid)
    for point in sink.eval_points.values():
        assert point["metrics"]["ceiling"] == pytest.approx(fits + 0.01 * (1 - fits))
    assert (point["metrics"]["ceiling"] == 1.0) == (budget == 16)


def test_budgets_beyond_the_cap_interrupt_nothing(model_dir):
    cfg = sumk_recipe(model_dir)  # the default budgets (10240-12288) lie beyond the 16-token cap
    state = start(cfg)
    assert state.interrupt is None and state.max_new_tokens == 16
    assert rollout_metrics(generate_batch(state))["interrupted_fraction"] == 0.0


def test_interrupt_settings_this_engine_refuses(model_dir, tmp_path):
    from recipe.config import flatten

    cfg = sumk_recipe(model_dir, **{"length.interrupt_min": 3, "length.interrupt_max": 5})
    on_generator_ranks = resolve(flatten(cfg.to_dict()) | {"engine.generator_ranks": 1})  # taken since issue 19
    task = load_task(cfg.data)
    cap = min(task.max_new_tokens, cfg.length.max_new_tokens)
    assert generation_cap(on_generator_ranks, task, lambda _: None) == cap
    with pytest.raises(NotAvailableError, match="not available yet for sort6, which has no thinking phase"):
        sort6 = resolve({"length.interrupt_min": 4, "length.interrupt_max": 6})
        train(sort6, tmp_path, MemorySink(), log=lambda _: None)


def test_the_math_phrase_ends_in_one_think_close_token_and_needs_room():
    tokenizer = build_char_tokenizer()
    task = Task("math-jsonl", [], [], lambda p, c: 0.0, 1 << 30, chat=True, think_close="</think>",
                interrupt_phrase=MATH_INTERRUPT_PHRASE)  # fmt: skip
    cfg = resolve({"length.max_new_tokens": 512, "length.interrupt_min": 300, "length.interrupt_max": 400})
    rule = interrupt_rule(cfg, task, tokenizer, 512, lambda _: None)
    close_id = tokenizer.convert_tokens_to_ids("</think>")
    assert rule.phrase_ids[-1] == close_id and rule.phrase_ids.count(close_id) == 1
    assert len(rule.phrase_ids) == len(MATH_INTERRUPT_PHRASE) - len("</think>") + 1  # one token per character
    tight = resolve({"length.max_new_tokens": 450, "length.interrupt_min": 300, "length.interrupt_max": 400})
    with pytest.raises(ConfigError, match="length.interrupt_max: 400: an interrupt at that thinking budget leaves no"):
        interrupt_rule(tight, task, tokenizer, 450, lambda _: None)
