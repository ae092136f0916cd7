"""The torch generator: the Hugging Face model with a KV cache, on CPU or CUDA, no vLLM needed.

Blocking (`generate`) or streaming (`submit` / `poll`, a generator rank under PipelineRL). While
streaming, the groups submitted since the last `poll` start together as one `Decoding` (one KV
cache, left-padded prompts), and every `poll` advances every running decoding by at most
`chunk_tokens` tokens before it returns what finished. Between two polls the generator rank reads
its control channel, so a weight push waits at most one chunk: `receive_weights` copies the new
tensors into the model in place, the decodings keep their KV caches, and their next tokens are
sampled from the new weights (`recipe.model.sampler.Decoding`). A sequence that ran across a push
records both versions (`Sample.version_start` < `version_end`).

Forced interruption (`length.control=interrupt`): a group submitted with an `Interrupt` (its
samples' thinking budgets) decodes with it (`recipe.model.sampler.Decoding`): a sample still thinking at
its budget gets the phrase appended and goes on to answer; `Sample.forced` lists those positions.

Behaviour log-probs: log-softmax of the fp32 logits (temperature 1, no top-p/top-k), the
trainer's quantity (`recipe.engines.base`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from recipe.engines.base import Group, Sample, WeightMeta
from recipe.engines.weights import WeightGroupSpec, generator_rank, init_weight_group, receive_into
from recipe.model.sampler import Decoding, Interrupt, Sampling

_Item = tuple[str, tuple[int, ...], int, int, int, Interrupt | None]
"""A submitted group: id, prompt, num_samples, max_new_tokens, seed, its interrupt (or None)."""


@dataclass
class _Running:
    """One decoding and the groups it holds, rows [i*G, (i+1)*G) for its i-th group."""

    decoding: Decoding
    group_ids: list[str]
    prompts: list[tuple[int, ...]]
    num_samples: int
    version_start: int
    version_end_B: torch.Tensor
    emitted: set[str] = field(default_factory=set)


class TorchGenerator:
    """A `recipe.engines.base.StreamingGenerator` (and blocking `Generator`) on a torch model."""

    poll_timeout_s = 0.0
    """What a generator rank passes to `poll`: this engine computes in `poll`, so it returns after
    one round of chunks and the rank reads its control channel between rounds (a weight push
    waits one round, ~4 decode steps, not until a group finishes)."""

    def __init__(
        self, model: torch.nn.Module, *, eos_id: int, pad_id: int, version: int = 0, chunk_tokens: int = 4
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model = model.eval()
        self.eos_id, self.pad_id = eos_id, pad_id
        self.version = version
        self.chunk_tokens = chunk_tokens
        self.num_generated_tokens = 0
        """Completion tokens sampled so far (dropped work included): the generator's compute."""
        self._queued: list[_Item] = []
        self._running: list[_Running] = []
        self._group: dist.ProcessGroup | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- blocking ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Sample]]:
        running = self._start(
            [(str(i), tuple(p), num_samples, max_new_tokens, seed, None) for i, p in enumerate(prompts)], greedy
        )
        while not running.decoding.done:
            self._advance(running)
        return [list(self._group_of(running, i).samples) for i in range(len(prompts))]

    # -- streaming ---------------------------------------------------------------------------

    def submit(
        self,
        group_id: str,
        prompt: Sequence[int],
        *,
        num_samples: int,
        max_new_tokens: int,
        seed: int,
        interrupt: Interrupt | None = None,
    ) -> None:
        """Queue one group; `interrupt`: force the end of thinking at each sample's budget."""
        if interrupt is not None and interrupt.budget_B.shape[0] != num_samples:
            raise ValueError(f"{interrupt.budget_B.shape[0]} thinking budgets for {num_samples} samples")
        self._queued.append((group_id, tuple(prompt), num_samples, max_new_tokens, seed, interrupt))

    @property
    def num_running(self) -> int:
        """Groups submitted and not yet returned by `poll`."""
        return len(self._queued) + sum(len(r.group_ids) - len(r.emitted) for r in self._running)

    def poll(self, timeout_s: float) -> list[Group]:
        """Start what was submitted, advance every decoding by up to `chunk_tokens` tokens (more
        chunks while nothing has finished and `timeout_s` allows); the groups that finished."""
        self._start_queued()
        deadline = time.monotonic() + timeout_s
        finished: list[Group] = []
        while self._running:
            for running in self._running:
                for _ in range(self.chunk_tokens):
                    if running.decoding.done:
                        break
                    self._advance(running)
                finished += self._take_finished(running)
            self._running = [r for r in self._running if len(r.emitted) < len(r.group_ids)]
            if finished or time.monotonic() >= deadline:
                break
        return finished

    def drop_in_flight(self) -> None:
        self._queued.clear()
        self._running.clear()

    def _start_queued(self) -> None:
        """Queued groups with the same settings (interrupt phrase included) start as one decoding."""
        by_settings: dict[tuple[int, int, object], list[_Item]] = {}
        for item in self._queued:
            phrase = None if item[5] is None else (item[5].close_id, item[5].phrase_ids)
            by_settings.setdefault((item[2], item[3], phrase), []).append(item)
        self._queued.clear()
        self._running += [self._start(items, greedy=False) for items in by_settings.values()]

    def _start(self, items: list[_Item], greedy: bool) -> _Running:
        _, _, num_samples, max_new_tokens, seed, first = items[0]
        prompts = [prompt for _, prompt, *_ in items]
        interrupt = None
        if first is not None:
            budget_B = torch.cat([item[5].budget_B for item in items if item[5] is not None])
            interrupt = Interrupt(first.close_id, first.phrase_ids, budget_B)
        prompt_ids_BP, prompt_mask_BP = left_pad(prompts, num_samples, self.pad_id, self.device)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        decoding = Decoding(
            prompt_ids_BP,
            Sampling(
                max_new_tokens=max_new_tokens,
                eos_id=self.eos_id,
                pad_id=self.pad_id,
                generator=generator,
                greedy=greedy,
                prompt_mask_BP=prompt_mask_BP,
                interrupt=interrupt,
            ),
        )
        version_end_B = torch.full((prompt_ids_BP.shape[0],), self.version, dtype=torch.long)
        return _Running(decoding, [g for g, *_ in items], prompts, num_samples, self.version, version_end_B)

    def _advance(self, running: _Running) -> None:
        alive_B = running.decoding.advance(self.model).cpu()
        running.version_end_B[alive_B] = self.version
        self.num_generated_tokens += int(alive_B.sum())

    def _take_finished(self, running: _Running) -> list[Group]:
        """Groups all of whose rows have ended (EOS, or the cap for the whole decoding)."""
        done_B = running.decoding.done_B.cpu() | running.decoding.done
        out = []
        for i, group_id in enumerate(running.group_ids):
            rows = slice(i * running.num_samples, (i + 1) * running.num_samples)
            if group_id not in running.emitted and bool(done_B[rows].all()):
                running.emitted.add(group_id)
                out.append(self._group_of(running, i))
        return out

    def _group_of(self, running: _Running, index: int) -> Group:
        completions = running.decoding.completions()
        tokens, logps = completions.tokens_BT.tolist(), completions.logp_BT.tolist()
        lengths, finished = completions.lengths_B.tolist(), completions.finished_B.tolist()
        forced = None if completions.forced_BT is None else completions.forced_BT.tolist()
        samples = []
        for row in range(index * running.num_samples, (index + 1) * running.num_samples):
            n = lengths[row]
            forced_at = () if forced is None else tuple(i for i, f in enumerate(forced[row][:n]) if f)
            samples.append(
                Sample(
                    token_ids=tuple(tokens[row][:n]),
                    logprobs=tuple(logps[row][:n]),
                    finished=bool(finished[row]),
                    version_start=running.version_start,
                    version_end=int(running.version_end_B[row]),
                    forced=forced_at,
                )
            )
        return Group(running.group_ids[index], running.prompts[index], tuple(samples))

    # -- weights -----------------------------------------------------------------------------

    def join_weight_group(self, spec: WeightGroupSpec, generator_index: int) -> None:
        """Join the run's weight group as generator `generator_index` (collective with the sender)."""
        self._group = init_weight_group(spec, generator_rank(generator_index))

    def receive_weights(self, version: int, meta: WeightMeta) -> None:
        """Take trainer rank 0's broadcast of `version`; running decodings continue on it."""
        if self._group is None:
            raise RuntimeError("receive_weights before join_weight_group: this generator is in no weight group")
        self.load_weights(receive_into(self._group, meta, device=self.device), version=version)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy each tensor into the model's own (in place: KV caches and references stay valid)."""
        own = self.model.state_dict()
        for name, tensor in weights:
            if name not in own:
                raise KeyError(f"pushed weight {name!r} is not in the generator's model")
            own[name].copy_(tensor)
        self.version = version

    def close(self) -> None:
        self.drop_in_flight()
        self._group = None


def left_pad(
    prompts: Sequence[Sequence[int]], repeats: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt ids, each prompt repeated `repeats` times, left-padded to the longest; the mask of
    real tokens, or None when all prompts have one length (the sampler then needs no mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = True
    ids, mask = ids.repeat_interleave(repeats, dim=0).to(device), mask.repeat_interleave(repeats, dim=0).to(device)
    return ids, (None if bool(mask.all()) else mask)
