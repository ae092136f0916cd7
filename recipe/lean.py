"""A lean forward of a Hugging Face Llama over its own weights: the same operations, fewer calls.

At the built-in models' size (84k parameters, batch 64, 8-20 positions) a forward is bound by
per-call overhead, not arithmetic: transformers' Llama forward spends most of its time in Python
(mask construction, cache objects, rotary embeddings recomputed per call, module dispatch, output
dataclasses). `LeanLlama` runs the same tensor operations in the same order on the same
parameters (read at every call, so in-place weight loads and optimizer steps apply at once):

- `logits`: the full causal forward of unpadded rows, with autograd. It issues the operations
  `LlamaForCausalLM.forward` issues (RMSNorm in fp32, rotary q*cos + rotate_half(q)*sin, SDPA
  with is_causal, SiLU MLP, the head on the last positions), so its logits equal transformers'
  bit for bit (tests/test_lean.py checks it, and the gradients); cos/sin come from a table built
  once per model with the same elementwise products transformers computes per call.
- `Cache` / `prefill` / `decode`: sampling with a static, preallocated KV cache (one buffer per
  layer, written in place; no DynamicCache, no concatenation per token). Cached decoding is not
  bit-identical to a full forward in transformers either; the behaviour log-probs match the
  trainer's to the sampler tests' 1e-5.

Only what it reproduces exactly is taken (`lean_llama` returns None otherwise and the callers use
transformers): a `LlamaForCausalLM` on SDPA attention, default RoPE, no biases, SiLU, no hooks on
any module, no dropout in training mode. A head whose forward was replaced (the FP32 head,
`recipe.precision.upcast_lm_head`) is called as it is. Left-padded rows (math-jsonl) keep the
transformers path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

_LEAN: weakref.WeakKeyDictionary[torch.nn.Module, LeanLlama | None] = weakref.WeakKeyDictionary()


def lean_llama(model: torch.nn.Module) -> LeanLlama | None:
    """The lean forward of `model`, or None where it would not compute what transformers computes."""
    try:
        lean = _LEAN[model]
    except (KeyError, TypeError):
        lean = LeanLlama(model) if _supported(model) else None
        try:
            _LEAN[model] = lean
        except TypeError:
            pass
    if lean is None or lean.hooked():
        return None
    if model.training and lean.dropout > 0:
        return None
    return lean


def _supported(model: torch.nn.Module) -> bool:
    try:
        from transformers import LlamaForCausalLM
    except ImportError:  # pragma: no cover - transformers is a dependency of every engine
        return False
    if type(model) is not LlamaForCausalLM:
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    return (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and config.hidden_act == "silu"
        and rope.get("rope_type", "default") == "default"
        and getattr(model.model.rotary_emb, "rope_type", "default") == "default"
        and getattr(config, "pretraining_tp", 1) == 1
        and type(model.lm_head) is torch.nn.Linear
        and model.lm_head.bias is None
    )


@dataclass
class Cache:
    """Static KV buffers, [B, kv heads, capacity, head dim] per layer, and the positions filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0


class LeanLlama:
    """See the module docstring. Holds references to `model`'s modules, never copies of weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.model = model
        self.modules = list(model.modules())
        self.layers = list(model.model.layers)
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.head = model.lm_head
        self.rotary = model.model.rotary_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def hooked(self) -> bool:
        """Any forward hook (module or global) would be skipped here: then transformers runs."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    # -- pieces, as transformers computes them -------------------------------------------------

    def _rope(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, head_dim] for positions 0..length-1 (LlamaRotaryEmbedding's values)."""
        inv_freq = self.rotary.inv_freq
        tables = self._tables
        if tables is None or tables[0] is not inv_freq or tables[1].shape[0] < length or tables[1].dtype != dtype:
            positions = torch.arange(max(length, 64), device=device)
            freqs = positions[:, None].float() * inv_freq.to(device=device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)
            scaling = self.rotary.attention_scaling
            tables = (inv_freq, (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype))
            self._tables = tables
        return tables[1][:length], tables[2][:length]

    @staticmethod
    def _rms(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * hidden.to(input_dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed
        return F.embedding(input_ids, e.weight, e.padding_idx, e.max_norm, e.norm_type, e.scale_grad_by_freq, e.sparse)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if "forward" in self.head.__dict__:  # a replaced forward (the FP32 head): call it as it is
            return self.head(hidden)
        return F.linear(hidden, self.head.weight)

    def _layer(
        self,
        layer: torch.nn.Module,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Cache | None,
        index: int,
    ) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        batch, length = hidden.shape[:2]
        residual = hidden
        hidden = self._rms(layer.input_layernorm, hidden)
        shape = (batch, length, -1, self.head_dim)
        q = F.linear(hidden, attn.q_proj.weight).view(shape).transpose(1, 2)
        k = F.linear(hidden, attn.k_proj.weight).view(shape).transpose(1, 2)
        v = F.linear(hidden, attn.v_proj.weight).view(shape).transpose(1, 2)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        gqa = {"enable_gqa": True} if self.num_heads != self.num_kv_heads else {}
        if cache is None:
            dropout = self.dropout if self.model.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=self.scaling, is_causal=length > 1, **gqa
            )
        else:
            start, end = cache.length, cache.length + length
            cache.keys[index][:, :, start:end] = k
            cache.values[index][:, :, start:end] = v
            k, v = cache.keys[index][:, :, :end], cache.values[index][:, :, :end]
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, is_causal=start == 0 and length > 1, **gqa)
        out = out.transpose(1, 2).contiguous().reshape(batch, length, -1).contiguous()
        hidden = residual + F.linear(out, attn.o_proj.weight)
        residual = hidden
        hidden = self._rms(layer.post_attention_layernorm, hidden)
        gated = F.silu(F.linear(hidden, mlp.gate_proj.weight)) * F.linear(hidden, mlp.up_proj.weight)
        return residual + F.linear(gated, mlp.down_proj.weight)

    # -- the forwards ----------------------------------------------------------------------------

    def logits(self, input_ids: torch.Tensor, num_keep: int) -> torch.Tensor:
        """`model(input_ids=input_ids, logits_to_keep=num_keep).logits` for unpadded rows."""
        hidden = self._embed(input_ids)
        cos, sin = self._rope(input_ids.shape[1], hidden.dtype, hidden.device)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, None, 0)
        hidden = self._rms(self.norm, hidden)
        return self._head(hidden[:, -num_keep:, :])

    def new_cache(self, batch: int, capacity: int, device: torch.device) -> Cache:
        dtype = self.embed.weight.dtype
        shape = (batch, self.num_kv_heads, capacity, self.head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers]
        return Cache(keys, [torch.empty(shape, dtype=dtype, device=device) for _ in self.layers])

    @torch.no_grad()
    def extend(self, cache: Cache, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed `input_ids` [B, n] after the cached positions; the last position's logits [B, V]."""
        hidden = self._embed(input_ids)
        start, length = cache.length, input_ids.shape[1]
        cos, sin = self._rope(start + length, hidden.dtype, hidden.device)
        cos, sin = cos[start:], sin[start:]
        for index, layer in enumerate(self.layers):
            hidden = self._layer(layer, hidden, cos, sin, cache, index)
        cache.length += length
        hidden = self._rms(self.norm, hidden[:, -1:, :])
        return self._head(hidden)[:, -1]
