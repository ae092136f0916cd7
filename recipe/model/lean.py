"""A lean forward of a Hugging Face Llama over its own weights: the same operations, fewer calls.

At the built-in models' size (84k parameters, batch 64, 8-20 positions) a sampling forward is
bound by per-call Python overhead, not arithmetic: transformers' Llama forward spends most of its
time in mask construction, cache objects, rotary embeddings recomputed per call, module dispatch
and output dataclasses. (The trainer's forward and backward over 64 x 14 positions are mostly
matmul arithmetic, so they gain less.) Measured on the 2-core box, one thread, sort6 8 x 8 (one
process alternating both paths, medians of 200 steps): sampling 7.6 -> 5.4 ms a step, the
trainer's forward 3.5 -> 3.1 ms, backward unchanged (5.6 ms), a whole step 19.4 -> 16.6 ms; with
the shared prefill below, sampling ~3.4 ms (bench/RESULTS.md has the current figures).

`LeanLlama` issues the tensor operations `LlamaForCausalLM.forward` issues, in
the same order, with the same shapes, on the same parameters, so its logits, its KV cache and
(through autograd) its gradients are transformers' bit for bit (tests/test_lean.py checks
`torch.equal`, fp32 and bf16, with and without the FP32 head, and whole training runs):

- RMSNorm in fp32 and back (a `.to` to the dtype a tensor already has is skipped: it returns the
  tensor itself), rotary `q*cos + rotate_half(q)*sin` (as `roll(q)*signed_sin`: the same products,
  only a sign moves, which rounds nothing), SDPA with `is_causal` for more
  than one query and no mask (GQA through `enable_gqa`, as transformers passes it), SiLU MLP,
  `o_proj` on the contiguous reshape, the head on the kept positions. Without a cache argument
  transformers still builds a `DynamicCache` (`config.use_cache`), so the trainer's forward
  attends over the same concatenated key/value copies here too.
- cos/sin are computed exactly as `LlamaRotaryEmbedding.forward` computes them for the same
  positions and shapes, and memoised per (first position, length, dtype): the same tensor values
  transformers recomputes on every call.
- The sampling cache holds, per layer, the keys and values `DynamicCache` would hold, written in
  place into positions allocated once for prompt + cap (`LeanCache` with a capacity; grown with
  the same `torch.cat` without one); a decoding that can no longer take the lean path hands it
  over as a real `DynamicCache` (`LeanCache.to_dynamic`).
- Rows that repeat the prompt of the row before them (a group's G samples) share one prefill
  (`prefill_shared`): the logits and the cache of the whole batch's prefill for 1/G of its
  arithmetic, bit for bit where the CPU's kernels sum a matmul's rows the same way for G times
  fewer rows (AMD EPYC here), a few ulps apart where they block by row count (Intel Xeons;
  tests/test_lean.py states the budget). The sampler runs in inference mode (`recipe.model.sampler`).

Nothing is copied: every weight is read from its module at every call, so in-place loads
(`load_state_dict`, `copy_`), optimizer steps and even replaced parameters apply at once. No
weights are joined (measured: q|k|v in one matmul gives the same forward here but no faster
sampling, and a different backward) and the optimizer is not touched here.

Two paths are *not* bit for bit, and are taken only when asked for: `shared_prefix_logits`, the
trainer's pass with each prompt computed once for its group (`engine.kernels=fast`, and compiled
with `compiled`), and `decode_compiled` (`engine.kernels=compiled`). Each is the same function, up
to fp32 rounding (tests/test_lean.py bounds the differences). The pieces every path shares (the
norm, the rotary embedding, the packed pass) are functions of tensors in `recipe.model.compiled`.

Only what it reproduces exactly is taken; `lean_llama` returns None otherwise and the callers use
transformers: exactly a `LlamaForCausalLM` with the SDPA attention, default RoPE, no biases, SiLU,
no pretraining_tp, no forward hooks (module or global), no replaced forwards (except the FP32 head
of `recipe.model.precision.upcast_lm_head`, which is called as it is), no gradient checkpointing, and
no attention dropout in training mode. Left-padded rows (math-jsonl's prompt mask) always take
transformers.

`SWEEP_LEAN=0` in the environment turns the lean path off everywhere (for comparisons: the
results are the same, only slower).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

from recipe.model import compiled as compiled_kernels
from recipe.model.packing import Packing, RowGroups

_LEAN: weakref.WeakKeyDictionary[torch.nn.Module, LeanLlama | None] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """False when `SWEEP_LEAN=0` (read at every call, so a test or a comparison can flip it)."""
    return os.environ.get("SWEEP_LEAN", "1") != "0"


def lean_llama(model: torch.nn.Module) -> LeanLlama | None:
    """The lean forward of `model`, or None where it would not compute what transformers computes."""
    if not enabled():
        return None
    try:
        lean = _LEAN[model]
    except KeyError:
        lean = LeanLlama(model) if _supported_type(model) else None
        _LEAN[model] = lean
    except TypeError:  # not weak-referenceable: no lean path
        return None
    if lean is None or not lean.applies():
        return None
    return lean


def _supported_type(model: torch.nn.Module) -> bool:
    from transformers import LlamaForCausalLM

    return type(model) is LlamaForCausalLM


class LeanCache:
    """Per layer, the keys and values `DynamicCache` holds (the same tensors, grown by the same cat)."""

    def __init__(self, num_layers: int, capacity: int | None = None) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.capacity = capacity
        """Positions allocated once (the sampler knows prompt + cap): each token's keys and values are
        written in place instead of the whole cache copied by a cat. None: grown by cat."""

    def update(self, index: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`DynamicLayer.update`: an empty tensor first (its lazy initialisation), then cat on dim -2;
        with a capacity, written into the allocated positions (the same values; a view of them is
        returned)."""
        keys, values = self.keys[index], self.values[index]
        if self.capacity is not None:
            if keys is None:
                shape = (*key.shape[:2], self.capacity, key.shape[3])
                # zeros, not empty: `decode_compiled` attends over every position, masking the unwritten
                keys, values = key.new_zeros(shape), value.new_zeros(shape)
                self.keys[index], self.values[index] = keys, values
            end = self.length + key.shape[2]
            if end > self.capacity:
                raise ValueError(f"the lean cache holds {self.capacity} positions; position {end - 1} was written")
            keys[:, :, self.length : end].copy_(key)
            values[:, :, self.length : end].copy_(value)
            return keys[:, :, :end], values[:, :, :end]
        if keys is None:
            keys = torch.tensor([], dtype=key.dtype, device=key.device)
            values = torch.tensor([], dtype=value.dtype, device=value.device)
        keys = torch.cat([keys, key], dim=-2)
        values = torch.cat([values, value], dim=-2)
        self.keys[index], self.values[index] = keys, values
        return keys, values

    def select_rows(self, groups: RowGroups) -> None:
        """Each row takes its group's keys and values (a prompt's prefill shared by its group)."""
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is not None:
                # contiguous: with one group, `spread` may return a stride-0 view, which the next
                # token's write into the cache would refuse (many rows sharing one memory location)
                self.keys[index], self.values[index] = groups.spread(keys).contiguous(), groups.spread(values).contiguous()

    def to_dynamic(self, config) -> object:
        """The same cache as transformers' `DynamicCache` (for a decoding that has to leave the lean path)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is not None:
                cache.update(keys[:, :, : self.length], values[:, :, : self.length], index)
        return cache


class _Layer:
    """One decoder layer's modules, resolved once (their weights are read at every call)."""

    __slots__ = ("layer", "attn", "mlp", "input_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down", "act")

    def __init__(self, layer: torch.nn.Module) -> None:
        m = layer._modules
        self.layer, self.attn, self.mlp = layer, m["self_attn"], m["mlp"]
        self.input_norm, self.post_norm = m["input_layernorm"], m["post_attention_layernorm"]
        a, f = self.attn._modules, self.mlp._modules
        self.q, self.k, self.v, self.o = a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"]
        self.gate, self.up, self.down, self.act = f["gate_proj"], f["up_proj"], f["down_proj"], f["act_fn"]


