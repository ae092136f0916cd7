"""The torch trainer: plain torch in one process, or data parallel over the trainers' process group.

Data parallel: every trainer rank holds the whole `TrainBatch`, trains on its share of whole
groups (`TrainBatch.shard`), and the gradients are summed over the trainers' group with one
all-reduce before clipping and the AdamW step, so every rank takes the same step and keeps the
same weights. The loss of a share is normalised by the whole batch's counts (`shard_loss`), so the
sum over ranks is the whole batch's loss and the summed gradient is its gradient, whatever the
split (tests/test_roles_dp.py checks it with real gloo processes). This is what DDP computes;
the sum is taken by hand rather than by DDP's backward hooks because a rank whose share is empty
(the zero-variance filter can leave fewer groups than ranks) still has to join the all-reduce,
with zeros, and DDP would wait for a backward that never comes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from recipe.config import LossConfig
from recipe.engines.base import TrainBatch
from recipe.loop import checkpoint
from recipe.loop.losses import batch_counts, group_token_counts, log_ratio, policy_loss
from recipe.model.policy import completion_logprobs


def shard_loss(
    model: torch.nn.Module,
    loss_cfg: LossConfig,
    batch: TrainBatch,
    rank: int,
    world_size: int,
    *,
    kernels: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor, TrainBatch] | None:
    """Rank `rank`'s part of the whole batch's loss, its trainer log-probs and its share; None
    when the share is empty. Summed over ranks, the parts are the whole batch's loss.
    kernels: `engine.kernels` (fast, compiled: a group's rows share one pass over their prompt)."""
    counts = batch_counts(batch.mask_BT, batch.group_size)  # whole-batch counts: the split cannot change them
    part = batch.shard(rank, world_size)
    if part.tokens_BT.shape[0] == 0:
        return None
    logp_BT = completion_logprobs(
        model,
        part.prompt_ids_BP,
        part.tokens_BT,
        part.prompt_mask_BP,
        shared_prefix=kernels != "reference",
        compiled=kernels == "compiled",
    )
    loss = policy_loss(
        loss_cfg,
        logp_BT,
        part.behaviour_logp_BT,
        part.adv_B,
        part.mask_BT,
        group_token_counts(part.mask_BT, part.group_size),
        counts,
    )
    return loss, logp_BT.detach(), part


def step_metrics(
    result: tuple[torch.Tensor, torch.Tensor, TrainBatch] | None,
    grad_norm: float,
    world_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, float]:
    """A step's metrics from this rank's `shard_loss` result: the whole batch's loss and ratio
    statistics, the same on every rank (collective over `group`, on `device`, when `world_size` > 1).
    Shared by every trainer engine."""
    if result is None:
        loss, ratio_sum, num_tokens, ratio_min, ratio_max = 0.0, 0.0, 0.0, math.inf, -math.inf
    else:
        loss_t, logp_BT, part = result
        ratio = log_ratio(logp_BT, part.behaviour_logp_BT, part.mask_BT)[part.mask_BT].exp()
        loss, ratio_sum, num_tokens = loss_t.item(), float(ratio.sum()), float(ratio.numel())
        ratio_min, ratio_max = float(ratio.min()), float(ratio.max())
    if world_size > 1:
        loss, ratio_sum, num_tokens = _all_reduce([loss, ratio_sum, num_tokens], dist.ReduceOp.SUM, device, group)
        (ratio_min,) = _all_reduce([ratio_min], dist.ReduceOp.MIN, device, group)
        (ratio_max,) = _all_reduce([ratio_max], dist.ReduceOp.MAX, device, group)
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "ratio_mean": ratio_sum / num_tokens if num_tokens else math.nan,
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
    }


def _all_reduce(
    values: list[float], op: dist.ReduceOp, device: torch.device, group: dist.ProcessGroup | None
) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


class TorchTrainer:
    """A `recipe.engines.base.Trainer` on plain torch (AdamW), single process or data parallel."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_cfg: LossConfig,
        *,
        max_grad_norm: float | None,
        group: dist.ProcessGroup | None = None,
        kernels: str = "reference",
    ) -> None:
        self.model, self.optimizer, self.loss_cfg = model, optimizer, loss_cfg
        self.kernels = kernels
        self.max_grad_norm = max_grad_norm or math.inf
        self.group = group
        distributed = group is not None or (dist.is_available() and dist.is_initialized())
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1

    # -- the step ----------------------------------------------------------------------------

    def step(self, batch: TrainBatch, *, lr: float) -> dict[str, float]:
        batch = batch_to(batch, next(self.model.parameters()).device)
        self.optimizer.zero_grad(set_to_none=True)
        result = shard_loss(self.model, self.loss_cfg, batch, self.rank, self.world_size, kernels=self.kernels)
        if result is not None:
            result[0].backward()
        if self.world_size > 1:
            self._sum_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return step_metrics(result, float(grad_norm), self.world_size, self.group, batch.tokens_BT.device)

    def _sum_gradients(self) -> None:
        """One all-reduce of every gradient, flattened (zeros for a rank that computed none)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    # -- weights and state -------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def eval_model(self) -> torch.nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def check_state(self, state: Mapping[str, Any]) -> None:
        checkpoint.check_fits(state, self.model, self.optimizer)

    def close(self) -> None:
        """Nothing to release: the process group (if any) belongs to the run's roles."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """`batch` on `device` (itself when it is there already)."""
    if batch.tokens_BT.device == device:
        return batch
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return TrainBatch(
        prompt_ids_BP=move(batch.prompt_ids_BP),
        prompt_mask_BP=move(batch.prompt_mask_BP),
        tokens_BT=move(batch.tokens_BT),
        behaviour_logp_BT=move(batch.behaviour_logp_BT),
        mask_BT=move(batch.mask_BT),
        adv_B=move(batch.adv_B),
        group_size=batch.group_size,
    )
