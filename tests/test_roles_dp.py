"""Data-parallel trainer ranks: the loss, the gradient and the step are the whole batch's, whatever
the split. Two real gloo processes against one process on the whole batch, for every loss type
and aggregation, and a split that leaves one rank nothing to train on."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_batch, tiny_model

from recipe.config import LossConfig
from recipe.engines.torch_trainer import TorchTrainer
from recipe.pipeline.rendezvous import free_port

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CASES = [
    *itertools.product(["cispo", "dapo", "grpo", "gspo"], ["prompt", "sample", "token"], [5]),
    ("cispo", "prompt", 1),
]
"""(loss type, aggregation, number of groups): one group over two ranks leaves rank 1 empty."""
GROUP_SIZE = 3


def one_step(
    loss_type: str, aggregation: str, num_groups: int
) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
    """The step's metrics, the summed gradients and the weights after the step, on this rank."""
    model = tiny_model()
    # SGD, not AdamW: Adam's update is ~lr * sign(g) for tiny g, so fp32 rounding of a near-zero
    # gradient could flip a weight's update; SGD's update is the clipped gradient itself.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = LossConfig(type=loss_type, aggregation=aggregation, gspo_clip_low=0.2, gspo_clip_high=0.2)
    trainer = TorchTrainer(model, optimizer, cfg, max_grad_norm=1.0)
    metrics = trainer.step(random_batch(num_groups), lr=1e-2)
    return metrics, [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # numpy, not tensors: torch would share tensors through file descriptors of a process that exits
        steps = [one_step(*case) for case in CASES]
        results.put((rank, [(m, [g.numpy() for g in gs], [w.numpy() for w in ws]) for m, gs, ws in steps]))
    finally:
        dist.destroy_process_group()


def relative_error(got: list, want: list[torch.Tensor]) -> float:
    diff = torch.cat([(torch.from_numpy(g) - w).flatten() for g, w in zip(got, want)])
    return float(diff.norm() / torch.cat([w.flatten() for w in want]).norm())


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, list]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_two_trainer_ranks_take_the_whole_batch_step(two_ranks, case):
    expected_metrics, expected_grads, expected_weights = one_step(*CASES[case])
    for rank in (0, 1):
        metrics, grads, weights = two_ranks[rank][case]
        assert metrics.keys() == expected_metrics.keys()
        for key, value in expected_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, key)
        # fp32 sums in another order: equal to ~1e-7 of the gradient's norm (measured: < 1e-7)
        assert relative_error(grads, expected_grads) < 1e-5, rank
        for got, want in zip(weights, expected_weights):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in expected_grads)


def test_each_rank_trains_on_whole_groups_and_every_group_once():
    batch = random_batch(num_groups=5)
    for world_size in (1, 2, 3, 7):
        shares = [batch.group_rows(rank, world_size) for rank in range(world_size)]
        assert shares[0].start == 0 and shares[-1].stop == 5 * GROUP_SIZE
        assert all(a.stop == b.start for a, b in zip(shares, shares[1:]))
        assert all((s.stop - s.start) % GROUP_SIZE == 0 for s in shares)
        sizes = [(s.stop - s.start) // GROUP_SIZE for s in shares]
        assert max(sizes) - min(sizes) <= 1
