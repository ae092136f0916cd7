"""Checkpoints that scale: the whole state is gathered on trainer rank 0 only, and resuming sends
the other ranks the checkpoint's path, never the state.

Two real gloo ranks run DeepSpeed ZeRO-2 trainers behind `recipe.pipeline`'s `LeadTrainer` / `follow`
(the job's own path). Peak resident memory (`VmHWM`, reset through /proc/self/clear_refs) is
measured around the collective `state_dict()`: rank 0 grows by about the gathered state (fp32
exp_avg, exp_avg_sq and masters: 12 bytes per bf16 parameter), rank 1 by at most a few of its
tensors (measured: 95.8 MB on rank 0 for a 94.6 MB state, 4.4 MB on rank 1; before, every rank
kept the whole gathered state). A resume from the file written by rank 0 continues both ranks
exactly as the run that was not interrupted, and what went through the command broadcast for it
was a path (bytes, not MB).
"""

from __future__ import annotations

import ctypes
import os
import pickle
from pathlib import Path

import pytest
from conftest import gather_ranks, require_module

require_module("deepspeed")  # a skip, or a failure under SWEEP_REQUIRE_SERVICES=1
if not Path("/proc/self/clear_refs").exists():
    pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident memory", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from recipe.loop import checkpoint  # noqa: E402
from recipe.loop.state import build_optimizer, build_trainer  # noqa: E402
from recipe.pipeline.lead import LeadTrainer  # noqa: E402
from recipe.pipeline.peer import follow  # noqa: E402
from recipe.pipeline.rendezvous import free_port  # noqa: E402
from recipe.config import resolve  # noqa: E402
from recipe.engines.precision_probe import VOCABULARY, random_batch  # noqa: E402
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer  # noqa: E402
from recipe.model.precision import upcast_lm_head  # noqa: E402

SHAPE = TinyLlamaShape(hidden_size=512, intermediate_size=1024, num_layers=3, num_heads=8, max_positions=16)
"""~8M parameters in tensors of at most 2 MB (fp32): the gathered state is ~95 MB."""
CFG = {"engine.trainer": "deepspeed", "engine.zero_stage": 2, "optim.lr": 1e-3, "optim.max_grad_norm": 1.0}


def zero2_trainer():
    tokenizer = build_tokenizer(VOCABULARY, eos="<eos>", pad="<pad>")
    model = upcast_lm_head(build_tiny_llama(SHAPE, tokenizer, seed=1).to(torch.bfloat16))
    cfg = resolve(CFG)
    return build_trainer(cfg, model, build_optimizer(cfg, model))


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """The peak becomes what is resident now, after the C heap's free memory went back to the OS."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def _rank(rank: int, port: int, directory: Path, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sent: list[tuple[str, int]] = []
    real_broadcast = dist.broadcast_object_list

    def recording(objects, *args, **kwargs):
        if rank == 0:
            sent.append((objects[0][0], len(pickle.dumps(objects))))
        return real_broadcast(objects, *args, **kwargs)

    dist.broadcast_object_list = recording
    try:
        out: dict = {}
        trainer = zero2_trainer()
        lead = LeadTrainer(trainer) if rank == 0 else None
        if rank == 0:
            lead.step(random_batch(4, 0), lr=1e-3)
            reset_peak_rss()
            before = peak_rss_bytes()
            state = lead.state_dict()
            out["state_growth"] = peak_rss_bytes() - before
            out["state_bytes"] = sum(
                t.numel() * t.element_size() for slots in state["optimizer"]["state"].values() for t in slots.values()
                if isinstance(t, torch.Tensor)
            )  # fmt: skip
            path = checkpoint.save(directory, 1, state)
            lead.step(random_batch(4, 1), lr=1e-3)
            lead.stop_followers()
        else:
            collective_state_dict = trainer.state_dict

            def measured_state_dict():
                reset_peak_rss()
                before = peak_rss_bytes()
                state = collective_state_dict()
                out["state_growth"] = peak_rss_bytes() - before
                out["state"] = state
                return state

            trainer.state_dict = measured_state_dict
            follow(trainer)  # step, state_dict, step, stop
        out["continued"] = {k: v.float().numpy().copy() for k, v in trainer.named_weights()}
        trainer.close()

        resumed = zero2_trainer()
        if rank == 0:
            lead = LeadTrainer(resumed)
            path = checkpoint.checkpoint_path(directory, 1)
            saved = checkpoint.read_trainer_state(path)
            resumed.check_state(saved)
            lead.load_state_dict(saved, path=path)
            lead.step(random_batch(4, 1), lr=1e-3)
            lead.stop_followers()
        else:
            follow(resumed)  # load_checkpoint, step, stop
        out["resumed"] = {k: v.float().numpy().copy() for k, v in resumed.named_weights()}
        out["sent"] = sent
        resumed.close()
        results.put((rank, out))
    finally:
        dist.broadcast_object_list = real_broadcast
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    # Every tensor of 64 KB or more in memory of its own, returned to the OS when freed (glibc):
    # resident memory then follows the live tensors, not what the heap keeps for reuse.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by the spawned ranks' C library
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, directory = free_port(), tmp_path_factory.mktemp("run")
    procs = [ctx.Process(target=_rank, args=(rank, port, directory, results)) for rank in (0, 1)]
    try:
        for p in procs:
            p.start()
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    return gather_ranks(procs, results)


def test_only_trainer_rank_0_materialises_the_whole_state(two_ranks):
    full = two_ranks[0]["state_bytes"]
    assert full > 90e6  # fp32 exp_avg, exp_avg_sq and master of ~8M bf16 parameters
    assert two_ranks[1]["state"] is None
    assert two_ranks[0]["state_growth"] > 0.8 * full, two_ranks[0]["state_growth"]
    largest = SHAPE.hidden_size * SHAPE.intermediate_size * 4  # one fp32 tensor
    assert two_ranks[1]["state_growth"] < max(0.1 * full, 8 * largest), two_ranks[1]["state_growth"]


def test_both_ranks_resume_from_rank_0s_file_as_the_uninterrupted_run(two_ranks):
    for rank in (0, 1):
        continued, resumed = two_ranks[rank]["continued"], two_ranks[rank]["resumed"]
        assert continued.keys() == resumed.keys()
        for name, value in continued.items():
            assert (resumed[name] == value).all(), (rank, name)
    for name, value in two_ranks[0]["resumed"].items():
        assert (two_ranks[1]["resumed"][name] == value).all(), name


def test_the_followers_are_sent_the_checkpoints_path_not_its_state(two_ranks):
    sizes = dict(two_ranks[0]["sent"][::-1])  # command -> pickled size (the first of each)
    assert set(sizes) == {"step", "state_dict", "load_checkpoint", "stop"}
    assert sizes["load_checkpoint"] < 1024 and sizes["state_dict"] < 1024, sizes
