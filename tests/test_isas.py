"""The tests marked `isa` (numerics that depend on the CPU's kernels) again, under other instruction sets.

The kernels torch calls (ATen's vectorised loops, MKL's GEMM, oneDNN) pick their code, and with
it their blocking and the order of their sums, by instruction set and shape: a test that compares
two batchings exactly can pass on the CPU it was written on and fail on another. So that every
run of the suite exercises other kernels' choices, whatever CPU it lands on, each marked test runs
once more per level below, in a child pytest whose three libraries are capped there:

- `avx2`: ATen's AVX2 kernels, MKL's AVX2 code path, oneDNN up to AVX2;
- `default`: ATen's scalar (non-vectorised) kernels, MKL's SSE4.2 path, oneDNN up to SSE4.1.

(The native level, AVX-512 on the project's machines, is the main run's.) The marked set is what
compares results across batchings, kernels or processes: tests/test_lean.py, the sampler, the
model, precision, sumk training and resume; about a minute per level on two cores.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LEVELS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}

CHILD = """
import sys, pytest, torch
print("cpu capability:", torch.backends.cpu.get_cpu_capability(), flush=True)
sys.exit(pytest.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole marked set, where the suite's limit is per test
@pytest.mark.parametrize("level", LEVELS)
def test_the_kernel_sensitive_tests_pass_under(level, tmp_path):
    if os.environ.get("ATEN_CPU_CAPABILITY"):  # a run already capped: its own level is the one under test
        pytest.skip(f"this run is capped at ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}")
    # Its own compile cache: torch.compile's cache, shared with a run at the native level, handed
    # this level compiled code whose decode step returned NaN (torch 2.13; a fresh cache computes
    # the right logits).
    env = os.environ | LEVELS[level] | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = ["-m", "isa", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "child"), "tests"]
    child = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    output = child.stdout + child.stderr
    assert child.returncode == 0, f"under {level}:\n{output[-6000:]}"
    assert f"cpu capability: {level.upper()}" in output, output[:500]  # the cap took effect
    assert " passed" in output and " deselected" in output, output[-500:]  # the marked set ran, and only it
