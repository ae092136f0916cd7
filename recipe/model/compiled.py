"""The lean forward's pieces as functions of tensors, and what `engine.kernels=compiled` puts
through `torch.compile`: the sampler's decode step and the trainer's packed pass.

`rms` and `rotate` are the norm and the rotary embedding every lean path uses; `packed_pass` is
the trainer's shared-prefix pass, run as it is (with torch's SDPA) for `engine.kernels=fast`.

At the built-in models' size a forward is ~80 kernels per token step (and a backward twice that),
each costing a few microseconds of dispatch and a trip through the caches whatever its size.
Compiled, the elementwise work (norms, rotary, SiLU, residuals, the attention's softmax and mask,
and their backward) becomes a few generated loops around the matmuls. What keeps the compiled
calls cheap:

- they take tensors (the weights as a flat list read afresh at every call, so in-place loads and
  optimizer steps apply at once), the packed pass's layout (`recipe.model.packing.Packing`) and a frozen
  `Spec` of sizes: the guards torch checks at every call are a few tensor properties, not a walk
  over the model's modules;
- the decode step's shapes do not change within a batch: attention reads all of the cache's
  allocated positions with the unwritten ones left out, and the position is a tensor, so one graph
  serves every step;
- attention is matmul, softmax, matmul (the sizes here are tiny; generated, this costs less than
  the fused SDPA kernel).

The head is applied outside, by the lean forward, so that the FP32 head keeps its own forward.
Compiled, these are the functions `LeanLlama.extend` and `LeanLlama.packed_logits` compute,
rounded differently (tests/test_lean.py bounds the differences).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from recipe.model.packing import Packing

_PER_LAYER = 9
"""Weights per layer in `LeanLlama.weights`' order: input norm, q, k, v, o, post norm, gate, up, down."""


@dataclass(frozen=True)
class Spec:
    """The sizes and constants of one model (hashable: torch guards on it by value)."""

    num_layers: int
    head_dim: int
    kv_groups: int
    scaling: float
    eps: tuple[tuple[float, float], ...]
    """Per layer, the input and post-attention norms' epsilon."""
    final_eps: float
    embedding: tuple
    """The input table's `F.embedding` options: padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse."""


def _layer_weights(ws: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    return ws[1 + _PER_LAYER * index : 1 + _PER_LAYER * (index + 1)]


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, left_out: torch.Tensor, spec: Spec
) -> torch.Tensor:
    """softmax(q k^T * scaling, keys where `left_out` is True left out) v, the softmax in fp32;
    key/value heads repeated for grouped-query attention."""
    if spec.kv_groups > 1:
        key = key.repeat_interleave(spec.kv_groups, dim=1)
        value = value.repeat_interleave(spec.kv_groups, dim=1)
    scores = (torch.matmul(query, key.transpose(-1, -2)) * spec.scaling).masked_fill(left_out, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(query.dtype), value)


