"""Mixed-precision training: fp32 master weights and fp32 optimizer state for a low-precision body.

Stepping bf16 weights with AdamW directly does not train at ScaleRL's learning rates: an update of
~lr (5e-7 .. 1e-6) per element is far below half a bf16 ulp of a typical weight (2^-9 of it: ~4e-5
for a weight of 0.02), so every weight rounds back to itself and the model stays put. Mixed
precision keeps an fp32 *master* copy of every parameter that is not fp32: the gradients are
moved onto the masters in fp32, summed, clipped and stepped there (AdamW's moments are fp32
because the masters are), and the model's weights are the masters rounded to the body's dtype
after each step. That is what DeepSpeed's ZeRO stages 1/2 do with their fp32 partitions; this
module gives the same to the torch trainer and to DeepSpeed's stage 0, which steps the client
optimizer on the module's own parameters.

`MasterWeights` swaps the masters into the run's optimizer in place of the parameters they copy,
before its first step, so the optimizer (torch's AdamW, fused or not) steps fp32 tensors only
and its state dict indexes parameters exactly as before. A checkpoint carries each master in
its parameter's optimizer slot `master` (`MASTER_KEY`), the format of the DeepSpeed trainer's
gathered checkpoints, so either trainer resumes from the other's masters; a checkpoint without
masters (an fp32 run's) starts them from the weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

MASTER_KEY = "master"
"""Per-parameter optimizer state slot holding the fp32 master weight of a parameter that is not fp32."""


class MasterWeights:
    """fp32 masters of the low-precision parameters of `optimizer`'s groups, swapped into them.

    Use per step: backward into the model's parameters, `take_gradients()` (moves them onto the
    masters in fp32), reduce and clip `params()`' gradients, `optimizer.step()`, `write_back()`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise ValueError("MasterWeights must be made before the optimizer's first step")
        self.optimizer = optimizer
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        """(model parameter, its fp32 master) of every parameter that is not fp32."""
        for group in optimizer.param_groups:
            stepped = []
            for param in group["params"]:
                if param.dtype == torch.float32:
                    stepped.append(param)
                    continue
                master = param.detach().float().requires_grad_(param.requires_grad)
                self.pairs.append((param, master))
                stepped.append(master)
            group["params"] = stepped

    @property
    def active(self) -> bool:
        """Whether any parameter has a master (an fp32 model has none: nothing here changes its steps)."""
        return bool(self.pairs)

    def params(self) -> list[torch.Tensor]:
        """What the optimizer steps, in its order: the masters and the fp32 parameters."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def masters(self) -> Iterable[tuple[torch.nn.Parameter, torch.Tensor]]:
        return iter(self.pairs)

    def take_gradients(self) -> None:
        """Move each low-precision gradient onto its master, in fp32 (None stays None)."""
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """The model's weights: the masters rounded to the body's dtype."""
        for param, master in self.pairs:
            param.copy_(master)

    # -- checkpoints --------------------------------------------------------------------------

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict with each master in its parameter's `MASTER_KEY` slot."""
        state = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self.params())}
        for _, master in self.pairs:
            slots = state["state"].setdefault(index[id(master)], {})
            slots[MASTER_KEY] = master.detach().clone()
        return state

    @torch.no_grad()
    def load_optimizer_state(self, saved: Mapping[str, Any]) -> None:
        """Load `saved` (after the model's weights): masters from their slots, or from the weights
        where the checkpoint has none; the rest into the optimizer."""
        index = {id(p): i for i, p in enumerate(self.params())}
        saved_state = {int(i): dict(s) for i, s in saved["state"].items()}
        for param, master in self.pairs:
            stored = saved_state.get(index[id(master)], {}).pop(MASTER_KEY, None)
            master.copy_(param if stored is None else stored)
        for slots in saved_state.values():
            slots.pop(MASTER_KEY, None)  # an fp32 parameter here that was not fp32 in the checkpoint
        self.optimizer.load_state_dict({"state": saved_state, "param_groups": saved["param_groups"]})
        self.write_back()
