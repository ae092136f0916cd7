"""Launch-time checks of what a run's job will need, so that a missing model directory, data file
or engine is found on the login node at `sweep launch`, not hours later on a GPU node.

Torch-free: engines are looked up with `importlib.util.find_spec` (no import), in the Python
that the job will run (`sys.executable`, the one `sweep launch` runs in and submits with). Every
check raises `GridError` naming the sweep file, the key, the value and what is allowed; checks
run on each distinct value once, before anything is registered.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from launcher.grid import GridError, RunPlan, SweepSpec
from recipe.config import ConfigError, RecipeConfig

BUILTIN_PREFIX = "builtin:"
ENGINE_MODULES = {("engine.generator", "vllm"): "vllm", ("engine.trainer", "deepspeed"): "deepspeed"}
"""Config values whose engine must be importable in the job's Python."""


def check_plans(spec: SweepSpec, plans: Sequence[RunPlan]) -> None:
    """Every check on every distinct value the runs use."""
    configs = [p.config for p in plans]
    for key, check in CHECKS:
        for value in sorted({str(c.get(key)) for c in configs}):
            check(spec.path, key, value, next(c for c in configs if str(c.get(key)) == value))


def check_model_path(sweep_path: str, key: str, value: str, config: RecipeConfig) -> None:
    if value.startswith(BUILTIN_PREFIX):
        return
    path = Path(value).expanduser()
    if not path.is_dir():
        what = "no such directory" if not path.exists() else "not a directory"
        raise GridError(sweep_path, key, f"{value!r}: {what}; give a Hugging Face model directory or builtin:NAME")
    if not (path / "config.json").is_file():
        raise GridError(sweep_path, key, f"{value!r} has no config.json: not a Hugging Face model directory")


def check_data_file(sweep_path: str, key: str, value: str, config: RecipeConfig) -> None:
    if config.data.task != "math-jsonl":
        return
    from recipe.math import check_math_data  # torch-free; math-verify only runs in its workers

    try:
        check_math_data(value, key)
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
    raise GridError(sweep_path, key, f"{value!r}: the {module} engine is not available yet in this version; choose 'torch'")


def check_layout(sweep_path: str, key: str, value: str, config: RecipeConfig) -> None:
    """Separate generator ranks need a multi-task job; this version runs one task per run."""
    if config.engine.generator_ranks:
        raise GridError(
            sweep_path,
            key,
            f"{value}: runs with separate generator ranks (PipelineRL with in-flight weight updates) are not "
            "available yet in this version; use 0 (generation and training alternate in one task, lag 0)",
        )


CHECKS: tuple[tuple[str, Callable[[str, str, str, RecipeConfig], None]], ...] = (
    ("model.path", check_model_path),
    ("data.train", check_data_file),
    ("data.valid", check_data_file),
    ("engine.generator", check_engine),
    ("engine.trainer", check_engine),
    ("engine.generator_ranks", check_layout),
)


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
