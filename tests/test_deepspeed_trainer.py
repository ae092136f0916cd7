"""The DeepSpeed trainer (`engine.trainer: deepspeed`) on CPU: two real gloo ranks under ZeRO 0, 1
and 2 take the torch trainer's one-process steps, their checkpoint, gathered on rank 0 only, is the
torch trainer's and resumes like it on both ranks from the file (a bf16 model's too, from its fp32
masters); a run through the real job path
(`sweep launch`, local executor) completes with its eval points, and continued from a checkpoint
equals an uninterrupted run; on the dev Slurm cluster a grid over the ZeRO stages completes, and
one job of two DeepSpeed trainer ranks and a generator resumes from its checkpoint. Skipped, with
the reason, where deepspeed is not installed."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import require_module

require_module("deepspeed")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from conftest import gather_ranks, random_batch, tiny_model  # noqa: E402

from recipe.config import ConfigError, NotAvailableError, resolve  # noqa: E402
from recipe.engines.base import TrainBatch  # noqa: E402
from recipe.loop import checkpoint  # noqa: E402
from recipe.loop.checks import check_engine  # noqa: E402
from recipe.loop.state import build_optimizer, build_trainer  # noqa: E402
from recipe.loop.train import TrainOutcome, train  # noqa: E402
from recipe.model.precision import upcast_lm_head  # noqa: E402
from recipe.pipeline.rendezvous import free_port  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
GROUP_SIZE = 3
STAGES = (0, 1, 2)
LR = 1e-2
CFG = {"optim.lr": LR, "optim.weight_decay": 0.1, "optim.max_grad_norm": 1.0, "loss.type": "cispo"}
BATCHES = [(5, 7), (1, 8)]
"""(groups, seed) of the steps before the checkpoint: 5 groups split 3 + 2 over two ranks; one
group leaves rank 1 an empty share. The resumed step trains on `RESUMED`."""
RESUMED = (4, 9)


def make_trainer(engine: str, stage: int = 2, bf16: bool = False):
    """The trainer `recipe.loop.state.build_trainer` builds for `engine` (AdamW from `build_optimizer`);
    `bf16`: bf16 weights with the FP32 LM head (what `recipe.model.policy.load_policy` makes on GPU), and
    one fp32 parameter besides (the final norm's), so that the model holds two dtypes."""
    cfg = resolve(CFG | {"engine.trainer": engine, "engine.zero_stage": stage})
    model = tiny_model()
    if bf16:
        upcast_lm_head(model.to(torch.bfloat16)).model.norm.float()
    return build_trainer(cfg, model, build_optimizer(cfg, model))


def trajectory(engine: str, stage: int = 2, bf16: bool = False, file: Path | None = None) -> dict:
    """Steps on BATCHES and the checkpoint state; then one more step on RESUMED, by this trainer
    (continued) and by a fresh one resumed from the checkpoint (resumed). With two ranks (`file`):
    rank 0 writes the state there, and every rank resumes from that file as `recipe.pipeline`'s
    followers do (`checkpoint.read_trainer_state`); the state is rank 0's (None on rank 1)."""
    trainer = make_trainer(engine, stage, bf16)
    metrics = [trainer.step(random_batch(*b), lr=LR) for b in BATCHES]
    weights = {k: v.clone() for k, v in trainer.named_weights()}
    state = copy.deepcopy(trainer.state_dict())
    trainer.step(random_batch(*RESUMED), lr=LR)
    resumed = make_trainer(engine, stage, bf16)
    if file is not None:
        if state is not None:
            torch.save(state, file)
        dist.barrier()
        loaded = checkpoint.read_trainer_state(file)
        dist.barrier()
    else:
        loaded = copy.deepcopy(state)
    resumed.check_state(loaded)
    resumed.load_state_dict(loaded, path=file)
    resumed.step(random_batch(*RESUMED), lr=LR)
    return {
        "metrics": metrics,
        "weights": weights,
        "state": state,
        "continued": dict(trainer.named_weights()),
        "resumed": dict(resumed.named_weights()),
    }


def _numpy(tree):
    """Tensors as numpy arrays: torch would share tensors through file descriptors of a process that exits."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().numpy().copy()
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_numpy(v) for v in tree]
    return tree


def _torch(tree):
    if hasattr(tree, "dtype") and hasattr(tree, "shape") and not isinstance(tree, torch.Tensor):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {k: _torch(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_torch(v) for v in tree]
    return tree


def _rank(rank: int, port: int, directory: Path, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fp32 = {s: _numpy(trajectory("deepspeed", s, file=directory / f"fp32-{s}.pt")) for s in STAGES}
        bf16 = {
            s: _numpy(_without_bf16(trajectory("deepspeed", s, bf16=True, file=directory / f"bf16-{s}.pt")))
            for s in STAGES
        }
        results.put((rank, {"fp32": fp32, "bf16": bf16}))
    finally:
        dist.destroy_process_group()


def _without_bf16(tree):
    """bf16 tensors as fp32 (exactly), for numpy."""
    if isinstance(tree, torch.Tensor):
        return tree.float() if tree.dtype == torch.bfloat16 else tree
    if isinstance(tree, dict):
        return {k: _without_bf16(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_without_bf16(v) for v in tree]
    return tree


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, directory = free_port(), tmp_path_factory.mktemp("ds-checkpoints")
    procs = [ctx.Process(target=_rank, args=(rank, port, directory, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    return gather_ranks(procs, results, _torch)


@pytest.fixture(scope="module")
def torch_one_process() -> dict:
    return trajectory("torch")


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[k].float() - w.float()).flatten() for k, w in want.items()])
    return float(diff.norm() / torch.cat([w.float().flatten() for w in want.values()]).norm())


@pytest.mark.parametrize("stage", STAGES)
def test_two_zero_ranks_take_the_torch_trainers_one_process_steps(two_ranks, torch_one_process, stage):
    want = torch_one_process
    for rank in (0, 1):
        got = two_ranks[rank]["fp32"][stage]
        for step, (m, w) in enumerate(zip(got["metrics"], want["metrics"])):
            assert m.keys() == w.keys()
            for key, value in w.items():
                assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, step, key)
        # fp32 sums in another order, then AdamW: within 1e-6 of each weight (measured: <= 2.1e-7;
        # averaging instead of summing the ranks' gradients is off by ~5e-4)
        for name, value in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
        assert not all(torch.equal(want["weights"][k], v) for k, v in tiny_model().state_dict().items())


@pytest.mark.parametrize("stage", STAGES)
def test_the_gathered_checkpoint_is_the_torch_trainers_and_resumes_like_it(two_ranks, torch_one_process, stage):
    """Gathered on trainer rank 0 only (rank 1 returns None); both ranks resume from rank 0's file."""
    want = torch_one_process["state"]["optimizer"]
    assert two_ranks[1]["fp32"][stage]["state"] is None
    got = two_ranks[0]["fp32"][stage]["state"]["optimizer"]
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == list(range(len(want["state"])))
    for i, slots in want["state"].items():
        assert set(got["state"][i]) == set(slots)
        assert float(got["state"][i]["step"]) == float(slots["step"]) == len(BATCHES)
    for key in ("exp_avg", "exp_avg_sq"):  # (measured: < 3e-7)
        got_key = {str(i): s[key] for i, s in got["state"].items()}
        want_key = {str(i): s[key] for i, s in want["state"].items()}
        assert relative_error(got_key, want_key) < 1e-5, key
    for rank in (0, 1):
        resumed = two_ranks[rank]["fp32"][stage]["resumed"]
        assert relative_error(resumed, torch_one_process["resumed"]) < 1e-6, rank  # (measured: < 8e-8)
        continued = two_ranks[rank]["fp32"][stage]["continued"]
        assert all(torch.equal(resumed[k], v) for k, v in continued.items()), rank  # resumed: exactly as continued


@pytest.mark.parametrize("stage", STAGES)
def test_a_bf16_model_resumes_exactly_from_its_gathered_checkpoint(two_ranks, stage):
    """Stage 0 steps fp32 masters of the bf16 weights as the torch trainer does
    (`recipe.engines.mixed_precision`); ZeRO 1/2 step fp32 master shards, one flat group per dtype.
    The checkpoint carries each bf16 parameter's `master` either way."""
    for rank in (0, 1):
        got = two_ranks[rank]["bf16"][stage]
        for name, value in got["continued"].items():
            assert torch.equal(got["resumed"][name], value), (rank, name)
        assert not all(torch.equal(got["weights"][k], v) for k, v in got["continued"].items())
    slots = two_ranks[0]["bf16"][stage]["state"]["optimizer"]["state"]
    has_master = [i for i, s in slots.items() if "master" in s]
    assert has_master and len(has_master) < len(slots)  # not the fp32 norm
    assert all(slots[i]["master"].dtype == torch.float32 for i in has_master)
    for name, value in two_ranks[0]["bf16"][stage]["continued"].items():
        assert torch.equal(two_ranks[1]["bf16"][stage]["continued"][name], value), name


def test_a_torch_checkpoint_resumes_on_the_deepspeed_trainer_and_back(torch_one_process):
    """One process, no group yet: the trainer makes and leaves its own; the checkpoint format is shared."""
    assert not dist.is_initialized()
    trainer = make_trainer("deepspeed", 2)
    assert dist.is_initialized() and dist.get_world_size() == 1
    trainer.check_state(torch_one_process["state"])
    trainer.load_state_dict(copy.deepcopy(torch_one_process["state"]))
    trainer.step(random_batch(*RESUMED), lr=LR)
    assert relative_error(dict(trainer.named_weights()), torch_one_process["resumed"]) < 1e-6
    state = copy.deepcopy(trainer.state_dict())
    trainer.close()
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ

    back = make_trainer("torch")
    back.check_state(state)
    back.load_state_dict(state)
    with pytest.raises(ValueError, match="shape"):
        trainer.check_state({"model": {k: v[:1] for k, v in state["model"].items()}, "optimizer": state["optimizer"]})
    make_trainer("deepspeed", 0).close()  # a second trainer in the same process makes its group again


def test_fast_kernels_leave_the_deepspeed_trainer_as_it_is(monkeypatch):
    """engine.kernels fast and compiled are the torch trainer's: the DeepSpeed trainer shares no
    prompt, compiles nothing and keeps its unfused AdamW, so the step is the reference step, bit
    for bit, not a partial mix."""
    from recipe.model import lean

    calls = []
    shared = lean.LeanLlama.shared_prefix_logits
    monkeypatch.setattr(lean.LeanLlama, "shared_prefix_logits", lambda *a, **k: calls.append(1) or shared(*a, **k))
    batch = random_batch(4, 11)
    grouped = batch.prompt_ids_BP[::GROUP_SIZE].repeat_interleave(GROUP_SIZE, 0)  # a group's rows share a prompt
    batch = TrainBatch(**{**vars(batch), "prompt_ids_BP": grouped})
    weights = {}
    for kernels in ("reference", "fast", "compiled"):
        cfg = resolve(CFG | {"engine.trainer": "deepspeed", "engine.zero_stage": 0, "engine.kernels": kernels})
        model = tiny_model()
        trainer = build_trainer(cfg, model, build_optimizer(cfg, model))
        assert not trainer.optimizer.defaults["fused"]
        trainer.step(batch, lr=LR)
        weights[kernels] = {k: v.clone() for k, v in trainer.named_weights()}
        trainer.close()
    assert not calls
    for kernels in ("fast", "compiled"):
        assert all(torch.equal(weights[kernels][k], w) for k, w in weights["reference"].items())


def test_a_one_task_run_trains_and_leaves_no_process_group(tmp_path_factory, tmp_path):
    """`train` in this process: the trainer's own one-rank group is gone when it returns."""
    from conftest import small_recipe

    from recipe.tasks import builtin
    from recipe.telemetry.sinks import MemorySink

    base = builtin.WarmupRecipe(num_steps=100, lr=1e-3, label_smoothing=0.0)
    model_dir = builtin.builtin_model_dir("sort6-test", base, tmp_path_factory.mktemp("cache"), lambda _: None)
    sink = MemorySink()
    cfg = small_recipe(model_dir, **{"engine.trainer": "deepspeed", "budget.steps": 2})
    outcome = train(cfg, tmp_path, sink, log=lambda _: None)
    assert outcome == TrainOutcome(final_step=2, state="completed", resumed_from_step=None)
    assert sorted(sink.eval_points) == [0, 1, 2] and sorted(sink.checkpoints) == [2]
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ


def test_zero_stage_3_and_a_missing_package_are_refused_before_any_work(monkeypatch):
    with pytest.raises(ConfigError, match=r"^engine.zero_stage: invalid value 3; allowed: one of 0, 1, 2$"):
        resolve({"engine.trainer": "deepspeed", "engine.zero_stage": 3})
    check_engine(resolve({"engine.trainer": "deepspeed", "engine.zero_stage": 2}))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a)
    )
    with pytest.raises(NotAvailableError, match="engine.trainer='deepspeed'.*cannot import"):
        check_engine(resolve({"engine.trainer": "deepspeed"}))