class LeanLlama:
    """See the module docstring. Holds references to `model`'s modules, never copies of weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.activations import SiLUActivation
        from transformers.models.llama import modeling_llama as llama

        self._model = weakref.ref(model)  # the cache of lean forwards is keyed weakly by the model: no cycle
        self._llama = llama
        self._silu = SiLUActivation
        self._rope_memo: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plan: tuple[torch.nn.Module, ...] = ()
        self._structure_ok = False
        self._resolve()

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this lean forward is gone")
        return model

    # -- whether it applies ------------------------------------------------------------------

    def _current_plan(self) -> tuple[torch.nn.Module, ...]:
        """Every module the forward uses, looked up afresh (cheap: dictionary reads); the model itself
        is left out, so that this holds no reference to it."""
        model = self.model
        inner = model._modules["model"]
        m = inner._modules
        plan = [inner, m["embed_tokens"], m["norm"], m["rotary_emb"], model._modules["lm_head"], m["layers"]]
        for layer in m["layers"]._modules.values():
            plan.append(layer)
            plan.extend(layer._modules.values())
            for sub in layer._modules.values():
                plan.extend(sub._modules.values())
        return tuple(plan)

    def _resolve(self) -> None:
        """(Re)build the resolved modules and check their types, once per structure."""
        self._plan = self._current_plan()
        self._structure_ok = False
        model, llama = self.model, self._llama
        inner = model._modules["model"]
        self.embed, self.norm = inner._modules["embed_tokens"], inner._modules["norm"]
        self.rotary, self.head = inner._modules["rotary_emb"], model._modules["lm_head"]
        layers = list(inner._modules["layers"]._modules.values())[: model.config.num_hidden_layers]
        if len(layers) < model.config.num_hidden_layers:
            return
        if type(inner) is not llama.LlamaModel or type(self.embed) is not torch.nn.Embedding:
            return
        if type(self.norm) is not llama.LlamaRMSNorm:
            return
        if type(self.rotary) is not llama.LlamaRotaryEmbedding or self.rotary.rope_type != "default":
            return
        if type(self.head) is not torch.nn.Linear or self.head.bias is not None:
            return
        try:
            self.layers = [_Layer(layer) for layer in layers]
        except KeyError:
            return
        for layer in self.layers:
            if type(layer.layer) is not llama.LlamaDecoderLayer or type(layer.attn) is not llama.LlamaAttention:
                return
            if type(layer.mlp) is not llama.LlamaMLP or type(layer.act) is not self._silu:
                return
            if type(layer.input_norm) is not llama.LlamaRMSNorm or type(layer.post_norm) is not llama.LlamaRMSNorm:
                return
            for linear in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
                if type(linear) is not torch.nn.Linear or linear.bias is not None:
                    return
        self._structure_ok = True
        self.spec = self._spec()  # the sizes `recipe.model.compiled` takes

    def _spec(self) -> compiled_kernels.Spec:
        """The sizes and constants `recipe.model.compiled` takes."""
        attn, embed = self.layers[0].attn, self.embed
        return compiled_kernels.Spec(
            num_layers=len(self.layers),
            head_dim=attn.head_dim,
            kv_groups=attn.num_key_value_groups,
            scaling=float(attn.scaling),
            eps=tuple(
                (float(layer.input_norm.variance_epsilon), float(layer.post_norm.variance_epsilon))
                for layer in self.layers
            ),
            final_eps=float(self.norm.variance_epsilon),
            embedding=(embed.padding_idx, embed.max_norm, embed.norm_type, embed.scale_grad_by_freq, embed.sparse),
        )

    def weights(self) -> list[torch.Tensor]:
        """The weights the step reads, read afresh from the modules (in-place loads and optimizer
        steps apply at once): the input table, 9 per layer, the final norm's."""
        out = [self.embed._parameters["weight"]]
        for layer in self.layers:
            modules = (layer.input_norm, layer.q, layer.k, layer.v, layer.o, layer.post_norm, layer.gate, layer.up)
            out.extend(m._parameters["weight"] for m in (*modules, layer.down))
        out.append(self.norm._parameters["weight"])
        return out

    def applies(self) -> bool:
        """Checked at every forward: hooks, replaced modules or forwards, attention implementation,
        dropout, gradient checkpointing."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return False
        model = self.model
        if model._forward_hooks or model._forward_pre_hooks or "forward" in model.__dict__:
            return False
        plan = self._current_plan()
        if len(plan) != len(self._plan) or any(a is not b for a, b in zip(plan, self._plan)):
            self._resolve()
        if not self._structure_ok:
            return False
        head = self.head
        for m in plan:
            if m._forward_hooks or m._forward_pre_hooks:
                return False
            if "forward" in m.__dict__ and not (m is head and getattr(m, "_scalesweep_fp32_head", False)):
                return False
        config = model.config
        if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "is_causal", True) is not True:
            return False
        if model.training:
            if model._modules["model"].gradient_checkpointing or float(config.attention_dropout or 0.0) > 0:
                return False
        if getattr(config, "pretraining_tp", 1) != 1 or config.hidden_act != "silu":
            return False
        if self.bias_added():
            return False
        return self._llama.ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is _sdpa_interface()

    def bias_added(self) -> bool:
        """A bias set on a linear after the structure was checked (the lean forward has none)."""
        if self.head._parameters.get("bias") is not None:
            return True
        for layer in self.layers:
            for linear in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
                if linear._parameters.get("bias") is not None:
                    return True
        return False

    # -- pieces, as transformers computes them -------------------------------------------------

    def _rope(
        self, start: int, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaRotaryEmbedding.forward` for position_ids = arange(length) + start, shape [1, length]:
        cos, and sin with its first half negated (for `_layer`'s roll)."""
        rotary = self.rotary
        inv_freq = rotary.inv_freq
        key = (start, length, dtype, device, id(inv_freq), inv_freq._version, rotary.attention_scaling)
        memo = self._rope_memo.get(key)
        if memo is None:
            with torch.inference_mode(False), torch.no_grad():  # normal tensors: training reads them too
                position_ids = (torch.arange(length, device=device) + start).unsqueeze(0)
                freqs = position_ids[..., None].float() * inv_freq.to(device=device, dtype=torch.float)
                emb = torch.cat((freqs, freqs), dim=-1)
                cos = emb.cos() * rotary.attention_scaling
                sin = emb.sin() * rotary.attention_scaling
                cos, sin = cos.to(dtype=dtype).unsqueeze(1), sin.to(dtype=dtype).unsqueeze(1)
                half = sin.shape[-1] // 2
                # rotate_half(x) * sin == roll(x, half) * signed_sin exactly (a sign moves, nothing rounds)
                signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
                memo = (cos, signed_sin)
            if len(self._rope_memo) > 4096:
                self._rope_memo.clear()
            self._rope_memo[key] = memo
        return memo

    @staticmethod
    def _rms(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """`LlamaRMSNorm.forward` of `norm`."""
        return compiled_kernels.rms(hidden, norm._parameters["weight"], norm.variance_epsilon)

    def _layer(
        self,
        layer: _Layer,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LeanCache | None,
        index: int,
    ) -> torch.Tensor:
        """`LlamaDecoderLayer.forward` (attention through `sdpa_attention_forward`, no mask)."""
        attn = layer.attn
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        residual = hidden
        hidden = self._rms(layer.input_norm, hidden)
        query = F.linear(hidden, layer.q._parameters["weight"]).view(hidden_shape).transpose(1, 2)
        key = F.linear(hidden, layer.k._parameters["weight"]).view(hidden_shape).transpose(1, 2)
        value = F.linear(hidden, layer.v._parameters["weight"]).view(hidden_shape).transpose(1, 2)
        query, key = compiled_kernels.rotate(query, cos, sin), compiled_kernels.rotate(key, cos, sin)
        if cache is not None:
            key, value = cache.update(index, key, value)
        sdpa = {"enable_gqa": True} if attn.num_key_value_groups > 1 else {}
        dropout = attn.attention_dropout if self.model.training else 0.0
        causal = query.shape[2] > 1
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=None, dropout_p=dropout, scale=attn.scaling, is_causal=causal, **sdpa
        )
        out = out.transpose(1, 2).contiguous()
        out = out.reshape(*input_shape, -1)  # contiguous already: transformers' second .contiguous() is a no-op
        hidden = residual + F.linear(out, layer.o._parameters["weight"])
        residual = hidden
        hidden = self._rms(layer.post_norm, hidden)
        gate = F.silu(F.linear(hidden, layer.gate._parameters["weight"]))
        hidden = F.linear(gate * F.linear(hidden, layer.up._parameters["weight"]), layer.down._parameters["weight"])
        return residual + hidden

    def _body(self, input_ids: torch.Tensor, cache: LeanCache | None) -> torch.Tensor:
        hidden = self._embed(input_ids)
        start = 0 if cache is None else cache.length
        cos, sin = self._rope(start, input_ids.shape[1], hidden.dtype, hidden.device)
        for index, layer in enumerate(self.layers):
            hidden = self._layer(layer, hidden, cos, sin, cache, index)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self._rms(self.norm, hidden)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`nn.Embedding.forward` of the input table (its padding row gets no gradient)."""
        embed = self.embed
        return F.embedding(
            input_ids,
            embed._parameters["weight"],
            embed.padding_idx,
            embed.max_norm,
            embed.norm_type,
            embed.scale_grad_by_freq,
            embed.sparse,
        )

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        if "forward" in head.__dict__:  # the FP32 head (recipe.model.precision): its forward, as it is
            return head.forward(hidden)
        return F.linear(hidden, head._parameters["weight"])

    # -- the forwards ----------------------------------------------------------------------------

    def logits(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """`model(input_ids=input_ids, logits_to_keep=logits_to_keep).logits` for unpadded rows.

        Without a cache argument transformers still makes a `DynamicCache` when `config.use_cache`
        is set (the keys and values SDPA reads are then its concatenated copies): so does this.
        """
        cache = self.new_cache() if self.model.config.use_cache else None
        hidden = self._body(input_ids, cache)
        return self._head(hidden[:, slice(-logits_to_keep, None), :])

    def new_cache(self, capacity: int | None = None) -> LeanCache:
        return LeanCache(len(self.layers), capacity)

    def extend(self, cache: LeanCache, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """`model(input_ids=..., cache=..., use_cache=True, logits_to_keep=...).logits` with the lean cache:
        the prompt first (any length), then one token per call (what the sampler feeds)."""
        if cache.length and input_ids.shape[1] != 1:
            raise ValueError("the lean cache takes one token at a time after the prompt")
        hidden = self._body(input_ids, cache)
        return self._head(hidden[:, slice(-logits_to_keep, None), :])

    def decode_compiled(self, cache: LeanCache, token_B: torch.Tensor) -> torch.Tensor:
        """`extend(cache, token_B[:, None])[:, -1]` with the step through `torch.compile`
        (`engine.kernels=compiled`; `recipe.model.compiled`): the same function, rounded differently."""
        if cache.capacity is None or cache.keys[0] is None:
            raise ValueError("a compiled decode step needs a prefilled cache with a capacity")
        position = cache.length
        if position >= cache.capacity:
            raise ValueError(f"the lean cache holds {cache.capacity} positions; position {position} was written")
        cos, sin = self._rope(position, 1, cache.keys[0].dtype, token_B.device)
        step, weights = compiled_kernels.compiled_decode_step(), self.weights()
        hidden_BD = step(weights, cache.keys, cache.values, token_B, torch.tensor(position), cos, sin, self.spec)
        cache.length += 1
        return self._head(hidden_BD)

    def prefill_shared(self, cache: LeanCache, prompt_ids_BP: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        """`extend(cache, prompt_ids_BP, 1)` with each distinct prompt computed once for its rows:
        the same logits and cache bit for bit (a row's matmul, attention and norm results do not
        depend on the other rows; tests/test_lean.py checks it), for 1/G of the arithmetic."""
        if cache.length:
            raise ValueError("a shared prefill starts an empty cache")
        logits_UV = self.extend(cache, prompt_ids_BP.index_select(0, groups.first_U), 1)
        cache.select_rows(groups)
        return groups.spread(logits_UV)

    def shared_prefix_logits(
        self, prompt_ids_BP: torch.Tensor, tokens_BT: torch.Tensor, groups: RowGroups, *, compiled: bool = False
    ) -> torch.Tensor:
        """`logits(cat(prompt, tokens[:, :-1]), T)` with each distinct prompt's positions computed
        once for its rows (`engine.kernels=fast`): the prompt's keys and values, and its last
        position's hidden state (which predicts the first token), are shared by the group, and
        gradients from every row flow back into them.

        One pass: the groups' prompt positions and the rows' completion positions are packed into
        one list of positions (`Packing`), so each matmul, norm and activation is one call over all
        of them; only attention is split (each prompt causal; each completion over its group's
        prompt keys and its own, through a mask).

        The same function, with 1/G of the prompt's arithmetic, but not the same rounding: the
        completion positions attend through an explicit mask instead of `is_causal`, and weight
        gradients are summed over another set of rows. Differences stay at fp32 rounding (~1e-6
        relative; tests/test_lean.py).

        compiled (`engine.kernels=compiled`): the pass before the head through `torch.compile`
        (`recipe.model.compiled.packed_pass`: its elementwise work fused into a few generated kernels).
        """
        dtype, device = self.embed._parameters["weight"].dtype, tokens_BT.device
        cos, sin = self._rope(0, prompt_ids_BP.shape[1] + tokens_BT.shape[1] - 1, dtype, device)
        packing = Packing.of(prompt_ids_BP, tokens_BT, groups, cos, sin)
        if not compiled:
            return self.packed_logits(packing)
        hidden_BTD = compiled_kernels.compiled_packed_pass()(self.weights(), packing, self.spec)
        return self._head(hidden_BTD)

    def packed_logits(self, packing: Packing) -> torch.Tensor:
        """`shared_prefix_logits` as torch operations that autograd records (SDPA attention)."""
        hidden_BTD = compiled_kernels.packed_pass(self.weights(), packing, self.spec, sdpa=True)
        return self._head(hidden_BTD)


def _sdpa_interface() -> Callable:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward
