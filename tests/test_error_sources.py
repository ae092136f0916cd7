"""Per-run error budget (analysis/report/error_sources.py) on a synthetic run with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.curve import sigmoid
from analysis.report.error_sources import markdown, run_errors


def test_a_clean_run_has_binomial_noise_no_wander_and_small_errors():
    steps = np.r_[np.arange(0, 200, 10), np.arange(200, 801, 50)].astype(float)
    compute = steps * 1e9
    rng = np.random.default_rng(0)
    truth = sigmoid(compute, 0.7, 1.6, 2e11, 0.3)
    rate = rng.binomial(8192, truth) / 8192
    e = run_errors("r", steps, compute, rate, samples=8192, n_boot=30)
    assert e.final == pytest.approx(float(truth[-1]), abs=0.005)
    assert e.binomial_sd == pytest.approx(math.sqrt(e.final * (1 - e.final) / 8192))
    assert e.wander_sd < 0.004 and abs(e.late_drift) < 0.01
    assert (e.n_quarter, e.n_half) == (21, 25)
    assert e.error_quarter is not None and e.error_quarter_thinned is not None  # 21 and 5 points: both fitted
    assert abs(e.error_half) < 0.02 and abs(e.error_half_thinned) < 0.02
    assert f"| r | {e.final:.3f} | {e.binomial_sd:.4f} |" in markdown([e], {})
