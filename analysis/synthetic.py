"""Synthetic pass-rate curves with realistic eval noise, for tests, benchmarks and sanity checks.

Noise model of a held-out eval: mean@k over P prompts is a binomial proportion of P*k samples
(sd ~0.004 at 1,000 prompts x 16 samples, p ~0.5), plus slow AR(1) drift, because successive
evals of one training run share the policy's wanderings and are not independent.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from analysis.curve import sigmoid

# Table 1 of the paper: name -> (A, B, Cmid in GPU-hours).
PAPER_TABLE1: dict[str, tuple[float, float, float]] = {
    "scalerl": (0.610, 1.92, 2542.0),
    "bs2048": (0.645, 1.70, 10909.0),
    "gen32k": (0.645, 1.89, 11272.0),
    "scout": (0.710, 1.65, 4242.0),
}


def ar1_drift(n: int, *, sd: float, rho: float, rng: np.random.Generator) -> NDArray[np.float64]:
    """Stationary AR(1) series of length n with marginal sd `sd` and lag-1 correlation `rho`."""
    if not 0 <= rho < 1:
        raise ValueError(f"rho must lie in [0, 1), got {rho!r}")
    if sd < 0:
        raise ValueError(f"sd must be >= 0, got {sd!r}")
    innov = rng.normal(0.0, sd * np.sqrt(1 - rho**2), size=n)
    out = np.empty(n)
    prev = rng.normal(0.0, sd)
    for i in range(n):
        prev = rho * prev + innov[i]
        out[i] = prev
    return out


def noisy_curve(
    compute: ArrayLike,
    A: float,
    B: float,
    Cmid: float,
    R0: float,
    *,
    rng: np.random.Generator,
    num_prompts: int = 1000,
    num_samples: int = 16,
    drift_sd: float = 0.002,
    drift_rho: float = 0.8,
) -> NDArray[np.float64]:
    """Measured pass rates at `compute` of a run whose true curve has the given parameters."""
    c = np.asarray(compute, dtype=float)
    truth = sigmoid(c, A, B, Cmid, R0) + ar1_drift(c.size, sd=drift_sd, rho=drift_rho, rng=rng)
    trials = num_prompts * num_samples
    return rng.binomial(trials, np.clip(truth, 0.0, 1.0)) / trials


# The pruning example (docs/pruning.md, tests/test_prune.py): name -> (A, B, Cmid) on a 0..16,000
# compute axis, R0 0.3. "late" starts slowest and ends highest.
LATE_WINNER: dict[str, tuple[float, float, float]] = {
    "late": (0.75, 1.6, 8000.0),
    "fast-low": (0.55, 2.0, 1500.0),
    "mid": (0.62, 1.9, 2500.0),
    "low": (0.50, 1.8, 3000.0),
}
LATE_WINNER_COMPUTE = np.linspace(0, 16000, 81)


def late_winner_sweep(seed: int = 0, seeds: int = 2) -> dict[str, list[tuple[NDArray[np.float64], NDArray[np.float64]]]]:
    """The pruning example's curves: `seeds` noisy runs of each LATE_WINNER configuration."""
    rng = np.random.default_rng(seed)
    c = LATE_WINNER_COMPUTE
    return {k: [(c, noisy_curve(c, *v, 0.3, rng=rng)) for _ in range(seeds)] for k, v in LATE_WINNER.items()}
