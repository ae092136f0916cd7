"""The two interfaces every engine implements: a generator and a trainer.

A *generator* samples completions with the behaviour log-prob of every sampled token and loads new
weights; a *trainer* takes one optimizer step on a batch and exports its weights. The run's roles
(`recipe.pipeline`) are the only places that know which engine sits behind them; the step algorithm in
`recipe.loop.train` speaks only these interfaces.

Policy versions: version v = the weights after v optimizer steps. A generator records, per sample,
the version its first token and its last token were generated with (`version_start`,
`version_end`); with in-flight weight updates (PipelineRL) they differ.

Behaviour log-probs are the *processed* log-probs: log softmax of the fp32 logits divided by the
temperature (no top-p/top-k here), the same quantity the trainer computes, so the importance ratio
is 1 up to numerics when the weights agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt."""

    token_ids: tuple[int, ...]
    """The completion's tokens, EOS included when it finished."""
    logprobs: tuple[float, ...]
    """Behaviour (processed) log-prob of each token, one per token."""
    finished: bool
    """True where it ended with EOS; False where the generation cap cut it."""
    version_start: int
    """Policy version that generated the first token."""
    version_end: int
    """Policy version that generated the last token."""
    forced: tuple[int, ...] = ()
    """Positions (in `token_ids`) of the tokens a forced interruption appended instead of sampling
    (`length.control=interrupt`): context for the policy, not its actions."""


@dataclass(frozen=True)
class Group:
    """`num_samples` completions of one prompt, as a generator hands them to the trainers."""

    group_id: str
    prompt_ids: tuple[int, ...]
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class TrainBatch:
    """One optimizer step's data: the whole batch, the same on every trainer rank.

    B rows in whole groups of `group_size` (rows g*G .. g*G+G-1 are group g), only the groups
    the step trains on (after the zero-variance filter and the drop rule). Advantages and the
    aggregation's counts come from the whole batch; a trainer rank computes the loss on its
    `shard` only, so the sum over ranks is the loss of the whole batch whatever the split.
    """

    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor | None
    """Real tokens of left-padded prompts; None when the prompts are unpadded."""
    tokens_BT: torch.Tensor
    behaviour_logp_BT: torch.Tensor
    mask_BT: torch.Tensor
    adv_B: torch.Tensor
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.tokens_BT.shape[0] // self.group_size

    def group_rows(self, rank: int, world_size: int) -> slice:
        """The rows of trainer `rank`'s share: contiguous whole groups, sizes differing by <= 1."""
        base, extra = divmod(self.num_groups, world_size)
        first = rank * base + min(rank, extra)
        last = first + base + (1 if rank < extra else 0)
        return slice(first * self.group_size, last * self.group_size)

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        rows = self.group_rows(rank, world_size)
        mask = None if self.prompt_mask_BP is None else self.prompt_mask_BP[rows]
        return TrainBatch(
            prompt_ids_BP=self.prompt_ids_BP[rows],
            prompt_mask_BP=mask,
            tokens_BT=self.tokens_BT[rows],
            behaviour_logp_BT=self.behaviour_logp_BT[rows],
            mask_BT=self.mask_BT[rows],
            adv_B=self.adv_B[rows],
            group_size=self.group_size,
        )


WeightMeta = tuple[tuple[str, str, tuple[int, ...]], ...]
"""(name, dtype name, shape) of every tensor of one push, in the order they are sent.

The push's wire contract (`recipe.engines.weights`): trainer rank 0 is rank 0 of a weight group
whose generator i is rank 1 + i (its `rank_offset`); it sends the `WeightMeta` to the generators
over the control channel, then broadcasts the tensors in that order from rank 0, packed into
buckets of one dtype (`recipe.engines.weights.buckets`). The
group is gloo on CPU and NCCL on GPU, created outside the trainers' own process group.
"""


class Generator(Protocol):
    """Samples with log-probs; loads weights. Used blocking (alternating mode) or streaming."""

    version: int
    """The policy version of the weights it holds now."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        seed: int,
        greedy: bool = False,
    ) -> list[list[Sample]]:
        """Blocking: `num_samples` completions for every prompt, in prompt order."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """In-process weight load (the generator and the trainer share a process)."""
        ...

    def close(self) -> None: ...


class StreamingGenerator(Generator, Protocol):
    """A generator rank's engine under PipelineRL: requests stream while weights are pushed."""

    poll_timeout_s: float
    """What a generator rank passes to `poll` between two reads of its control channel."""

    def submit(self, group_id: str, prompt: Sequence[int], *, num_samples: int, max_new_tokens: int, seed: int) -> None:
        """Start a group; it continues across weight pushes."""
        ...

    def poll(self, timeout_s: float) -> list[Group]:
        """Groups finished since the last poll (waits at most `timeout_s` for the first)."""
        ...

    def join_weight_group(self, spec: Any, generator_index: int) -> None:
        """Join the run's weight group (`recipe.engines.weights.WeightGroupSpec`) as rank
        1 + `generator_index`, once, before the first push. Collective with trainer rank 0's sender."""
        ...

    def receive_weights(self, version: int, meta: WeightMeta) -> None:
        """Join trainer rank 0's broadcast of the new weights: pause in-flight requests (keep their
        state), load, resume them on the new weights. Collective with `WeightSender.push`."""
        ...

    def drop_in_flight(self) -> None:
        """Abort every running request (preemption: the trainer's checkpoint is the truth)."""
        ...


class WeightSender(Protocol):
    """Trainer rank 0's side of the weight push to the generator ranks."""

    def push(self, weights: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Broadcast the tensors in order (the generators were sent their `WeightMeta` first)."""
        ...

    def close(self) -> None: ...


class Trainer(Protocol):
    """One optimizer step on a batch; weights out for the push; state for checkpoints."""

    def step(self, batch: TrainBatch, *, lr: float) -> dict[str, float]:
        """Loss (aggregated over whole-batch counts, whatever the split across ranks), backward,
        clip, optimizer step; returns the step's metrics (identical on every trainer rank).

        Collective: every trainer rank calls it with the same whole batch (`recipe.pipeline` sends
        it from trainer rank 0) and trains on its `batch.shard(rank, world_size)`. Metrics:
        loss, grad_norm, ratio_mean, ratio_min, ratio_max."""
        ...

    def eval_model(self) -> torch.nn.Module:
        """The policy with its full weights on trainer rank 0, for held-out sampling."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights, on trainer rank 0 (gathered if sharded), for the push."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the trainer: {"model": ..., "optimizer": ...}, on trainer
        rank 0; None on the other ranks, which only join what is collective (gathers of shards)
        and never hold the whole state. Each parameter that is not fp32 carries its fp32 master
        weight in its optimizer slot `master` (`recipe.engines.mixed_precision`)."""
        ...

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError unless a checkpoint's `state` loads into this trainer as it is."""
        ...

    def load_state_dict(self, state: dict[str, Any], *, path: Path | None = None) -> None:
        """Restore a checkpoint's trainer state (`check_state` passed). `path`: the file it was read
        from; trainer rank 0 sends the other ranks that path, never the state
        (`recipe.pipeline.lead.LeadTrainer`)."""
        ...

    def close(self) -> None:
        """Release what the engine made for itself (DeepSpeed's one-rank group in a one-task run)."""
        ...
