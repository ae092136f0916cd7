"""Group-relative advantages and the zero-variance filter.

Rewards arrive as `rewards_PG`: P prompts (groups) by G generations. Pure functions, tensors in and
tensors out, so they are checked against closed forms in tests/test_advantages.py.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvantageNorm = Literal["batch", "prompt", "none"]

STD_EPS = 1e-6
"""Keeps a division by a zero std finite (a zero-variance group has all-zero advantages)."""


def group_advantages(rewards_PG: torch.Tensor, norm: AdvantageNorm, eps: float = STD_EPS) -> torch.Tensor:
    """A_i = r_i - mean of its group, then scaled by 1 / (std + eps).

    norm="batch": the std of all advantages in the batch (ScaleRL); "prompt": the std of the
    group's own rewards (GRPO); "none": no scaling. Stds are population stds (no Bessel
    correction), so a group of two rewards {0, 1} has std 0.5.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be [prompts, generations], got shape {tuple(rewards_PG.shape)}")
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if norm == "none":
        return centred_PG
    if norm == "batch":
        return centred_PG / (centred_PG.std(correction=0) + eps)
    if norm == "prompt":
        return centred_PG / (rewards_PG.std(dim=1, correction=0, keepdim=True) + eps)
    raise ValueError(f"advantage.norm: invalid value {norm!r}; allowed: 'batch', 'prompt', 'none'")


def zero_variance_groups(rewards_PG: torch.Tensor) -> torch.Tensor:
    """[P] bool: True where every generation of the prompt got the same reward.

    Such a group has zero advantage everywhere: it adds nothing to the gradient, only to the
    loss's denominators, which is why `filter.zero_variance` drops it.
    """
    return (rewards_PG == rewards_PG[:, :1]).all(dim=1)


def overlong_penalty(lengths_B: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO's soft overlong penalty, added to the reward: clip((L_max - |y|) / L_cache - 1, -1, 0).

    0 up to L_max - L_cache tokens, then falling linearly to -1 at L_max, and -1 beyond.
    """
    if cache_length < 1:
        raise ValueError(f"length.penalty_cache: invalid value {cache_length!r}; must be >= 1")
    excess = (max_length - lengths_B.to(torch.float32)) / cache_length - 1.0
    return excess.clamp(min=-1.0, max=0.0)
