"""Launch-time checks of what a run's job will need, so that a missing model directory, data file
or engine is found on the login node at `sweep launch`, not hours later on a GPU node.

Torch-free: engines are looked up with `importlib.util.find_spec` (no import), in the Python
that the job will run (`sys.executable`, the one `sweep launch` runs in and submits with). Every
check raises `GridError` naming the sweep file, the key, the value and what is allowed; checks
run on each distinct value once, before anything is registered.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from launcher.grid import GridError, RunPlan, SweepSpec
from recipe.config import BUILTIN_MODEL_TASKS, ConfigError, RecipeConfig, check_layout

BUILTIN_PREFIX = "builtin:"
ENGINE_MODULES = {("engine.generator", "vllm"): "vllm", ("engine.trainer", "deepspeed"): "deepspeed"}
"""Config values whose engine must be importable in the job's Python."""


def check_plans(spec: SweepSpec, plans: Sequence[RunPlan]) -> None:
    """Every check on every distinct value the runs use."""
    configs = [p.config for p in plans]
    for key, check in CHECKS:
        for value in sorted({str(c.get(key)) for c in configs}):
            check(spec.path, key, value, next(c for c in configs if str(c.get(key)) == value))
    check_layouts(spec, configs)


def check_model_path(sweep_path: str, key: str, value: str, config: RecipeConfig) -> None:
    if value.startswith(BUILTIN_PREFIX):
        if value not in BUILTIN_MODEL_TASKS:
            close = difflib.get_close_matches(value, BUILTIN_MODEL_TASKS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise GridError(sweep_path, key, f"unknown built-in model {value!r}; {hint}allowed: {', '.join(BUILTIN_MODEL_TASKS)}")
        return
    path = Path(value).expanduser()
    if not path.is_dir():
        what = "no such directory" if not path.exists() else "not a directory"
        raise GridError(sweep_path, key, f"{value!r}: {what}; give a Hugging Face model directory or builtin:NAME")
    if not (path / "config.json").is_file():
        raise GridError(sweep_path, key, f"{value!r} has no config.json: not a Hugging Face model directory")
    try:
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GridError(sweep_path, key, f"{value!r}: its config.json is not readable JSON ({exc})") from None
    if not isinstance(model_config, dict) or not model_config.get("model_type"):
        raise GridError(
            sweep_path, key, f"{value!r}: its config.json names no model_type: not a Hugging Face model config"
        )


def check_data_file(sweep_path: str, key: str, value: str, config: RecipeConfig) -> None:
    if config.data.task != "math-jsonl":
        return
    from recipe.tasks.math.data import check_math_data  # torch-free; math-verify only runs in its workers

    try:
        rows = check_math_data(value, key)
        if key == "data.valid":
            config.data.check_split(rows)  # data.valid the same file as data.train: rows left to train on
    except ConfigError as exc:
        raise GridError(sweep_path, exc.key, exc.detail) from None


def check_engine(sweep_path: str, key: str, value: str, config: RecipeConfig) -> None:
    module = ENGINE_MODULES.get((key, value))
    if module is None:
        return
    if importlib.util.find_spec(module) is None:
        raise GridError(
            sweep_path,
            key,
            f"{value!r} needs the {module!r} package, which {sys.executable} cannot import; "
            "install it on the nodes (pip install -e '.[gpu]') or choose 'torch'",
        )
    # vllm runs on generator ranks, or colocated in the one task (generator_ranks 0); deepspeed
    # trains on every trainer rank.


CHECKS: tuple[tuple[str, Callable[[str, str, str, RecipeConfig], None]], ...] = (
    ("model.path", check_model_path),
    ("data.train", check_data_file),
    ("data.valid", check_data_file),
    ("engine.generator", check_engine),
    ("engine.trainer", check_engine),
)


# ---------------------------------------------------------------------------------------------
# The run's process layout (docs/engines.md, "Process layout")


def check_layouts(spec: SweepSpec, configs: Sequence[RecipeConfig]) -> None:
    """Every run's trainer and generator ranks fit the job's `resources.nodes` x
    `resources.tasks_per_node` tasks (`recipe.config.check_layout`, the rule the job applies to
    the tasks it gets), one task per GPU. vLLM with `generator_ranks: 0` runs colocated in the task."""
    nodes, per_node = int(spec.resources.get("nodes", 1)), int(spec.resources.get("tasks_per_node", 1))
    gpus = int(spec.resources.get("gpus_per_node") or 0)
    if gpus and per_node > 1 and gpus != per_node:
        raise GridError(
            spec.path, "resources.tasks_per_node", f"{per_node} with resources.gpus_per_node={gpus}: a multi-task "
            "run has one task per GPU; make them equal"
        )  # fmt: skip
    seen: set[tuple[int, str, str]] = set()
    for config in configs:
        shape = (config.engine.generator_ranks, config.async_.mode, config.engine.generator)
        if shape in seen:
            continue
        seen.add(shape)
        try:
            check_layout(config, num_nodes=nodes, tasks_per_node=per_node)
        except ConfigError as exc:
            raise GridError(spec.path, exc.key, exc.detail) from None


def check_root(root: Path) -> Path:
    """`--root` (or $SWEEP_ROOT) must be a writable directory, or creatable as one."""
    root = root.expanduser().absolute()
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        what = "is" if existing == root else f"is under {existing}, which is"
        raise GridError(str(root), "--root", f"{what} not a directory (a file?); run directories need a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GridError(str(root), "--root", f"cannot create run directories: {existing} is not writable")
    return root
