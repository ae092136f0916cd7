"""Built-in base models, made locally by a short supervised warm-up and cached on disk.

`model.path = "builtin:sort6-tiny"` names a tiny Llama (84,032 parameters) after 250 steps of
label-smoothed supervised sort6 answers (about 7 s on one core). The label smoothing (0.4) is the
point: the base knows far more than it samples, as a reasoning SFT leaves the paper's models with
pass@k far above pass@1. Measured on the first 1,024 held-out prompts: 98.9 % greedy but 4.7 %
sampled at temperature 1, with over half the samples running past the answer without EOS. RL
then climbs from a few percent to about 90 % by sharpening and partly re-learning. (Without label
smoothing, a base stopped early enough to sample at a few percent also knows little: greedy 15 %;
RL from it at the same settings reached only about 30 % in 1,500 steps.)

The build is deterministic (fixed seeds, one thread) and runs once per machine: the result lives in
`$SWEEP_CACHE/models/sort6-tiny-<key>/` (default cache `~/.cache/scalesweep`), where the key hashes
every parameter of the build and the torch and transformers versions. Runs that start together take
a file lock; the first builds into a temporary directory and renames it into place, the others
wait and then load it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from filelock import FileLock
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from recipe.config import ConfigError, cache_root
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer
from recipe.model.sampler import Sampling, decode, sample
from recipe.tasks import sort6, sumk, task as tasks

BUILTIN_PREFIX = "builtin:"
BUILDER_VERSION = 1
"""Part of the cache key: bump it when the build changes in a way its parameters do not show."""
NUM_PROBE_PROMPTS = 256
"""Held-out prompts on which the finished base's pass rates are measured and recorded."""


@dataclass(frozen=True)
class WarmupRecipe:
    """Everything that determines a built-in base model."""

    shape: TinyLlamaShape = field(default_factory=TinyLlamaShape)
    seed: int = 1234
    num_steps: int = 250
    batch_size: int = 64
    lr: float = 3e-4
    label_smoothing: float = 0.4
    """Keeps the base's entropy high: it knows the answer (greedy) far more often than it samples it."""

    def cache_key(self) -> str:
        blob = json.dumps(
            {
                "recipe": dataclasses.asdict(self),
                "builder": BUILDER_VERSION,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SumkWarmupRecipe(WarmupRecipe):
    """The base of the sumk family (`builtin:sumk-tiny`): worked completions of every k in
    `sumk.MIN_DIGITS`..`MAX_DIGITS`, label-smoothed like sort6's (see `build_base`)."""

    task: str = "sumk"
    format_version: int = 2
    """Bump when sumk's prompt or completion format changes (the cache key then changes with it)."""
    shape: TinyLlamaShape = field(default_factory=lambda: TinyLlamaShape(max_positions=32))
    num_steps: int = 800
    lr: float = 1.5e-3
    label_smoothing: float = 0.1


SUMK_SMALL_SHAPE = TinyLlamaShape(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, max_positions=32)
"""`builtin:sumk-small`: the model-size knob on sumk (about 3x the parameters of sumk-tiny: 2 heads of 64)."""

BUILTINS: dict[str, WarmupRecipe] = {
    "sort6-tiny": WarmupRecipe(),
    "sumk-tiny": SumkWarmupRecipe(),
    "sumk-small": SumkWarmupRecipe(shape=SUMK_SMALL_SHAPE),
}


def resolve_model_dir(path: str, log: Callable[[str], None] = print) -> Path:
    """The directory `model.path` names: a built-in model (built on first use) or a given directory."""
    if path.startswith(BUILTIN_PREFIX):
        name = path.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTINS:
            allowed = ", ".join(BUILTIN_PREFIX + n for n in BUILTINS)
            raise ConfigError("model.path", f"unknown built-in model {path!r}; built-in models: {allowed}")
        return builtin_model_dir(name, BUILTINS[name], cache_root(), log)
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError("model.path", f"{path!r} is not a Hugging Face model directory (no config.json)")
    return directory


def builtin_model_dir(name: str, recipe: WarmupRecipe, root: Path, log: Callable[[str], None]) -> Path:
    """Build the model once under `root`, safely when several processes ask at once."""
    models_dir = root / "models"
    final = models_dir / f"{name}-{recipe.cache_key()}"
    if final.is_dir():
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(models_dir / f"{final.name}.lock"):
        if final.is_dir():
            return final
        log(f"building base model {BUILTIN_PREFIX}{name} (once; cached in {final})")
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=models_dir))
        try:
            build_base(recipe, staging, log)
            _make_readable(staging)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _make_readable(directory: Path) -> None:
    """mkdtemp and the safetensors writer make private files; a cache may be shared by a group."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


# ---------------------------------------------------------------------------------------------
# The build


def build_base(recipe: WarmupRecipe, out_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Supervised warm-up of a fresh tiny Llama on its task's answers (sort6's, or sumk's worked
    completions); save model, tokenizer and report."""
    on_sumk = isinstance(recipe, SumkWarmupRecipe)
    words = sumk if on_sumk else sort6
    warm_up, probe = (sumk_supervised_warmup, sumk_probe) if on_sumk else (supervised_warmup, probe_pass_rates)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums are ordered differently with more threads
    try:
        tokenizer = build_tokenizer(words.VOCABULARY, eos=words.EOS, pad=words.PAD)
        model = build_tiny_llama(recipe.shape, tokenizer, recipe.seed)
        warm_up(model, tokenizer, recipe)
        report = probe(model, tokenizer, seed=recipe.seed)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    num_params = sum(p.numel() for p in model.parameters())
    report = {"num_params": num_params, **report, "recipe": dataclasses.asdict(recipe)}
    (out_dir / "warmup.json").write_text(json.dumps(report, indent=2) + "\n")
    log(
        f"base model: {num_params} parameters, held-out pass greedy {report['greedy_pass_rate']:.3f}, "
        f"sampled {report['sampled_pass_rate']:.3f}"
    )
    return report


