"""Checkpoint files: atomic writes, the newest valid one on resume, rotation.

A checkpoint is `RUN_DIR/checkpoints/step_{step:08d}.pt`, a `torch.save` of a plain dict (see
`recipe.train.checkpoint_state` for its keys) loadable with `weights_only=True`. It is written to a
temporary file in the same directory, fsynced, then renamed over the final name, so a reader sees
either the whole file or none. A file that still fails to load (a disk that lied, a copy cut
short) is renamed to `*.corrupt` and the previous checkpoint is used instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
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
    run_dir: Path, log: Callable[[str], None], on_discarded: Callable[[int], None]
) -> dict[str, Any] | None:
    """The newest checkpoint that loads and is complete, or None when there is none.

    Each newer file that fails is renamed to `*.corrupt`, logged by name, and reported to
    `on_discarded(step)`.
    """
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            _check_complete(state, step)
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
