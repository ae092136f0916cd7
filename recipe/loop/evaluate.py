"""Evaluation: the held-out pass rate, mean@k over every held-out prompt, at the eval steps.

Sampled at temperature 1 with a random stream of its own, seeded by run seed and step, so eval
points do not depend on where a run was interrupted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from recipe.config import RecipeConfig
from recipe.loop.rollout import loss_mask, prompt_mask, sample_on_policy
from recipe.loop.state import _EVAL_STREAM, RunState, _device_generator, _seed
from recipe.model.sampler import decode
from recipe.tasks.task import Task
from recipe.telemetry.sinks import Sink

EVAL_CHUNK = 4096
"""Held-out sequences sampled in one batch: bounds the KV cache's memory."""


def is_eval_step(step: int, cfg: RecipeConfig) -> bool:
    """See `EvalConfig.evaluates` (the schedule lives in the torch-free config)."""
    return cfg.eval.evaluates(step)


def report_eval(state: RunState, sink: Sink, log: Callable[[str], None]) -> None:
    result = evaluate(state)
    compute = state.compute
    point = {
        "step": state.step,
        "pass_rate": result.pop("pass_rate"),
        "num_samples": result.pop("num_samples"),
        **asdict(compute),
        "metrics": result | {f"train_{k}": v for k, v in state.last_metrics.items()},
    }
    sink.eval_point(point)
    log(
        f"step {state.step:>6}  pass_rate {point['pass_rate']:.3f}  "
        f"train_reward {state.last_metrics.get('reward_mean', math.nan):.3f}  "
        f"flops {compute.flops:.3g}  device_s {compute.device_seconds:.1f}"
    )


def evaluate(state: RunState) -> dict[str, Any]:
    """Held-out mean@k pass rate, with mean length, truncation rate and entropy of the samples."""
    cfg, task = state.cfg, state.task
    k = cfg.eval.samples
    prompt_ids = state.valid_prompt_ids.repeat_interleave(k, dim=0)
    mask = prompt_mask(state.valid_prompt_mask, torch.arange(len(task.valid_prompts)), k)
    prompts = [p for p in task.valid_prompts for _ in range(k)]
    generator = torch.Generator().manual_seed(_seed(_EVAL_STREAM, cfg.seed, state.step))
    device = next(state.model.parameters()).device
    token_generator = _device_generator(device, _seed(_EVAL_STREAM, cfg.seed, state.step)) or generator
    passes, lengths, finished, interrupted, logps = [], [], [], [], []
    for start in range(0, len(prompts), EVAL_CHUNK):
        chunk = prompt_ids[start : start + EVAL_CHUNK]
        interrupt = None if state.interrupt is None else state.interrupt.draw(len(chunk), generator)
        chunk_mask = None if mask is None else mask[start : start + EVAL_CHUNK]
        out = sample_on_policy(state, chunk, chunk_mask, token_generator, interrupt)
        passes += task.score(prompts[start : start + EVAL_CHUNK], decode(state.tokenizer, out))
        lengths.append(out.lengths_B)
        finished.append(out.finished_B)
        interrupted.append(out.interrupted_B)
        logps.append(out.logp_BT[loss_mask(out)])
    return {
        "pass_rate": float(np.mean(passes)),
        "num_samples": len(passes),
        "mean_length": float(torch.cat(lengths).float().mean()),
        "truncation_rate": float((~torch.cat(finished)).float().mean()),
        "interrupted_fraction": float(torch.cat(interrupted).float().mean()),
        "entropy": float(-torch.cat(logps).mean()),
        **pass_rate_by_difficulty(task, prompts, passes),
        **held_out_ceiling(state),
    }


def held_out_ceiling(state: RunState) -> dict[str, float]:
    """`ceiling`: the highest pass rate any policy can show on the held-out set under this run's
    generation cap, where the task knows it (`sweep report` holds predictions to it). Not under
    `length.control=interrupt`, whose forced answers make it depend on the drawn budgets."""
    if state.task.ceiling is None or state.cfg.length.control == "interrupt":
        return {}
    return {"ceiling": float(state.task.ceiling(state.max_new_tokens))}


def pass_rate_by_difficulty(task: Task, prompts: list[str], passes: list[float]) -> dict[str, float]:
    """`pass_rate_<level>` for each difficulty level of a task that has them (sumk: `pass_rate_k5`)."""
    if task.difficulty is None:
        return {}
    by_level: dict[int, list[float]] = {}
    for prompt, passed in zip(prompts, passes):
        by_level.setdefault(task.difficulty(prompt), []).append(passed)
    prefix = "pass_rate_k" if task.name == "sumk" else "pass_rate_level"
    return {f"{prefix}{level}": float(np.mean(v)) for level, v in sorted(by_level.items())}
