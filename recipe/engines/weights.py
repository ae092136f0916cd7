"""The weight push's group and wire: trainer rank 0 broadcasts tensors to every generator rank.

The wire contract (`recipe.engines.base.WeightMeta`):

- One *weight group* per run: trainer rank 0 is its rank 0, generator i is rank 1 + i (the
  generator's `rank_offset`). It is its own process group over its own TCPStore (trainer rank 0
  hosts the store), never the default group, which belongs to the trainers' data parallelism; a
  generator process has no default group at all.
- The group is gloo on CPU and NCCL on GPU (`backend_for`).
- Per push, trainer rank 0 sends the `WeightMeta` (name, dtype, shape of every tensor) over the
  control channel first; then it broadcasts the tensors from rank 0 in meta order, packed into
  buckets: consecutive tensors of one dtype share a flat buffer of at most `BUCKET_BYTES` (a
  larger tensor travels alone), one broadcast per bucket. Both sides cut the buckets from the
  meta alone (`buckets`), so every receiver allocates the same buffers and joins the same
  broadcasts. A small model is one or two broadcasts, not one per tensor (each a round trip on
  gloo); neither side ever holds more than one bucket beyond the model.

The same sender (`TorchWeightSender`) feeds the torch generator (`receive_into` in its process)
and the vLLM generator on CPU (the project's gloo weight-transfer backend in
`recipe.engines.vllm_worker` calls `receive_into` inside vLLM's worker), so one trainer talks to
either engine. vLLM's stock NCCL backend on GPU has its own wire (see `recipe.engines.vllm_engine`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from recipe.engines.base import WeightMeta

BACKENDS = ("gloo", "nccl")
BUCKET_BYTES = 64 << 20
"""The largest flat buffer a push packs tensors into (one broadcast each)."""


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where the weight group meets: trainer rank 0's address, a free port, and its size."""

    host: str
    port: int
    num_generators: int
    backend: str = "gloo"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weight group backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_generators < 1:
            raise ValueError(f"a weight group needs at least one generator, got num_generators={self.num_generators}")

    @property
    def world_size(self) -> int:
        return 1 + self.num_generators


def generator_rank(generator_index: int) -> int:
    """Generator i's rank in the weight group (its `rank_offset`): trainer rank 0 holds rank 0."""
    return 1 + generator_index


def backend_for(device: torch.device | str) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_weight_group(spec: WeightGroupSpec, rank: int) -> dist.ProcessGroup:
    """Join the weight group as `rank` (0: trainer rank 0, which also hosts the store).

    Collective: blocks until all `spec.world_size` ranks have joined (or `spec.timeout_s`). The
    group is built straight from a store, so it needs no default group and leaves the trainers'
    one alone.
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"weight group rank must be in [0, {spec.world_size}), got {rank}")
    if spec.backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError("the nccl weight group needs CUDA and an NCCL-enabled torch; on CPU use backend 'gloo'")
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("scalesweep-weights", store)
    if spec.backend == "gloo":
        group: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
    else:
        group = _nccl_group(prefixed, rank, spec.world_size, timeout)
    return group  # it holds the store (via the prefix store) for as long as it lives


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """GPU only: an NCCL group on the current CUDA device (untested here: no GPU on this machine)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def weight_meta(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightMeta:
    """The push's metadata, in the order the tensors will be broadcast."""
    return tuple((name, dtype_name(t.dtype), tuple(t.shape)) for name, t in named_tensors)


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the name vLLM's `update_weights` takes too."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in weight meta")
    return dtype


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def buckets(meta: WeightMeta, bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """The push's broadcasts: runs of consecutive meta entries of one dtype, each run's bytes
    at most `bucket_bytes` (an entry larger than that is a run of its own)."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, name, shape) in enumerate(meta):
        nbytes = math.prod(shape) * dtype_of(name).itemsize
        if out and name == dtype and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size, dtype = nbytes, name
    return out


class TorchWeightSender:
    """Trainer rank 0's end of the weight group (a `recipe.engines.base.WeightSender`)."""

    def __init__(self, spec: WeightGroupSpec, *, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.group = init_weight_group(spec, rank=0)
        self.version = 0

    def push(self, weights: Sequence[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Broadcast the tensors bucket by bucket; the generators got `weight_meta(weights)` first."""
        for bucket in buckets(weight_meta(weights)):
            tensors = [weights[i][1].detach().to(self.device) for i in bucket]
            flat = tensors[0].contiguous() if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
            _broadcast(self.group, flat)
        self.version = version

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]  # dropping the last reference shuts the group


def receive_into(
    group: dist.ProcessGroup, meta: WeightMeta, *, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """A generator's end of one push: yields each (name, tensor) as its bucket lands (views of
    the bucket's own buffer).

    Lazy: every tensor must be consumed (one broadcast per bucket, in order) or the group hangs;
    the caller loads each tensor as it comes, so a push never holds two copies of the whole model.
    """
    for bucket in buckets(meta):
        entries = [meta[i] for i in bucket]
        sizes = [math.prod(shape) for _, _, shape in entries]
        flat = torch.empty(sum(sizes), dtype=dtype_of(entries[0][1]), device=device)
        _broadcast(group, flat)
        for (name, _, shape), view in zip(entries, flat.split(sizes), strict=True):
            yield name, view.view(shape)


def weight_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """sha256 of each tensor's bytes: equal on both sides iff the push took, bit for bit."""
    return {name: _tensor_sha256(tensor) for name, tensor in named_tensors}


def _tensor_sha256(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()
