"""The weight push over a real gloo group: one trainer process and two generator processes."""

from __future__ import annotations

import queue
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipe.engines.weights import (
    TorchWeightSender,
    buckets,
    WeightGroupSpec,
    generator_rank,
    init_weight_group,
    receive_into,
    weight_checksums,
    weight_meta,
)
from recipe.pipeline.rendezvous import free_port


def collect(results, procs, *, count: int, timeout_s: float = 120) -> list:
    """`count` results, failing at once (not after the timeout) when a process died."""
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"exit codes {dead}, {len(got)}/{count} results"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def make_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [
        ("model.embed.weight", torch.randn(7, 5, generator=g)),
        ("model.layers.0.w", torch.randn(3, 4, generator=g).to(torch.bfloat16)),
        ("model.norm.eps", torch.tensor(float(version))),  # a 0-dim tensor
        ("lm_head.weight", torch.randn(5, 7, generator=g).t()),  # not contiguous on the sender
    ]


def _trainer(spec: WeightGroupSpec, results) -> None:
    # The trainers' own default group exists and must stay what it is.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    sender = TorchWeightSender(spec)
    for version in (1, 2):
        sender.push(make_weights(version), version=version)
    results.put(("trainer", dist.get_world_size(), sender.version))
    sender.close()
    dist.destroy_process_group()


def _generator(spec: WeightGroupSpec, index: int, results) -> None:
    group = init_weight_group(spec, rank=generator_rank(index))
    meta = weight_meta(make_weights(0))  # what the control channel carries: shapes and dtypes only
    for version in (1, 2):
        received = list(receive_into(group, meta))
        results.put(
            (index, version, [n for n, _ in received], weight_checksums(received), [t.dtype for _, t in received])
        )


def test_a_push_reaches_every_generator_bit_for_bit_in_meta_order():
    spec = WeightGroupSpec(host="127.0.0.1", port=free_port(), num_generators=2, timeout_s=60)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(spec, results))]
    procs += [ctx.Process(target=_generator, args=(spec, i, results)) for i in range(2)]
    for p in procs:
        p.start()
    got = collect(results, procs, count=1 + 2 * 2)
    assert ("trainer", 1, 2) in got
    received = {(r[0], r[1]): r[2:] for r in got if r[0] != "trainer"}
    assert set(received) == {(i, v) for i in range(2) for v in (1, 2)}
    for (_, version), (names, checksums, dtypes) in received.items():
        sent = make_weights(version)
        assert names == [n for n, _ in sent]
        assert checksums == weight_checksums(sent)
        assert dtypes == [t.dtype for _, t in sent]
    assert received[(0, 1)][1] != received[(0, 2)][1]  # each push carried its own weights


def test_checksums_tell_one_changed_element():
    a = make_weights(1)
    b = [(n, t.clone()) for n, t in a]
    b[1][1][0, 0] += 1
    ca, cb = weight_checksums(a), weight_checksums(b)
    assert ca.keys() == cb.keys()
    assert [n for n in ca if ca[n] != cb[n]] == ["model.layers.0.w"]


def test_meta_lists_name_dtype_name_and_shape():
    assert weight_meta(make_weights(0))[1:3] == (
        ("model.layers.0.w", "bfloat16", (3, 4)),
        ("model.norm.eps", "float32", ()),
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [({"backend": "mpi"}, "backend must be one of"), ({"num_generators": 0}, "at least one generator")],
)
def test_bad_group_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightGroupSpec(**{"host": "127.0.0.1", "port": 1, "num_generators": 1, **kwargs})


def test_nccl_without_cuda_says_so_gpu_only():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU machines")
    spec = WeightGroupSpec(host="127.0.0.1", port=free_port(), num_generators=1, backend="nccl", timeout_s=5)
    # refused before the store waits on anyone
    with pytest.raises(RuntimeError, match="needs CUDA"):
        init_weight_group(spec, rank=0)


def test_buckets_pack_consecutive_tensors_of_one_dtype_up_to_the_size_bound():
    meta = (
        ("a", "float32", (4, 4)),  # 64 bytes
        ("b", "float32", (8,)),  # 32
        ("c", "bfloat16", (10,)),  # another dtype: a new bucket
        ("d", "bfloat16", ()),  # 0-dim, 2 bytes
        ("e", "float32", (40,)),  # 160 bytes: over the bound, alone
        ("f", "float32", (2,)),
    )
    assert buckets(meta, bucket_bytes=100) == [[0, 1], [2, 3], [4], [5]]
    assert buckets(meta, bucket_bytes=1 << 20) == [[0, 1], [2, 3], [4, 5]]
    assert buckets(meta, bucket_bytes=1) == [[i] for i in range(6)]  # every tensor alone
    assert buckets(()) == []
