"""`sweep launch` refuses what the job would refuse (launcher/target.py), one line each, for a table
of engine / layout / precision / budget grids on CPU and GPU targets; and for each grid the job's
own checks (recipe.config.check_layout, recipe.loop.checks.check_engine / generation_cap /
interrupt_rule / check_budget) agree: refused at launch, or accepted by the job. GPU rows fake the
GPU in the job's checks (torch.cuda reports devices): they end in `_fake_gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from launcher.grid import GridError, expand, load_sweep
from launcher.preflight import check_plans
from launcher.target import Target, check_target
from recipe.config import ConfigError, NotAvailableError, check_layout, resolve

ROOT = Path(__file__).resolve().parents[1]

CPU = {"tasks_per_node": 1}
GPU1 = {"gpus_per_node": 1, "tasks_per_node": 1}
GPU2 = {"gpus_per_node": 2, "tasks_per_node": 2}

# id, executor, resources, recipe keys, the launch's refusal (the key it names) or None
GRIDS = [
    ("cpu_defaults_sumk", "local", CPU, {}, None),
    ("cpu_pipeline_interrupt_generator_rank", "local", {"tasks_per_node": 2},
     {"engine.generator_ranks": 1, "engine.generator": "torch"}, None),
    ("cpu_vllm_generator_rank", "local", {"tasks_per_node": 2},
     {"engine.generator_ranks": 1, "engine.generator": "vllm"}, None),
    ("cpu_vllm_colocated_in_one_task", "local", CPU, {"engine.generator": "vllm"}, None),
    ("cpu_two_nodes_locally", "local", {"nodes": 2, "tasks_per_node": 1},
     {"engine.generator_ranks": 1}, "resources.nodes"),
    ("debug_two_tasks", "debug", {"tasks_per_node": 2}, {"engine.generator_ranks": 1}, "resources.tasks_per_node"),
    ("cpu_gpu_hours", "local", CPU, {"budget.gpu_hours": 10.0}, "budget.gpu_hours"),
    ("cpu_interrupt_without_room", "local", CPU,
     {"length.interrupt_min": 6, "length.interrupt_max": 12}, "length.interrupt_max"),
    ("cpu_sort6_interrupt", "local", CPU, {"data.task": "sort6", "model.path": "builtin:sort6-tiny",
     "length.interrupt_min": 3, "length.interrupt_max": 5}, "length.interrupt_min"),
    ("cpu_bf16", "local", CPU, {"model.dtype": "bfloat16"}, None),
    ("cpu_ppo_offpolicy", "local", CPU, {"async.mode": "ppo-offpolicy"}, None),
    ("gpu_defaults_one_task_fake_gpu", "slurm", GPU1, {}, None),  # vLLM colocated in the trainer's task
    ("gpu_torch_generator_one_task_fake_gpu", "slurm", GPU1, {"engine.generator": "torch"}, None),
    ("gpu_vllm_generator_rank_fake_gpu", "slurm", GPU2, {"engine.generator_ranks": 1}, None),
    ("gpu_gpu_hours_fake_gpu", "slurm", GPU2, {"engine.generator_ranks": 1, "budget.gpu_hours": 0.5}, None),
    ("gpu_two_trainers_one_gpu_fake_gpu", "slurm", {"gpus_per_node": 1, "tasks_per_node": 3},
     {"engine.generator_ranks": 1}, "resources.tasks_per_node"),
    ("gpu_bf16_deepspeed_fake_gpu", "slurm", GPU2,
     {"engine.generator_ranks": 1, "model.dtype": "bfloat16", "engine.zero_stage": 2}, None),
]  # fmt: skip

BASE = {
    "model.path": "builtin:sumk-tiny",
    "data.task": "sumk",
    "length.max_new_tokens": 13,
    "length.interrupt_min": 6,
    "length.interrupt_max": 9,
    "budget.steps": 10,
}


def _sweep(tmp_path: Path, resources: dict, keys: dict) -> Path:
    flat = BASE | keys
    recipe = "\n".join(f"  {k}: {v!r}" if isinstance(v, str) else f"  {k}: {v}" for k, v in flat.items())
    res = "\n".join(f"  {k}: {v}" for k, v in resources.items())
    path = tmp_path / "grid.yaml"
    path.write_text(f"name: target-test\nrecipe:\n{recipe}\nresources:\n{res}\n")
    return path


def _plans(path: Path):
    spec = load_sweep(path)
    return spec, expand(spec)


def job_refusal(flat: dict, target: Target, monkeypatch) -> str | None:
    """The key the job's own checks refuse on `target`'s machine, or None where it would run: it
    reads its config (`recipe.config.resolve`), checks the layout of the tasks it got, its engines,
    its budget, and length control on its task and tokenizer."""
    import torch

    from recipe.loop import checks as train
    from recipe.model.policy import build_tokenizer
    from recipe.tasks import sumk as tasks_think
    from recipe.tasks.task import load_task

    monkeypatch.setattr(torch.cuda, "is_available", lambda: target.has_gpus)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: target.gpus_per_node)
    try:
        config = resolve(flat)
        layout = check_layout(config, num_nodes=target.nodes, tasks_per_node=target.tasks_per_node)
        if target.executor in ("local", "debug") and target.nodes > 1:
            return "resources.nodes"  # the local executor starts one node's tasks: the job would wait for ever
        if target.executor == "debug" and target.tasks_per_node > 1:
            return "resources.tasks_per_node"  # one task in this process: the layout check fails in the job
        if target.has_gpus and min(layout.num_trainers, target.tasks_per_node) > target.gpus_per_node:
            return "resources.tasks_per_node"  # NCCL refuses two ranks of one group on one device
        train.check_engine(config)
        gpus = min(layout.num_tasks, target.gpus_per_node * target.nodes)
        train.check_budget(config, gpus)
        if config.budget.gpu_hours is not None and not gpus:
            return "budget.gpu_hours"
        task = load_task(config.data)
        cap = train.generation_cap(config, task, lambda _: None)
        if config.data.task == "sumk":
            tokenizer = build_tokenizer(tasks_think.VOCABULARY, eos=tasks_think.EOS, pad=tasks_think.PAD)
            train.interrupt_rule(config, task, tokenizer, cap, lambda _: None)
    except ConfigError as exc:
        return exc.key
    except NotAvailableError as exc:
        text = str(exc)
        return "length.interrupt_min" if "interrupt" in text else "engine.generator"
    return None


def launch_refusal(path: Path, executor: str) -> GridError | None:
    """What `sweep launch` refuses, in its order: the configs (expand), the target, the plans."""
    try:
        spec = load_sweep(path)
        plans = expand(spec)
        check_target(spec, plans, executor)
        check_plans(spec, plans)
    except GridError as exc:
        return exc
    return None


@pytest.mark.parametrize("name,executor,resources,keys,refused", GRIDS, ids=[g[0] for g in GRIDS])
def test_launch_refuses_exactly_what_the_job_would(name, executor, resources, keys, refused, tmp_path, monkeypatch):
    path = _sweep(tmp_path, resources, keys)
    spec = load_sweep(path)
    target = Target.of(spec, executor)
    if not name.endswith("_fake_gpu") and target.has_gpus:
        pytest.skip("this machine shows a GPU: the CPU rows need a CPU machine")
    error = launch_refusal(path, executor)
    if refused is None:
        assert error is None, str(error)
    else:
        assert error is not None and error.key == refused, str(error)
        assert "\n" not in str(error) and str(error).startswith(f"{spec.path}: {refused}: ")
    assert job_refusal(spec.recipe, target, monkeypatch) == refused  # the job's own checks, on its machine


def test_auto_resolves_for_the_target_as_the_job_does(tmp_path):
    spec, plans = _plans(_sweep(tmp_path, GPU2, {"engine.generator_ranks": 1}))
    gpu = Target.of(spec, "slurm")
    assert gpu.resolved(plans[0].config) == {
        "engine.generator": "vllm", "engine.trainer": "deepspeed", "model.dtype": "bfloat16",
    }  # fmt: skip
    cpu = Target("local", 1, 2, 0)
    assert cpu.resolved(plans[0].config) == {"engine.generator": "torch", "engine.trainer": "torch", "model.dtype": "float32"}


def test_a_refused_launch_prints_one_line_and_registers_nothing(tmp_path):
    path = _sweep(tmp_path, {"gpus_per_node": 1, "tasks_per_node": 3}, {"engine.generator_ranks": 1})
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    result = CliRunner().invoke(cli, ["--db", db, "launch", str(path), "--cluster", "slurm"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "resources.tasks_per_node" in lines[0], lines
    assert "Traceback" not in result.output
    assert not (tmp_path / "db.sqlite").exists() or "target-test" not in (tmp_path / "db.sqlite").read_bytes().decode(
        "latin-1"
    )


def test_the_scalerl_files_pass_every_launch_check(tmp_path):
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    sample = ROOT / "recipe" / "tasks" / "math" / "math_sample.jsonl"
    edits = [f"recipe.model.path={model}", f"recipe.data.train={sample}", f"recipe.data.valid={sample}", "recipe.data.num_valid_prompts=16"]
    gpu = CliRunner().invoke(
        cli, ["launch", str(ROOT / "sweeps" / "scalerl.yaml"), *edits, "--dry-run", "--cluster", "slurm"]
    )
    assert gpu.exit_code == 0, gpu.output
    assert "engine.generator=vllm" in gpu.output and "engine.trainer=deepspeed" in gpu.output
    cpu = CliRunner().invoke(cli, ["launch", str(ROOT / "sweeps" / "scalerl-cpu.yaml"), "--dry-run", "--cluster", "local"])
    assert cpu.exit_code == 0, cpu.output
    assert "engine.generator=torch" in cpu.output


def test_budget_gpu_hours_stops_a_job_that_holds_gpus_fake_gpu(tmp_path, monkeypatch):
    """The job's GPU-hours (device seconds x its GPUs) are its compute axis and stop it; a job
    without GPUs refuses the budget (the launch refused it first, above)."""
    from conftest import small_recipe

    from recipe.loop import state, train
    from recipe.tasks import builtin
    from recipe.telemetry.sinks import MemorySink

    model_dir = builtin.builtin_model_dir(
        "sort6-gpu-hours", builtin.WarmupRecipe(num_steps=5, lr=1e-3, label_smoothing=0.0), tmp_path / "cache",
        lambda _: None,
    )  # fmt: skip
    cfg = small_recipe(model_dir, **{"budget.steps": None, "budget.gpu_hours": 1e-6, "eval.every": 1})
    with pytest.raises(ConfigError, match="budget.gpu_hours: this job holds no GPU"):
        train.train(cfg, tmp_path / "cpu", MemorySink(), log=lambda _: None)
    for module in (state, train):  # four GPUs held (the fake)
        monkeypatch.setattr(module, "job_gpus", lambda team: 4)
    sink = MemorySink()
    outcome = train.train(cfg, tmp_path / "gpu", sink, log=lambda _: None)
    assert outcome.state == "completed" and outcome.final_step >= 1
    last = sink.eval_points[max(sink.eval_points)]
    assert last["gpu_hours"] >= 1e-6
    assert last["gpu_hours"] == pytest.approx(4 * last["device_seconds"] / 3600)
