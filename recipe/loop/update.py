"""The policy update: advantages, the zero-variance filter, and one optimizer step of the trainer engine."""

from __future__ import annotations

import torch

from recipe.config import RecipeConfig
from recipe.engines.base import TrainBatch
from recipe.loop.advantages import group_advantages, zero_variance_groups
from recipe.loop.rollout import loss_mask, prompt_mask
from recipe.loop.state import Rollout, RunState


def policy_update(state: RunState, rollout: Rollout) -> dict[str, float]:
    """Advantages, the zero-variance filter, and one optimizer step when any group is left."""
    zero_variance_P = zero_variance_groups(rollout.rewards_PG)
    keep_P = ~zero_variance_P if state.cfg.filter.zero_variance else torch.ones_like(zero_variance_P)
    kept = int(keep_P.sum())
    lr = lr_at(state.step, state.cfg) * step_damping(kept, keep_P.numel(), state.cfg)
    metrics = {
        "zero_variance_fraction": float(zero_variance_P.float().mean()),
        "num_trained_groups": kept,
        "lr": lr,
    }
    if kept:
        metrics |= gradient_step(state, rollout, keep_P, lr)
    return metrics


def step_damping(kept: int, groups: int, cfg: RecipeConfig) -> float:
    """The lr factor of a step that trains on `kept` of `groups` groups: kept / (damp_below x
    groups) when the zero-variance filter left fewer than `filter.damp_below` of them, else 1.

    Near the ceiling most groups are solved by every sample and filtered out; the loss is a mean
    over what is left, so a step on 2 groups moves the policy as far as one on 64, with the
    gradient noise of 2. Measured on sumk (docs/effects.md), such steps are what knocked runs off
    their plateau late; scaling them down keeps the step's expected movement in proportion to the
    signal it carries."""
    floor = cfg.filter.damp_below
    if not cfg.filter.zero_variance or floor <= 0 or kept >= floor * groups:
        return 1.0
    return kept / (floor * groups)


def gradient_step(state: RunState, rollout: Rollout, keep_P: torch.Tensor, lr: float) -> dict[str, float]:
    """One optimizer step of the trainer engine on the kept groups (loss, backward, clip, AdamW)."""
    batch = train_batch(rollout, keep_P, state.train_prompt_mask, state.cfg)
    metrics = state.trainer.step(batch, lr=lr)
    state.compute.flops += 6 * state.num_matmul_params * (batch.prompt_ids_BP.numel() + int(batch.mask_BT.sum()))
    return metrics


def train_batch(
    rollout: Rollout, keep_P: torch.Tensor, train_prompt_mask: torch.Tensor | None, cfg: RecipeConfig
) -> TrainBatch:
    """The kept groups with their advantages, as every trainer rank receives them."""
    group_size = cfg.batch.generations
    keep_B = keep_P.repeat_interleave(group_size)
    c = rollout.completions
    prompt_mask_BP = prompt_mask(train_prompt_mask, rollout.prompt_rows_P, group_size)
    return TrainBatch(
        prompt_ids_BP=rollout.prompt_ids_BP[keep_B],
        prompt_mask_BP=None if prompt_mask_BP is None else prompt_mask_BP[keep_B],
        tokens_BT=c.tokens_BT[keep_B],
        behaviour_logp_BT=c.logp_BT[keep_B],
        mask_BT=loss_mask(c)[keep_B],
        adv_B=group_advantages(rollout.rewards_PG[keep_P], cfg.advantage.norm).flatten(),
        group_size=group_size,
    )


def lr_at(step: int, cfg: RecipeConfig) -> float:
    """The lr of the step that follows `step`: linear warm-up over `optim.warmup_steps`, then constant."""
    warmup = cfg.optim.warmup_steps
    return cfg.optim.lr * min(1.0, (step + 1) / warmup) if warmup else cfg.optim.lr