def rms(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm.forward`: normalised in fp32, back to the input's dtype, times the weight (a
    `.to` to the dtype a tensor has returns it as it is: skipped)."""
    input_dtype = hidden.dtype
    if input_dtype is not torch.float32:
        hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if input_dtype is not torch.float32:
        hidden = hidden.to(input_dtype)
    return weight * hidden


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, `t * cos + rotate_half(t) * sin` with rotate_half as a roll and `sin`
    signed (`LeanLlama._rope`): the same products, only a sign moved."""
    return (t * cos) + (torch.roll(t, t.shape[-1] // 2, -1) * sin)


def decode_step(
    ws: list[torch.Tensor],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token_B: torch.Tensor,
    position: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    spec: Spec,
) -> torch.Tensor:
    """Feed one token per row at `position` (0-d): its keys and values are written into the
    cache's tensors in place; returns the final norm's output [B, hidden] (the head's input)."""
    hidden = F.embedding(token_B, ws[0], *spec.embedding)[:, None]  # [B, 1, hidden]
    rows, capacity, D = hidden.shape[0], keys[0].shape[2], spec.head_dim
    unwritten = torch.arange(capacity, device=token_B.device) > position
    for index in range(spec.num_layers):
        w_in, w_q, w_k, w_v, w_o, w_post, w_gate, w_up, w_down = _layer_weights(ws, index)
        eps_in, eps_post = spec.eps[index]
        x = rms(hidden, w_in, eps_in)
        query, key, value = (F.linear(x, w).view(rows, 1, -1, D).transpose(1, 2) for w in (w_q, w_k, w_v))
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        keys[index].index_copy_(2, position.view(1), key)
        values[index].index_copy_(2, position.view(1), value)
        out = _attend(query, keys[index], values[index], unwritten, spec).transpose(1, 2).reshape(rows, 1, -1)
        hidden = hidden + F.linear(out, w_o)
        x = rms(hidden, w_post, eps_post)
        hidden = hidden + F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    return rms(hidden, ws[-1], spec.final_eps)[:, 0]


@functools.cache
def compiled_decode_step() -> Callable:
    """`decode_step` through `torch.compile`, made on first use (importing inductor takes
    seconds; the compile ~5 s on the dev VM). A batch of another size compiles once more."""
    return torch.compile(decode_step)


def packed_pass(ws: list[torch.Tensor], p: Packing, spec: Spec, *, sdpa: bool = False) -> torch.Tensor:
    """`LeanLlama.shared_prefix_logits` before the head, on `p`'s layout: the final norm's output at
    the positions that predict each row's T tokens, [B, T, hidden].

    sdpa: attention through torch's fused kernel (`engine.kernels=fast`, run as it is); else as
    matmul-softmax-matmul, which costs less once compiled (`engine.kernels=compiled`)."""
    device = p.ids_N.device
    sees_C = p.completion_mask()
    future_P = torch.ones(p.prompt_len, p.prompt_len, dtype=torch.bool, device=device).triu(1)
    gqa = {"enable_gqa": True} if spec.kv_groups > 1 else {}

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, completions: bool) -> torch.Tensor:
        if not sdpa:
            return _attend(query, key, value, ~sees_C if completions else future_P, spec)
        mask = sees_C if completions else None
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=spec.scaling, is_causal=not completions, **gqa
        )

    hidden = F.embedding(p.ids_N, ws[0], *spec.embedding)
    for index in range(spec.num_layers):
        w_in, w_q, w_k, w_v, w_o, w_post, w_gate, w_up, w_down = _layer_weights(ws, index)
        eps_in, eps_post = spec.eps[index]
        x = rms(hidden, w_in, eps_in)
        query, key, value = (F.linear(x, w).view(x.shape[0], -1, spec.head_dim) for w in (w_q, w_k, w_v))
        query, key = rotate(query, p.cos_N1D, p.sin_N1D), rotate(key, p.cos_N1D, p.sin_N1D)
        key_P, value_P = p.prompts(key), p.prompts(value)
        out = p.packed(attend(p.prompts(query), key_P, value_P, completions=False))
        if p.new_len:
            keys = torch.cat([p.groups.spread(key_P), p.completions(key)], dim=2)
            values = torch.cat([p.groups.spread(value_P), p.completions(value)], dim=2)
            out = torch.cat([out, p.packed(attend(p.completions(query), keys, values, completions=True))])
        hidden = hidden + F.linear(out, w_o)
        x = rms(hidden, w_post, eps_post)
        hidden = hidden + F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    return p.predicting(rms(hidden, ws[-1], spec.final_eps))


@functools.cache
def compiled_packed_pass() -> Callable:
    """`packed_pass` through `torch.compile`, made on first use. torch's default for sizes: the
    first batch's shape is compiled as it is; the first batch of another shape (a shorter longest
    completion, fewer groups kept) compiles once more with dynamic sizes, which later shapes reuse."""
    return torch.compile(packed_pass)
