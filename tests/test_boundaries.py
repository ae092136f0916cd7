"""The house rules of DESIGN.md: the control plane never imports torch/vllm/deepspeed, and only
store/ touches SQLAlchemy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "deepspeed", "transformers")
CONTROL_PLANE = ["launcher.cli", "launcher.local", "launcher.report", "store", "analysis", "recipe.config"]


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_control_plane_imports_no_heavy_framework(module):
    code = (
        f"import sys, {module}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_only_store_imports_sqlalchemy():
    offenders = [
        str(p.relative_to(ROOT))
        for package in ("launcher", "recipe", "analysis")
        for p in _package_files(package)
        if "sqlalchemy" in _imports(p)
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("package", "allowed"),
    [("store", set()), ("analysis", {"store"}), ("recipe", {"store"})],
)
def test_one_way_data_flow(package, allowed):
    ours = {"launcher", "recipe", "store", "analysis"}
    for path in _package_files(package):
        bad = (_imports(path) & ours) - allowed - {package}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_launcher_uses_only_the_torch_free_part_of_recipe():
    for path in _package_files("launcher"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("recipe"):
                # the one exception: the job function hands over to the recipe inside the job;
                # recipe.math (stdlib only; math-verify runs in its worker processes) checks
                # math-jsonl data at launch
                allowed = {"recipe.config", "recipe.math"}
                assert node.module in allowed or path.name == "job.py", f"{path.name} imports {node.module}"
