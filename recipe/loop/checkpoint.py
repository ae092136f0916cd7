"""Checkpoint files: atomic writes, the newest valid one on resume, rotation.

A checkpoint is `RUN_DIR/checkpoints/step_{step:08d}.pt`, a `torch.save` of a plain dict (see
`recipe.loop.state.checkpoint_state` for its keys) loadable with `weights_only=True`. It is written to a
temporary file in the same directory, fsynced, then renamed over the final name, so a reader sees
either the whole file or none. A file that still fails to load (a disk that lied, a copy cut
short), or whose model or optimizer state does not fit the run's (another architecture, tensors
missing or of another shape: see `check_fits`), is renamed to `*.corrupt` and the previous
checkpoint is used instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "compute", "prompts", "pending", "rng", "config")
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def save(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """Write `state` as the checkpoint of `step`, atomically."""
    final = checkpoint_path(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(staging, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, final)
    finally:
        staging.unlink(missing_ok=True)
    return final


def load_newest_valid(
    run_dir: Path,
    log: Callable[[str], None],
    on_discarded: Callable[[int], None],
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """The newest checkpoint that loads, is complete and passes `check` (which raises when the
    state would not restore, e.g. `check_fits`), or None when there is none.

    Each newer file that fails is renamed to `*.corrupt`, logged by name, and reported to
    `on_discarded(step)`.
    """
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            _check_complete(state, step)
            if check is not None:
                check(state)
        except Exception as exc:  # noqa: BLE001 - any failure to read means: not this one
            log(f"skipping checkpoint {path}: {type(exc).__name__}: {exc}; renamed to {path.name}.corrupt")
            os.replace(path, path.with_name(path.name + ".corrupt"))
            on_discarded(step)
            continue
        return state
    return None


def prune(run_dir: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` checkpoints; return the deleted steps."""
    deleted = []
    for step, path in list_checkpoints(run_dir)[:-keep]:
        path.unlink(missing_ok=True)
        deleted.append(step)
    return deleted


def check_fits(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless the checkpoint's model and optimizer state load into `model` and
    `optimizer` as they are: the same tensor names and shapes, the same parameter groups. Checked
    before anything is loaded, so a misfit leaves the model untouched for an older checkpoint."""
    _check_tensors("model", state["model"], model.state_dict())
    _check_optimizer(state["optimizer"], optimizer)


def _check_tensors(what: str, saved: Any, expected: Mapping[str, torch.Tensor]) -> None:
    if not isinstance(saved, Mapping):
        raise ValueError(f"{what} state is a {type(saved).__name__}, not a dict of tensors")
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        raise ValueError(f"{what} state: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for key, tensor in expected.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what} state: {key} has shape {shape}, the model's is {tuple(tensor.shape)}")


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list):
        raise ValueError("optimizer state has no param_groups")
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        raise ValueError(f"optimizer state has {len(saved['param_groups'])} parameter groups, the run {len(groups)}")
    params: dict[Any, torch.Tensor] = {}
    for i, (ours, theirs) in enumerate(zip(groups, saved["param_groups"], strict=True)):
        held, wanted = len(theirs.get("params", [])), len(ours["params"])
        if held != wanted:
            raise ValueError(f"optimizer group {i} holds {held} parameters, the run's {wanted}")
        params.update(zip(theirs["params"], ours["params"], strict=True))
    for index, slots in (saved.get("state") or {}).items():
        param = params.get(index)
        if param is None:
            raise ValueError(f"optimizer state for parameter {index}, which no group holds")
        for name, value in slots.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"optimizer state {name} of parameter {index} has shape {tuple(value.shape)}, "
                    f"the parameter's is {tuple(param.shape)}"
                )


def _check_complete(state: Any, step: int) -> None:
    if not isinstance(state, dict):
        raise ValueError("not a checkpoint dict")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"missing keys {missing}")
    if state["format"] != FORMAT_VERSION:
        raise ValueError(f"format {state['format']!r}, expected {FORMAT_VERSION}")
    if state["step"] != step:
        raise ValueError(f"holds step {state['step']}, its name says {step}")
