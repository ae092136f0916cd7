"""The DeepSpeed trainer: ZeRO stage 0, 1 or 2 over the trainers' process group (`engine.zero_stage`).

The same step as `TorchTrainer`: every trainer rank holds the whole `TrainBatch` and computes the
loss of its share with the same code (`torch_trainer.shard_loss`: normalised by whole-batch
counts, so the parts sum to the whole batch's loss). DeepSpeed reduces the gradients with
`"gradient_allreduce_op": "sum"` (its default averages over the ranks, which would divide the
whole batch's gradient by the number of ranks), clips them to `optim.max_grad_norm` and takes the
optimizer step. The optimizer is the run's own torch AdamW (`recipe.loop.state.build_optimizer`),
handed to DeepSpeed as a client optimizer, so no DeepSpeed optimizer op is built (what
`"torch_adam": true` would ask of a DeepSpeed-built Adam) and the update is torch's AdamW. ZeRO 1
shards that optimizer's state over the ranks, ZeRO 2 the gradients too; the weights stay whole on
every rank, which is what trainer rank 0 samples and evaluates with and pushes. ZeRO 3 (sharded
weights) is refused: rank 0 alone samples and pushes, and gathering stage-3 weights is collective.

Precision: the model keeps the dtypes the recipe gave it (`model.dtype`, the FP32 LM head of
`recipe.model.precision`); DeepSpeed's "bf16" mode stays off, since it would cast the whole module.
Stage 0 steps the weights as they are, exactly as `TorchTrainer`. ZeRO 1/2 flatten each parameter
group into one buffer, so the optimizer's groups are split by dtype first, and step fp32 master
shards of them: bf16 weights are the rounded masters.

A rank whose share is empty (the zero-variance filter left fewer groups than ranks) still joins
the gradient reduction: it back-propagates the loss of one row times zero.

Process group: the trainers' default group when the job has one (`recipe.pipeline`); a one-task run
has none, and the trainer makes a one-rank group itself (gloo on CPU, NCCL on CUDA, on an
in-process `HashStore`, so no port is taken) and destroys it in `close()` (`train()` calls it) or at exit.

CPU: DeepSpeed's torch backend builds its "shm" comm op (a C++ extension JIT-compiled with ninja,
~70 s on this machine, cached under ~/.cache/torch_extensions) the first time a process
initialises it. That op serves only `inference_all_reduce` (tensor-parallel inference), never
training, and no environment variable or config key turns it off; the trainer marks it
incompatible (`deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False`, the table
DeepSpeed consults before building it) before DeepSpeed creates its backend, so CPU runs start in
about a second.

Checkpoints: `state_dict()` is collective (every trainer rank calls it, `recipe.pipeline.lead.LeadTrainer`)
and returns, on every rank, the checkpoint format of `TorchTrainer`: the model's state dict and a
torch AdamW state dict whose per-parameter `exp_avg`/`exp_avg_sq` are gathered from the ZeRO
shards (`deepspeed.utils.safe_get_full_optimizer_state`), in the run's own parameter groups. Under
ZeRO each parameter that is not fp32 also carries `master`, its fp32 master weight
(`safe_get_full_fp32_param`), so a resumed run continues from the same masters. `load_state_dict`
(every rank, with the whole state) writes back each rank's shards; so a checkpoint of either
engine resumes on the other (a torch checkpoint of a bf16 model has no masters: they start from
the bf16 weights).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probing (and its warning) on CPU
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
from deepspeed.utils import groups as ds_groups  # noqa: E402
from deepspeed.utils import (  # noqa: E402
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

from recipe.config import LossConfig  # noqa: E402
from recipe.engines.base import TrainBatch  # noqa: E402
from recipe.engines.torch_trainer import batch_to, shard_loss, step_metrics  # noqa: E402
from recipe.loop import checkpoint  # noqa: E402
from recipe.model.policy import completion_logprobs  # noqa: E402

ZERO_STAGES = (0, 1, 2)
"""The ZeRO stages this trainer runs (3 shards the weights, which rank 0 needs whole)."""
MASTER_KEY = "master"
"""Per-parameter optimizer state slot holding the fp32 master weight of a non-fp32 model."""

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-building its CPU "shm" comm op (inference only; see the module docstring)."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(zero_stage: int, max_grad_norm: float | None) -> dict[str, Any]:
    """The engine's config: one micro-batch per step, summed gradients, clipping by DeepSpeed in
    ZeRO stages (stage 0's clipping reports no norm: there the trainer clips). DeepSpeed's "bf16"
    mode stays off: it would cast the whole module to bf16, the FP32 LM head included; the model
    keeps the dtypes the recipe gave it, and ZeRO keeps fp32 master shards whatever they are."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_allreduce_op": "sum",
        "gradient_clipping": 0.0 if zero_stage == 0 or not max_grad_norm else float(max_grad_norm),
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class DeepspeedTrainer:
    """A `recipe.engines.base.Trainer` on a DeepSpeed engine (ZeRO stage 0-2)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_cfg: LossConfig,
        *,
        max_grad_norm: float | None,
        zero_stage: int,
    ) -> None:
        if zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"engine.zero_stage={zero_stage}: the DeepSpeed trainer runs ZeRO stages {list(ZERO_STAGES)}"
            )
        self.loss_cfg, self.zero_stage = loss_cfg, zero_stage
        self.max_grad_norm = max_grad_norm or math.inf
        self._owned_group, self._set_env = self._ensure_group(), []
        if "LOCAL_RANK" not in os.environ:  # DeepSpeed's argument check wants it; a one-task run has none
            os.environ["LOCAL_RANK"] = "0"
            self._set_env.append("LOCAL_RANK")
        if not torch.cuda.is_available():
            skip_shm_comm_build()
        _forget_stale_world_group()
        # The optimizer as the run built it, before DeepSpeed regroups its parameters into flat shards.
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._groups_template = optimizer.state_dict()["param_groups"]
        self._view = types.SimpleNamespace(
            param_groups=[{"params": [self.params[i] for i in g["params"]]} for g in self._groups_template]
        )
        self.sharded = zero_stage > 0
        """ZeRO 1/2: the optimizer steps fp32 master shards; checkpoints gather and scatter them."""
        self._origin = _split_groups_by_dtype(optimizer) if self.sharded else list(range(len(self._groups_template)))
        """The group of the run's optimizer each of the optimizer's groups now comes from."""
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(zero_stage, max_grad_norm), dist_init_required=False
        )
        self.model = self.engine.module
        self.optimizer = optimizer  # the torch AdamW itself: in ZeRO stages it steps the flat fp32 shards
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = next(self.model.parameters()).device

    @staticmethod
    def _ensure_group() -> bool:
        """Make a one-rank default group when there is none; True when this trainer made it."""
        if dist.is_initialized():
            return False
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy_if_initialized)
        return True

    def close(self) -> None:
        """Leave the one-rank group this trainer made (none when the job's roles made the group)."""
        if self._owned_group:
            _destroy_if_initialized()
            self._owned_group = False
        for key in self._set_env:
            os.environ.pop(key, None)
        self._set_env = []

    # -- the step ----------------------------------------------------------------------------

    def step(self, batch: TrainBatch, *, lr: float) -> dict[str, float]:
        batch = batch_to(batch, self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        result = shard_loss(self.model, self.loss_cfg, batch, self.rank, self.world_size)
        self.engine.backward(result[0] if result is not None else self._zero_loss(batch))
        if not self.sharded:  # stage 0: the gradients are whole here, summed over the ranks
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        self.engine.step()
        if self.sharded:
            grad_norm = float(self.engine.get_global_grad_norm())
        return step_metrics(result, grad_norm, self.world_size, None, self.device)

    def _zero_loss(self, batch: TrainBatch) -> torch.Tensor:
        """A loss with zero gradient through every parameter: an empty share's part in the reduction."""
        mask = None if batch.prompt_mask_BP is None else batch.prompt_mask_BP[:1]
        logp_BT = completion_logprobs(self.model, batch.prompt_ids_BP[:1], batch.tokens_BT[:1], mask)
        return logp_BT.sum() * 0.0

    # -- weights and state -------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def eval_model(self) -> torch.nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """Collective over the trainer ranks: the whole model and optimizer state, on every rank."""
        return {"model": self.model.state_dict(), "optimizer": self._optimizer_state()}

    def _optimizer_state(self) -> dict[str, Any]:
        if not self.sharded:
            return self.optimizer.state_dict()
        live = {j: g for j, g in reversed(list(zip(self._origin, self.optimizer.param_groups)))}
        hyper = [{k: v for k, v in live[j].items() if k != "params"} for j in range(len(self._groups_template))]
        param_groups = [g | h for g, h in zip(self._groups_template, hyper)]
        if not self.optimizer.state:  # no step taken yet
            return {"state": {}, "param_groups": param_groups}
        self._link_fragments()
        shard_state = next(iter(self.optimizer.state.values()))
        tensor_keys = [k for k, v in shard_state.items() if _is_per_element(v)]
        state: dict[int, dict[str, Any]] = {}
        for i, param in enumerate(self.params):
            slots = {k: _clone(v) for k, v in shard_state.items() if k not in tensor_keys}  # step
            for key in tensor_keys:
                slots[key] = safe_get_full_optimizer_state(param, key).cpu()
            if param.dtype != torch.float32:  # the same on every rank: the gather is collective
                slots[MASTER_KEY] = safe_get_full_fp32_param(param).cpu()
            state[i] = slots
        return {"state": state, "param_groups": param_groups}

    def check_state(self, state: Mapping[str, Any]) -> None:
        checkpoint.check_fits(state, self.model, self._view)  # the parameters as the run's optimizer held them

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Every trainer rank, with the whole state (`check_state` passed): each keeps its own shards."""
        self.model.load_state_dict(state["model"])
        saved = state["optimizer"]
        if not self.sharded:
            self.optimizer.load_state_dict(saved)
            return
        slots = {int(i): s for i, s in saved["state"].items()}
        for i, param in enumerate(self.params):
            master = slots.get(i, {}).get(MASTER_KEY)
            safe_set_full_fp32_param(param, (param.detach() if master is None else master).float())
        for group, j in zip(self.optimizer.param_groups, self._origin):
            group.update({k: v for k, v in saved["param_groups"][j].items() if k != "params"})
        self.optimizer.state.clear()
        if not slots:
            return
        first = {k: v for k, v in next(iter(slots.values())).items() if k != MASTER_KEY}
        tensor_keys = [k for k, v in first.items() if _is_per_element(v)]
        for group in self.optimizer.param_groups:  # the optimizer's state as its first step would make it
            for shard in group["params"]:
                scalars = {k: _clone(v) for k, v in first.items() if k not in tensor_keys}
                self.optimizer.state[shard] = scalars | {k: torch.zeros_like(shard) for k in tensor_keys}
        self._link_fragments()
        for i, param in enumerate(self.params):
            for key in tensor_keys:
                safe_set_full_optimizer_state(param, slots[i][key].to(self.device, torch.float32), key)


    def _link_fragments(self) -> None:
        """Point each parameter's fragment of the optimizer state at the state of the shard holding it.

        DeepSpeed links them once, after the first group's first step, so with several groups
        (one per dtype) the later groups' fragments stay empty; linked here before any use."""
        for param in self.params:
            mapping = param._hp_mapping
            if mapping is not None:
                shard = self.optimizer.param_groups[mapping.param_group_index]["params"][0]
                mapping.set_optim_state_fragment(shard, self.optimizer.state[shard])


def _split_groups_by_dtype(optimizer: torch.optim.Optimizer) -> list[int]:
    """One group per dtype in each of `optimizer`'s groups (ZeRO flattens a group into one buffer,
    so a bf16 body and an FP32 head cannot share one); returns each new group's original group."""
    groups, origin = list(optimizer.param_groups), []
    optimizer.param_groups.clear()
    for j, group in enumerate(groups):
        for dtype in sorted({p.dtype for p in group["params"]}, key=str):
            optimizer.add_param_group(group | {"params": [p for p in group["params"] if p.dtype == dtype]})
            origin.append(j)
    return origin


def _is_per_element(value: Any) -> bool:
    """An optimizer state slot with a value per element (exp_avg, ...), not a scalar (step)."""
    return torch.is_tensor(value) and value.dim() > 0


def _clone(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _forget_stale_world_group() -> None:
    """DeepSpeed caches a clone of the default group per process; one of a default group since
    destroyed (an earlier trainer's, in the same process) must not be reused."""
    cached = ds_groups._WORLD_GROUP
    if cached is None:
        return
    try:
        dist.get_global_rank(cached, 0)
    except (ValueError, RuntimeError):
        ds_groups._WORLD_GROUP = None


def _destroy_if_initialized() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
