"""Policy-gradient losses (CISPO, DAPO, GRPO, GSPO) and their aggregation over tokens.

Every loss is built in two pure steps:

1. a per-token loss `loss_BT` from the trainer's log-probs `logp_BT` (with gradient), the
   behaviour (generator's) log-probs, the per-sequence advantages `adv_B` and the mask;
2. `aggregate`, a weighted sum of the masked per-token losses in which every weight comes from
   counts over the WHOLE batch (`BatchCounts`, and each sequence's group token count). A batch cut
   into micro-batches therefore gives partial losses (and gradients) that add up exactly to the
   full batch's, whatever the cut, as long as no sequence is split.

The importance ratio is `exp(logp_trainer - logp_behaviour)`, token by token; positions outside
the mask get ratio 1 so that nothing there can overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from recipe.config import LossConfig

Aggregation = Literal["prompt", "sample", "token"]


@dataclass(frozen=True)
class BatchCounts:
    """Denominators of the loss, counted over the whole batch that enters the loss."""

    num_tokens: int
    num_sequences: int
    num_groups: int


# ---------------------------------------------------------------------------------------------
# Per-token losses


def log_ratio(logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log(pi_trainer / pi_behaviour) per token; 0 outside the mask."""
    return torch.where(mask_BT, logp_BT - behaviour_logp_BT, torch.zeros_like(logp_BT))


def cispo_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    eps_max: float,
) -> torch.Tensor:
    """CISPO: -sg(min(ratio, eps_max)) * A * logp.

    The capped ratio is a constant weight (stop-gradient), so every token keeps a gradient
    -min(ratio, eps_max) * A * grad(logp): unlike PPO clipping, no token is silenced.
    """
    weight_BT = log_ratio(logp_BT, behaviour_logp_BT, mask_BT).exp().clamp(max=eps_max).detach()
    return -weight_BT * adv_B[:, None] * logp_BT


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """PPO's pessimistic clipped surrogate: -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A).

    Where the clipped branch is the minimum (ratio above 1 + high with A > 0, or below 1 - low with
    A < 0) the loss is constant in the parameters and the token has no gradient.
    """
    ratio_BT = log_ratio(logp_BT, behaviour_logp_BT, mask_BT).exp()
    adv_B1 = adv_B[:, None]
    return -torch.minimum(ratio_BT * adv_B1, ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_B1)


def dapo_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """DAPO: the PPO clip with a wider upper range (clip-higher), 1 - clip_low .. 1 + clip_high."""
    return ppo_clip_loss(logp_BT, behaviour_logp_BT, adv_B, mask_BT, clip_low, clip_high)


def grpo_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip: float,
) -> torch.Tensor:
    """GRPO (without its KL term, as in ScaleRL): the symmetric PPO clip, 1 - clip .. 1 + clip."""
    return ppo_clip_loss(logp_BT, behaviour_logp_BT, adv_B, mask_BT, clip, clip)


def gspo_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """GSPO: the PPO clip applied to the sequence ratio s = exp(mean_t log ratio_t).

    s is the geometric mean of the token ratios. The sequence's loss is written on each of its
    tokens, so that "sample" aggregation gives exactly GSPO's per-sequence mean.
    """
    lengths_B = mask_BT.sum(dim=1).clamp(min=1)
    seq_ratio_B = (log_ratio(logp_BT, behaviour_logp_BT, mask_BT).sum(dim=1) / lengths_B).exp()
    seq_loss_B = -torch.minimum(seq_ratio_B * adv_B, seq_ratio_B.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_B)
    return seq_loss_B[:, None].expand_as(logp_BT)


def token_losses(
    cfg: LossConfig,
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
) -> torch.Tensor:
    """The per-token loss of `loss.type`, with its clip settings from `cfg`."""
    args = (logp_BT, behaviour_logp_BT, adv_B, mask_BT)
    if cfg.type == "cispo":
        return cispo_loss(*args, eps_max=cfg.eps_max)
    if cfg.type == "dapo":
        return dapo_loss(*args, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    if cfg.type == "grpo":
        return grpo_loss(*args, clip=cfg.clip_low)
    if cfg.type == "gspo":
        return gspo_loss(*args, clip_low=cfg.gspo_clip_low, clip_high=cfg.gspo_clip_high)
    raise ValueError(f"loss.type: invalid value {cfg.type!r}; allowed: 'cispo', 'dapo', 'grpo', 'gspo'")


# ---------------------------------------------------------------------------------------------
# Aggregation


def group_token_counts(mask_BT: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] the token count of each sequence's group; sequences are stored group after group."""
    lengths_PG = mask_BT.sum(dim=1).view(-1, group_size)
    return lengths_PG.sum(dim=1).repeat_interleave(group_size)


def batch_counts(mask_BT: torch.Tensor, group_size: int) -> BatchCounts:
    """The denominators for a whole batch stored group after group."""
    num_sequences = mask_BT.shape[0]
    return BatchCounts(
        num_tokens=int(mask_BT.sum()), num_sequences=num_sequences, num_groups=num_sequences // group_size
    )


def sequence_weights(
    aggregation: Aggregation,
    mask_BT: torch.Tensor,
    group_tokens_B: torch.Tensor,
    counts: BatchCounts,
) -> torch.Tensor:
    """[B] the weight of each of a sequence's token losses in the batch loss.

    prompt: 1 / (group's tokens * number of groups); sample: 1 / (sequence's tokens * number of
    sequences); token: 1 / number of tokens.
    """
    if aggregation == "prompt":
        return 1.0 / (group_tokens_B.to(torch.float32) * counts.num_groups)
    if aggregation == "sample":
        return 1.0 / (mask_BT.sum(dim=1).to(torch.float32) * counts.num_sequences)
    if aggregation == "token":
        return torch.full((mask_BT.shape[0],), 1.0 / counts.num_tokens)
    raise ValueError(f"loss.aggregation: invalid value {aggregation!r}; allowed: 'prompt', 'sample', 'token'")


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    aggregation: Aggregation,
    group_tokens_B: torch.Tensor,
    counts: BatchCounts,
) -> torch.Tensor:
    """The scalar loss: masked token losses, summed with `sequence_weights`."""
    per_sequence_B = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT)).sum(dim=1)
    return (per_sequence_B * sequence_weights(aggregation, mask_BT, group_tokens_B, counts)).sum()


def policy_loss(
    cfg: LossConfig,
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    group_tokens_B: torch.Tensor,
    counts: BatchCounts,
) -> torch.Tensor:
    """`loss.type` aggregated by `loss.aggregation`: the scalar the trainer differentiates."""
    loss_BT = token_losses(cfg, logp_BT, behaviour_logp_BT, adv_B, mask_BT)
    return aggregate(loss_BT, mask_BT, cfg.aggregation, group_tokens_B, counts)
