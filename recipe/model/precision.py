"""Model precision: the body's dtype, and the FP32 LM head on the generator and the trainer alike.

`model.dtype` picks the body's dtype; `auto` is bfloat16 on a GPU and float32 on CPU (bfloat16
works on CPU too: it runs on this machine's avx512_bf16 kernels, just not faster than fp32 for a
tiny model).

`precision.lm_head_fp32` (see docs/engines.md): the head's *weight stays in the body's dtype*
and is upcast to fp32 inside the forward, together with the hidden states, so the logits (and
the log-softmax over them) are fp32. This is exactly what vLLM does with
`hf_overrides={"head_dtype": "float32"}` (`LogitsProcessor` casts both operands), so a bf16
weight pushed from the trainer gives both sides the same fp32 logits. Gradients flow through the
cast into the bf16 weight, and a head tied to the input embedding stays tied.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def body_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype `model.dtype` names on `device` (auto: bfloat16 on CUDA, float32 on CPU)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {['auto', *DTYPES]}, got {name!r}")
    return DTYPES[name]


def vllm_dtype(name: str, device: torch.device | str = "cpu") -> str:
    """The same choice as vLLM's `dtype` argument."""
    return str(body_dtype(name, device)).removeprefix("torch.")


def upcast_lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """Compute the LM head in fp32 from its weight in the model's dtype (in place; returns `model`).

    The head keeps its parameter (name, dtype, tying), so state dicts and weight pushes are
    unchanged; only its forward differs. For an fp32 model it changes nothing numerically.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the FP32 LM head needs an nn.Linear output layer, got {type(head).__name__}")
    head.forward = types.MethodType(_fp32_linear_forward, head)
    head._scalesweep_fp32_head = True
    return model


def has_fp32_head(model: torch.nn.Module) -> bool:
    return bool(getattr(model.get_output_embeddings(), "_scalesweep_fp32_head", False))


def _fp32_linear_forward(self: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.float()
    return F.linear(hidden.float(), self.weight.float(), bias)
