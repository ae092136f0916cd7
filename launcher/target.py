"""Where a sweep's runs will run, and what their jobs would refuse there, checked at `sweep launch`.

A job resolves `engine.generator: auto` / `engine.trainer: auto` (and `model.dtype: auto`) for the
machine it lands on: vLLM, DeepSpeed and bf16 on a GPU node, torch and fp32 on a CPU. `sweep
launch` resolves them the same way for the *target* (`Target`): a Slurm sweep whose resources (or
profile) set `gpus_per_node` runs on GPU nodes; the local and debug executors run on this machine,
a GPU target where it shows an NVIDIA device (or the sweep asks for GPUs). Then every check the
job would apply to that resolution runs here, before anything is registered, one line each
(`GridError`: file, key, value, what is allowed):

- the local executors' layouts: one node; `--cluster debug` runs one task in this process;
- the resolved engines importable in the job's Python;
- forced interruption (`length.control: interrupt`) where it can fire: a task with a thinking phase,
  room for the phrase and the answer below the cap;
- trainer ranks sharing a GPU (NCCL refuses two ranks of its group on one device);
- `budget.gpu_hours` on a CPU target (it spends none, so the budget would never be reached).

Torch-free (the control plane): engines are looked up with `importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.grid import GridError, RunPlan, SweepSpec
import recipe.config as recipe_config
from recipe.config import SORT6_MAX_NEW_TOKENS, RecipeConfig

ENGINE_PACKAGES = {"vllm": "vllm", "deepspeed": "deepspeed"}


@dataclass(frozen=True)
class Target:
    """The machines one sweep's jobs run on."""

    executor: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int

    @property
    def has_gpus(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def words(self) -> str:
        where = f"{self.gpus_per_node} GPU(s) per node" if self.has_gpus else "CPU only"
        return f"{self.executor} target, {self.nodes} node(s) x {self.tasks_per_node} task(s), {where}"

    @classmethod
    def of(cls, spec: SweepSpec, executor: str) -> Target:
        resources = spec.resources
        gpus = int(resources.get("gpus_per_node") or 0)
        if executor in ("local", "debug") and not gpus:
            gpus = local_gpu_count()
        return cls(executor, int(resources.get("nodes") or 1), int(resources.get("tasks_per_node") or 1), gpus)

    # -- what `auto` becomes here, as the job resolves it -----------------------------------------

    def generator(self, config: RecipeConfig) -> str:
        requested = config.engine.generator
        return ("vllm" if self.has_gpus else "torch") if requested == "auto" else requested

    def trainer(self, config: RecipeConfig) -> str:
        requested = config.engine.trainer
        return ("deepspeed" if self.has_gpus else "torch") if requested == "auto" else requested

    def dtype(self, config: RecipeConfig) -> str:
        """`model.dtype` as both sides of the run use it (one resolution for trainer and generators)."""
        return recipe_config.resolve_dtype(config.model.dtype, gpu=self.has_gpus)

    def resolved(self, config: RecipeConfig) -> dict[str, str]:
        return {
            "engine.generator": self.generator(config),
            "engine.trainer": self.trainer(config),
            "model.dtype": self.dtype(config),
        }


def local_gpu_count() -> int:
    """NVIDIA devices this machine shows (torch-free: the driver's device files)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = len([p for p in Path("/dev").glob("nvidia[0-9]*")])
    if visible is not None:
        return min(devices, len([d for d in visible.split(",") if d.strip()]))
    return devices


# ---------------------------------------------------------------------------------------------
# The checks: each takes the sweep, the target and one run's config; raises GridError or returns.


def check_local_layout(spec: SweepSpec, target: Target, config: RecipeConfig) -> None:
    if target.executor in ("local", "debug") and target.nodes > 1:
        raise GridError(
            spec.path, "resources.nodes", f"{target.nodes} with --cluster {target.executor}: the local executors run "
            "on this one machine; use 1 node, or --cluster slurm"
        )  # fmt: skip
    if target.executor == "debug" and target.tasks_per_node > 1:
        raise GridError(
            spec.path, "resources.tasks_per_node", f"{target.tasks_per_node} with --cluster debug: debug runs one task "
            "in this process; use --cluster local for runs of several tasks"
        )  # fmt: skip


def check_engines_importable(spec: SweepSpec, target: Target, config: RecipeConfig) -> None:
    for key, resolved in (("engine.generator", target.generator(config)), ("engine.trainer", target.trainer(config))):
        package = ENGINE_PACKAGES.get(resolved)
        if package is None or importlib.util.find_spec(package) is not None:
            continue
        requested = config.get(key)
        how = f"{requested!r} (resolved to {resolved!r} on this {target.words})" if requested != resolved else repr(resolved)
        raise GridError(
            spec.path, key, f"{how} needs the {package!r} package, which this Python cannot import; install it "
            "(pip install -e '.[gpu]') or choose 'torch'"
        )  # fmt: skip


def check_interrupt(spec: SweepSpec, target: Target, config: RecipeConfig) -> None:
    """The job's `recipe.loop.checks.generation_cap` / `interrupt_rule` for the built-in tasks (math-jsonl's
    phrase length depends on the model's tokenizer: the job checks it)."""
    length = config.length
    if length.control != "interrupt":
        return
    if config.data.task == "sort6":
        cap = min(SORT6_MAX_NEW_TOKENS, length.max_new_tokens)
        if length.interrupt_min < cap:
            raise GridError(
                spec.path, "length.interrupt_min", f"{length.interrupt_min} with length.control=interrupt on sort6, which "
                f"has no thinking phase to interrupt: raise it to >= {cap} (never fires) or use length.control=penalty "
                "or none"
            )  # fmt: skip
    # sumk's room for the answer is a config rule (`recipe.config.check_task_rules`): refused when
    # the sweep is expanded, before this check.


def check_gpu_sharing(spec: SweepSpec, target: Target, config: RecipeConfig) -> None:
    if not target.has_gpus:
        return
    trainers_per_node = min(target.tasks_per_node, target.nodes * target.tasks_per_node - config.engine.generator_ranks)
    if trainers_per_node > target.gpus_per_node:
        raise GridError(
            spec.path, "resources.tasks_per_node", f"{target.tasks_per_node} with resources.gpus_per_node="
            f"{target.gpus_per_node}: {trainers_per_node} trainer ranks would share {target.gpus_per_node} GPU(s), which "
            "NCCL refuses; at most one trainer task per GPU"
        )  # fmt: skip


def check_gpu_hours(spec: SweepSpec, target: Target, config: RecipeConfig) -> None:
    if config.budget.gpu_hours is not None and not target.has_gpus:
        raise GridError(
            spec.path, "budget.gpu_hours", f"{config.budget.gpu_hours} on a CPU-only {target.executor} target: a job "
            "without GPUs spends no GPU-hours, so this budget is never reached; use budget.steps or budget.flops, or "
            "a profile with gpus_per_node"
        )  # fmt: skip


TARGET_CHECKS: tuple[Callable[[SweepSpec, Target, RecipeConfig], None], ...] = (
    check_local_layout,
    check_engines_importable,
    check_interrupt,
    check_gpu_sharing,
    check_gpu_hours,
)


def check_target(spec: SweepSpec, plans: Sequence[RunPlan], executor: str) -> Target:
    """Every target check on every run's config (each distinct config once); the target."""
    target = Target.of(spec, executor)
    seen: set[tuple[object, ...]] = set()
    for plan in plans:
        c = plan.config
        shape = (repr(c.engine), repr(c.length), c.data.task, c.data.sumk_max_digits, c.budget.gpu_hours, c.model.dtype)
        if shape in seen:
            continue
        seen.add(shape)
        for check in TARGET_CHECKS:
            check(spec, target, c)
    return target
