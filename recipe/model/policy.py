"""The policy: a Hugging Face Llama and its tokenizer, loaded or built locally (no download).

A model directory written here (`save_pretrained` of both model and tokenizer) is an ordinary
Hugging Face checkpoint, so the vLLM engine can later load the very same directory. The tiny
built-in model uses head_dim 64 because vLLM's CPU attention accepts no other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from recipe.model.lean import lean_llama
from recipe.model.packing import RowGroups
from recipe.model.precision import upcast_lm_head

# Job logs are files; a model of a few shards only adds progress-bar noise to them.
hf_logging.disable_progress_bar()


@dataclass(frozen=True)
class TinyLlamaShape:
    """The architecture of a tiny Llama; every field enters the built-in model's cache key."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 1
    head_dim: int = 64
    max_positions: int = 32


def build_tokenizer(vocabulary: Sequence[str], *, eos: str, pad: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: one token per whitespace-separated symbol, ids in vocabulary order."""
    backend = Tokenizer(models.WordLevel({symbol: i for i, symbol in enumerate(vocabulary)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=pad)


def build_tiny_llama(shape: TinyLlamaShape, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama sized for `tokenizer`, the same for the same seed."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def resolve_dtype(dtype: str) -> torch.dtype:
    """`model.dtype` on this engine: auto is float32, since the torch engine runs on CPU."""
    return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def load_policy(directory: Path, *, dtype: str, lm_head_fp32: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Model and tokenizer from a Hugging Face directory, in `model.dtype`, with the fp32 head if
    asked (`recipe.model.precision.upcast_lm_head`)."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=resolve_dtype(dtype))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    if lm_head_fp32:
        upcast_lm_head(model)  # the weight stays in the body's dtype, as vLLM's head_dtype keeps it
    return model, tokenizer


def matmul_param_count(model: PreTrainedModel) -> int:
    """N in the FLOP count: every parameter but the input embedding table.

    An embedding lookup costs no multiply-adds; the LM head (a matmul) does, so it counts.
    """
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding)


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    tokens_BT: torch.Tensor,
    prompt_mask_BP: torch.Tensor | None = None,
    *,
    shared_prefix: bool = False,
    compiled: bool = False,
) -> torch.Tensor:
    """Trainer-side log-prob of each completion token, with gradient.

    One forward over prompt + completion; the logits at positions P-1 .. P+T-2 predict the T
    completion tokens. Positions after a sequence's EOS hold padding; attention is causal, so
    they change nothing before them. Left-padded prompts come with `prompt_mask_BP` (see
    `recipe.model.sampler.padding_inputs`).

    shared_prefix (`engine.kernels=fast`): rows that repeat the prompt of the row before them
    share one pass over it (`recipe.model.lean.LeanLlama.shared_prefix_logits`), where the lean
    forward applies; the same log-probs up to fp32 rounding. compiled (`engine.kernels=compiled`):
    that pass through `torch.compile`.
    """
    num_new = tokens_BT.shape[1]
    lean = lean_llama(model) if prompt_mask_BP is None else None
    groups = RowGroups.of(prompt_ids_BP) if lean is not None and shared_prefix else None
    if groups is not None:
        logits_BTV = lean.shared_prefix_logits(prompt_ids_BP, tokens_BT, groups, compiled=compiled)
    elif lean is not None:  # the model's own forward, bit for bit, in fewer calls (recipe.model.lean)
        logits_BTV = lean.logits(torch.cat([prompt_ids_BP, tokens_BT[:, :-1]], dim=1), num_new)
    else:
        padded = {}
        if prompt_mask_BP is not None:
            mask_BT = torch.cat([prompt_mask_BP, prompt_mask_BP.new_ones(tokens_BT.shape[0], num_new - 1)], dim=1)
            attention_BT = mask_BT.long()
            padded = {"attention_mask": attention_BT, "position_ids": (attention_BT.cumsum(dim=1) - 1).clamp(min=0)}
        input_ids = torch.cat([prompt_ids_BP, tokens_BT[:, :-1]], dim=1)
        logits_BTV = model(input_ids=input_ids, logits_to_keep=num_new, **padded).logits
    return torch.log_softmax(logits_BTV.float(), dim=-1).gather(-1, tokens_BT[:, :, None]).squeeze(-1)
