"""Generator-vs-trainer log-prob mismatch on the same weights, by precision: what
bench/bench_logprobs.py tabulates and tests/test_precision.py and tests/test_vllm_logprobs.py bound.

The generator samples (the torch engine's `recipe.model.sampler.sample`, or vLLM's
`recipe.engines.vllm_engine.VllmGenerator`); the trainer recomputes the same tokens' log-probs in
one full forward (`recipe.model.policy.completion_logprobs`). Both start from the same weights
(the built-in sort6 model, or the same architecture freshly initialised), cast per case (`CASES`).
"""

from __future__ import annotations

import copy
import functools
import tempfile

import torch

from recipe.engines.base import Sample
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, completion_logprobs, load_policy
from recipe.model.precision import upcast_lm_head
from recipe.model.sampler import Sampling, sample
from recipe.tasks.builtin import resolve_model_dir
from recipe.tasks.sort6 import sort6_prompt_sets

CASES = {
    "fp32": ((torch.float32, False), (torch.float32, False)),
    "bf16": ((torch.bfloat16, False), (torch.bfloat16, False)),
    "bf16+fp32head": ((torch.bfloat16, True), (torch.bfloat16, True)),
    "one side (trainer fp32 head only)": ((torch.bfloat16, False), (torch.bfloat16, True)),
}


def cast(model: torch.nn.Module, dtype: torch.dtype, fp32_head: bool) -> torch.nn.Module:
    out = copy.deepcopy(model).to(dtype)
    if fp32_head:
        upcast_lm_head(out)
    return out.eval()


def base_model(which: str) -> tuple[torch.nn.Module, object]:
    """`trained`: the built-in sort6 model (peaked: most tokens have log-prob near 0);
    `random`: the same architecture freshly initialised (near-uniform: every token's log-prob matters)."""
    model, tokenizer = load_policy(
        resolve_model_dir("builtin:sort6-tiny", log=lambda _: None), dtype="float32", lm_head_fp32=False
    )
    if which == "random":
        model = build_tiny_llama(TinyLlamaShape(), tokenizer, seed=0)
    return model, tokenizer


def mismatch(
    case: str, *, model: str = "trained", num_prompts: int = 256, num_samples: int = 8, seed: int = 0
) -> tuple[float, float]:
    """(max, mean) |generator log-prob - trainer log-prob| over every sampled token."""
    (gen_dtype, gen_head), (train_dtype, train_head) = CASES[case]
    base, tokenizer = base_model(model)
    generator_model, trainer_model = cast(base, gen_dtype, gen_head), cast(base, train_dtype, train_head)
    prompts, _ = sort6_prompt_sets(num_prompts, 1)
    ids_BP = tokenizer(prompts, return_tensors="pt").input_ids.repeat_interleave(num_samples, dim=0)
    out = sample(
        generator_model, ids_BP,
        Sampling(
            max_new_tokens=8,
            eos_id=tokenizer.eos_token_id,
            pad_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(seed),
        ),
    )  # fmt: skip
    with torch.no_grad():
        trainer_logp = completion_logprobs(trainer_model, ids_BP, out.tokens_BT)
    diff = (out.logp_BT - trainer_logp).abs()[out.mask_BT]
    return float(diff.max()), float(diff.mean())


def vllm_mismatch(
    case: str, *, model: str = "trained", num_prompts: int = 256, num_samples: int = 8, seed: int = 0
) -> tuple[float, float]:
    """(max, mean) |vLLM generator log-prob - transformers trainer log-prob| over every sampled token."""
    (gen_dtype, gen_head), (train_dtype, train_head) = CASES[case]
    base, tokenizer = base_model(model)
    trainer_model = cast(base, train_dtype, train_head)
    prompt_ids, groups = vllm_samples(model, gen_dtype, gen_head, num_prompts, num_samples, seed)
    diffs = []
    with torch.no_grad():
        for prompt, group in zip(prompt_ids, groups):
            for s in group:
                train_logp = completion_logprobs(trainer_model, torch.tensor([prompt]), torch.tensor([s.token_ids]))[0]
                diffs.append((torch.tensor(s.logprobs) - train_logp).abs())
    diff = torch.cat(diffs)
    return float(diff.max()), float(diff.mean())


@functools.lru_cache(maxsize=4)
def vllm_samples(
    model: str, dtype: torch.dtype, fp32_head: bool, num_prompts: int, num_samples: int, seed: int
) -> tuple[list[list[int]], list[list[Sample]]]:
    """Prompts and vLLM's samples at one precision: one engine start (seconds), shared by the cases that need it."""
    from recipe.engines.vllm_engine import VllmGenerator, VllmSettings

    base, tokenizer = base_model(model)
    prompt_ids = tokenizer(sort6_prompt_sets(num_prompts, 1)[0]).input_ids
    with tempfile.TemporaryDirectory() as model_dir:
        base.save_pretrained(model_dir)  # fp32; vLLM casts to `dtype` on load, as `cast` does
        tokenizer.save_pretrained(model_dir)
        settings = VllmSettings(
            model_dir=model_dir, dtype=str(dtype).removeprefix("torch."), lm_head_fp32=fp32_head, seed=seed
        )
        generator = VllmGenerator(settings)
        try:
            return prompt_ids, generator.generate(prompt_ids, num_samples=num_samples, max_new_tokens=8, seed=seed)
        finally:
            generator.close()
