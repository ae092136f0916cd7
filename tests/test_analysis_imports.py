"""analysis/ is pure computation: numpy, scipy and the standard library only, and cheap to import
(`sweep report` imports it on a login node)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ANALYSIS = Path(__file__).resolve().parents[1] / "analysis"
ALLOWED = {"numpy", "scipy", "analysis"} | set(sys.stdlib_module_names)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_analysis_imports_only_numpy_scipy_and_stdlib() -> None:
    files = sorted(ANALYSIS.glob("*.py"))
    assert files, ANALYSIS
    bad = {f.name: sorted(imported_roots(f) - ALLOWED) for f in files if imported_roots(f) - ALLOWED}
    assert not bad, f"analysis/ may import only numpy, scipy and the stdlib; found {bad}"


def test_importing_analysis_loads_no_heavy_or_foreign_modules() -> None:
    code = "import json, sys, analysis; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ANALYSIS.parent)
    loaded = set(json.loads(out.stdout))
    for banned in ("torch", "vllm", "deepspeed", "sqlalchemy", "store", "launcher", "recipe", "matplotlib"):
        assert banned not in loaded, banned
    # scipy.optimize / scipy.stats cost ~0.25-0.5 s to import: loaded only when a fit needs them.
    assert "scipy.optimize" not in loaded and "scipy.stats" not in loaded


def test_no_submodule_is_shadowed_by_a_reexported_name() -> None:
    """`import analysis.intervals as m` must give the module, not a function of the same name."""
    import importlib
    import inspect

    import analysis

    for path in ANALYSIS.glob("*.py"):
        if path.stem != "__init__":
            importlib.import_module(f"analysis.{path.stem}")
            assert inspect.ismodule(getattr(analysis, path.stem)), path.stem
