"""The house rules (docs/architecture.md): the control plane never imports torch/vllm/deepspeed,
only store/ touches SQLAlchemy, data flows one way, launcher/ (but its thin CLI) knows nothing
of the analysis stage, and recipe/'s rooms use each other in one direction ("Inside recipe/")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "deepspeed", "transformers")
LAUNCHER_IMPORTS_FROM_RECIPE = {"recipe.config", "recipe.tasks.math.data", "recipe.telemetry.provenance"}
"""The part of recipe/ the launcher may import (the job function hands over to the rest inside the job)."""
CONTROL_PLANE = [
    "launcher.cli", "launcher.local", "launcher.preflight", "analysis.report.build", "analysis.report.render",
    "store", "analysis", *sorted(LAUNCHER_IMPORTS_FROM_RECIPE),
    "recipe.tasks.math.score",  # the math workers' pool; math-verify runs in the worker processes
    "recipe.pipeline.rendezvous",  # stdlib only: tests and engines take free_port from it
]  # fmt: skip


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


def _imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, in full (`import a.b` and `from a.b import c` give a.b)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_launcher_uses_only_the_torch_free_part_of_recipe():
    # the one exception: the job function (launcher/job.py) hands over to the recipe inside the job
    for path in _package_files("launcher"):
        for module in _imported_modules(path):
            if module.split(".")[0] == "recipe":
                assert module in LAUNCHER_IMPORTS_FROM_RECIPE or path.name == "job.py", f"{path.name} imports {module}"


ROOMS = ("loop", "pipeline", "model", "tasks", "engines", "telemetry")
NOT_FROM = {
    "tasks": {"loop", "pipeline", "engines", "job"},  # what is learned knows nothing of how
    "model": {"loop", "pipeline", "job"},
    "telemetry": {"loop", "pipeline", "model", "tasks", "engines", "job"},
    "loop": {"pipeline", "job"},  # the pipeline drives the loop, never the other way
    "engines": {"pipeline", "job"},
}
"""recipe/'s rooms (docs/architecture.md, "Inside recipe/"): the rooms a room's modules must not import."""
ALLOWED_ACROSS = {"recipe.pipeline.rendezvous"}
"""Leaves any room may use (stdlib only)."""


def test_recipe_rooms_are_the_tree():
    rooms = {p.name for p in (ROOT / "recipe").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(ROOMS), rooms
    flat = sorted(p.name for p in (ROOT / "recipe").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "config.py", "job.py"], flat


@pytest.mark.parametrize("room", sorted(NOT_FROM))
def test_recipe_rooms_import_in_one_direction(room):
    for path in sorted((ROOT / "recipe" / room).rglob("*.py")):
        for module in _imported_modules(path):
            parts = module.split(".")
            if parts[0] != "recipe" or len(parts) < 2 or module in ALLOWED_ACROSS:
                continue
            assert parts[1] not in NOT_FROM[room], f"{path.relative_to(ROOT)} imports {module}"


def test_launcher_core_knows_nothing_of_the_analysis_stage():
    """Launching and tracking never import analysis/; only the thin CLI hands over to the report."""
    for path in _package_files("launcher"):
        if path.name == "cli.py":
            continue
        bad = [m for m in _imported_modules(path) if m.split(".")[0] == "analysis"]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_no_report_plot_or_ranking_code_in_launcher():
    names = {p.stem for p in _package_files("launcher")}
    assert not names & {"report", "report_render", "plots", "ranking"}, names
