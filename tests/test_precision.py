"""Generator-vs-trainer log-prob agreement on the same weights, by precision (torch engine).

Tolerances are stated against what bench/bench_logprobs.py measured here (bench/RESULTS.md):
fp32 agrees to ~4e-6 at worst; bfloat16 with the same head on both sides agrees to ~1e-6 on
average; a head in fp32 on one side only is thousands of times worse, which is why
`precision.lm_head_fp32` applies to the generator and the trainer alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_logprobs import mismatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_fp32_generator_and_trainer_agree():
    worst, mean = mismatch("fp32", num_prompts=64, num_samples=4)
    assert worst < 5e-5 and mean < 5e-6, (worst, mean)


@pytest.mark.parametrize("case", ["bf16", "bf16+fp32head"])
def test_bf16_with_the_same_head_on_both_sides_agrees(case):
    worst, mean = mismatch(case, num_prompts=64, num_samples=4)
    assert worst < 0.05 and mean < 1e-4, (worst, mean)


def test_an_fp32_head_on_one_side_only_is_far_worse():
    _, fp32_mean = mismatch("fp32", num_prompts=64, num_samples=4)
    _, both_mean = mismatch("bf16+fp32head", num_prompts=64, num_samples=4)
    _, one_mean = mismatch("one side (trainer fp32 head only)", num_prompts=64, num_samples=4)
    assert one_mean > 100 * max(fp32_mean, both_mean), (fp32_mean, both_mean, one_mean)