def supervised_warmup(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, recipe: WarmupRecipe) -> None:
    """Label-smoothed cross-entropy on the answer tokens of warm-up prompts, `recipe.num_steps` AdamW steps."""
    prompts = sort6.sort6_warmup_prompts()
    prompt_ids = tokenizer(prompts, return_tensors="pt").input_ids
    answer_ids = tokenizer([sort6.expected_completion(p) for p in prompts], return_tensors="pt").input_ids
    rng = np.random.default_rng(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    for _ in range(recipe.num_steps):
        rows = torch.from_numpy(rng.choice(len(prompts), size=recipe.batch_size, replace=False))
        targets_BT = answer_ids[rows]
        input_ids = torch.cat([prompt_ids[rows], targets_BT[:, :-1]], dim=1)
        logits_BTV = model(input_ids=input_ids, logits_to_keep=targets_BT.shape[1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits_BTV.flatten(0, 1), targets_BT.flatten(), label_smoothing=recipe.label_smoothing
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def probe_pass_rates(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, seed: int) -> dict[str, float]:
    """Greedy and sampled (temperature 1) pass rates on the first held-out prompts."""
    _, prompts = sort6.sort6_prompt_sets(1, NUM_PROBE_PROMPTS)
    prompt_ids = tokenizer(prompts, return_tensors="pt").input_ids
    rates = {}
    for mode in ("greedy", "sampled"):
        out = sample(
            model, prompt_ids,
            Sampling(
                max_new_tokens=sort6.SORT6_MAX_NEW_TOKENS,
                eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id,
                generator=torch.Generator().manual_seed(seed),
                greedy=mode == "greedy",
            ),
        )
        rewards = [sort6.reward(p, c) for p, c in zip(prompts, decode(tokenizer, out))]
        rates[f"{mode}_pass_rate"] = float(np.mean(rewards))
    return rates


# ---------------------------------------------------------------------------------------------
# sumk


NUM_SUMK_WARMUP_PROMPTS = 20_000


def sumk_supervised_warmup(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, recipe: WarmupRecipe) -> None:
    """Label-smoothed cross-entropy on the completion tokens (scratchpad, `</think>`, answer, EOS).

    Sequences of different lengths are right-padded (causal attention: padding after a sequence
    changes nothing before it), so positions count from each sequence's first token, as they do
    for the left-padded prompts of RL (`recipe.model.sampler.padding_inputs`).
    """
    prompts = sumk.warmup_prompts(NUM_SUMK_WARMUP_PROMPTS, recipe.seed)
    rows = [
        (tokenizer(p, add_special_tokens=False).input_ids, tokenizer(sumk.worked_completion(p)).input_ids)
        for p in prompts
    ]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    is_target = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        is_target[i, len(p) : len(p) + len(c)] = True
    rng = np.random.default_rng(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    model.train()
    for _ in range(recipe.num_steps):
        batch = torch.from_numpy(rng.choice(len(rows), size=recipe.batch_size, replace=False))
        used = int(is_target[batch].any(dim=0).nonzero().max()) + 1
        seq_BT, target_BT = ids[batch, :used], is_target[batch, :used]
        logits_BTV = model(input_ids=seq_BT[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits_BTV[target_BT[:, 1:]], seq_BT[:, 1:][target_BT[:, 1:]], label_smoothing=recipe.label_smoothing
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def sumk_probe(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, seed: int) -> dict[str, Any]:
    """Greedy and sampled (temperature 1) pass rates on held-out prompts of the default mixture,
    overall and per k, with room for every worked completion."""
    _, prompts = sumk.prompt_sets(1, NUM_PROBE_PROMPTS * 4)
    task = tasks.Task("sumk", [], prompts, sumk.reward, 0)
    prompt_ids, prompt_mask = task.encode(tokenizer, prompts)
    ks = np.array([len(sumk.prompt_digits(p)) for p in prompts])
    report: dict[str, Any] = {}
    for mode in ("greedy", "sampled"):
        out = sample(
            model, prompt_ids,
            Sampling(
                max_new_tokens=sumk.thinking_tokens(sumk.DEFAULT_MAX_DIGITS) + 1 + sumk.ANSWER_TOKENS,
                eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id,
                generator=torch.Generator().manual_seed(seed),
                greedy=mode == "greedy",
                prompt_mask_BP=prompt_mask,
            ),
        )
        rewards = np.array([sumk.reward(p, c) for p, c in zip(prompts, decode(tokenizer, out))])
        report[f"{mode}_pass_rate"] = float(rewards.mean())
        report[f"{mode}_pass_rate_by_k"] = {int(k): float(rewards[ks == k].mean()) for k in np.unique(ks)}
    return report