# ---------------------------------------------------------------------------------------------
# The real job path: `sweep launch`, the local executor, one job process per run


RUN = """\
name: {name}
recipe:
  engine: {{trainer: deepspeed, zero_stage: 2}}
  batch: {{prompts: 4, generations: 4}}
  optim: {{lr: 3.0e-4, warmup_steps: 2}}
  eval: {{every: 4, samples: 2}}
  data: {{num_valid_prompts: 16}}
  checkpoint: {{every: 3}}
budget: {{steps: {steps}}}
"""


def sweep(db: str, *args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from launcher.cli import cli

    result = CliRunner().invoke(cli, ["--db", db, *args], terminal_width=200)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def launch(db: str, sweep_file, name: str, steps: int, *extra: str) -> None:
    grid = sweep_file(RUN.format(name=name, steps=steps), name=f"{name}.yaml")
    code, out = sweep(db, "launch", str(grid), *extra, "--cluster", "local", "--max-parallel", "2", "--wait")
    assert code == 0, out


def only_run(db: str, name: str) -> dict:
    code, out = sweep(db, "status", name, "--json")
    assert code == 0, out
    (run,) = json.loads(out)["runs"]
    return run


@pytest.mark.slow
def test_a_deepspeed_run_completes_through_the_job_path_and_resumes_like_an_uninterrupted_one(sweep_file, sqlite_url):
    from store import Store

    launch(sqlite_url, sweep_file, "straight", 6)
    launch(sqlite_url, sweep_file, "split", 3)
    launch(sqlite_url, sweep_file, "split", 3, "budget.steps=6")  # the same run, continued from its checkpoint
    store = Store(sqlite_url)
    straight, split = only_run(sqlite_url, "straight"), only_run(sqlite_url, "split")
    assert straight["state"] == split["state"] == "completed" and straight["step"] == split["step"] == 6
    assert [a.resumed_from_step for a in store.attempts(split["run"])] == [None, 3]
    points = {r["run"]: {p.step: p for p in store.eval_points(r["run"])} for r in (straight, split)}
    assert sorted(points[straight["run"]]) == [0, 1, 2, 4, 6]
    assert sorted(points[split["run"]]) == [0, 1, 2, 3, 4, 6]  # 3: the first attempt's last step
    for step, want in points[straight["run"]].items():
        got = points[split["run"]][step]
        assert (got.pass_rate, got.flops, got.tokens) == (want.pass_rate, want.flops, want.tokens), step
    final = [
        torch.load(checkpoint.checkpoint_path(Path(r["run_dir"]), 6), weights_only=True) for r in (straight, split)
    ]
    for name, value in final[0]["model"].items():
        assert torch.equal(final[1]["model"][name], value), name
    for i, slots in final[0]["optimizer"]["state"].items():
        assert all(torch.equal(final[1]["optimizer"]["state"][i][k], v) for k, v in slots.items()), i
    for run in (straight, split):
        log = Path(run["stdout"]).read_text() + Path(run["stderr"]).read_text()
        assert "shm_comm" not in log, "DeepSpeed built its shm comm op"  # what skip_shm_comm_build prevents


# ---------------------------------------------------------------------------------------------
# The dev Slurm cluster (hold /tmp/slurm.lock when running these: flock /tmp/slurm.lock pytest ...)


SLURM_RUN = """\
name: {name}
recipe:
  engine: {{trainer: deepspeed, generator_ranks: {generator_ranks}}}
  async: {{mode: pipeline, max_lag: 2}}
  batch: {{prompts: 4, generations: 4}}
  optim: {{lr: 3.0e-4, warmup_steps: 0}}
  eval: {{every: 4, samples: 2}}
  data: {{num_valid_prompts: 16}}
  checkpoint: {{every: 3}}
resources: {{nodes: 1, tasks_per_node: {tasks}}}
{grid}
budget: {{steps: {steps}}}
"""


@pytest.fixture
def slurm_queue(slurm_cluster, own_slurm_queue):
    """The dev cluster, with no job of this test session in the queue before and after the test."""


from test_slurm import slurm_cluster  # noqa: E402, F401 - the session fixture that brings the cluster up


@pytest.mark.slurm
@pytest.mark.slow
def test_a_deepspeed_grid_over_zero_stages_completes_on_slurm(slurm_queue, sweep_file, sqlite_url):
    from test_slurm import assert_clean_curve, wait_ended

    from store import Store

    text = SLURM_RUN.format(
        name="ds-grid", generator_ranks=0, tasks=1, steps=8, grid="grid:\n  engine.zero_stage: [0, 1, 2]"
    )
    code, out = sweep(sqlite_url, "launch", str(sweep_file(text)), "--cluster", "slurm")
    assert code == 0 and "3 runs, 3 new, 3 submitted (slurm)" in out, out
    runs = wait_ended(sqlite_url, "ds-grid", timeout_s=600)
    assert [r["state"] for r in runs] == ["completed"] * 3, runs
    store = Store(sqlite_url)
    for run in runs:
        assert_clean_curve(store, run["run"])


@pytest.mark.slurm
@pytest.mark.slow
def test_two_deepspeed_trainer_ranks_and_a_generator_as_one_slurm_job_resume_from_a_checkpoint(
    slurm_queue, sweep_file, sqlite_url
):
    """2 ZeRO-2 trainer ranks (trainer rank 0 gathers the optimizer shards into the checkpoint) and
    one torch generator rank; the run continued with a larger budget resumes on all three tasks."""
    from test_slurm import assert_clean_curve, wait_ended

    from store import Store

    grid = sweep_file(SLURM_RUN.format(name="ds-tasks", generator_ranks=1, tasks=3, steps=8, grid=""))
    for extra in ([], ["budget.steps=12"]):
        code, out = sweep(sqlite_url, "launch", str(grid), *extra, "--cluster", "slurm")
        assert code == 0 and "1 submitted" in out, out
        (row,) = wait_ended(sqlite_url, "ds-tasks", timeout_s=600)
        assert row["state"] == "completed", row
    store = Store(sqlite_url)
    (run,) = store.runs("ds-tasks")
    attempts = store.attempts(run.id)
    assert [a.state for a in attempts] == ["completed", "completed"]
    assert [a.resumed_from_step for a in attempts] == [None, 8]
    assert_clean_curve(store, run.id)
    saved = torch.load(checkpoint.checkpoint_path(Path(run.run_dir), 12), weights_only=True)
    optimizer = saved["optimizer"]
    assert sorted(optimizer["state"]) == optimizer["param_groups"][0]["params"]  # every parameter's, gathered
    assert all(float(s["step"]) > 0 and s["exp_avg_sq"].abs().sum() > 0 for s in optimizer["state"].values())
