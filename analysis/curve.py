"""The paper's saturating curve of pass rate against compute, and the result of fitting it.

    R(C) = R0 + (A - R0) / (1 + (Cmid / C)^B)

A is the asymptote, B > 0 the efficiency exponent, Cmid the compute at which half of the gain
(A - R0) is reached, R0 the pass rate at zero compute (ScaleRL, arXiv 2510.13786).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

# Flags a fit can carry. Strings, so they survive JSON/CSV reports unchanged.
FLAG_A_AT_BOUND = "A_at_bound"
"""A lies within `bound_tol` of an end of the A search space (a_bounds, or the A grid's ends for
the reference method): the data do not pin the asymptote down."""
FLAG_CMID_BEYOND_DATA = "Cmid_beyond_data"
"""Cmid is larger than the largest compute fitted: the run has not yet reached half its gain, so A
is an extrapolation far past the data."""
FLAG_TOO_FEW_POINTS = "too_few_points"
"""Fewer points than `min_points` (or than free parameters + 1) after the cutoff; parameters NaN."""
FLAG_COLLAPSING = "collapsing"
"""The pass rate falls at the end of the run by more than the noise (see diagnostics.is_collapsing)."""
FLAG_FIT_FAILED = "fit_failed"
"""No method produced finite parameters; parameters NaN."""
FLAG_DEGENERATE = "degenerate"
"""The data cannot shape a sigmoid: every point after the cutoff sits at one compute value (no
compute spread), or B or Cmid ended on a bound of its search space (a flat curve fits with B at its
lower bound, a step with B at its upper one). The numbers are not estimates; not ranked by default."""

FLAGS: tuple[str, ...] = (
    FLAG_A_AT_BOUND,
    FLAG_CMID_BEYOND_DATA,
    FLAG_TOO_FEW_POINTS,
    FLAG_COLLAPSING,
    FLAG_FIT_FAILED,
    FLAG_DEGENERATE,
)
FAILURE_FLAGS: frozenset[str] = frozenset({FLAG_TOO_FEW_POINTS, FLAG_FIT_FAILED})

METHOD_FAST = "fast"
METHOD_REFERENCE = "reference"
METHOD_FALLBACK = "fast->reference"


def logistic(z: ArrayLike) -> NDArray[np.float64]:
    """1 / (1 + exp(-z)), as (1 + tanh(z/2)) / 2: no overflow at any z (+-inf included), and no
    import of scipy.special, which would add ~0.3 s to every `sweep` command that imports us."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=float)))


def log_compute(compute: ArrayLike) -> NDArray[np.float64]:
    """log C with log 0 = -inf and no warning; negative compute is an error, not a NaN."""
    c = np.asarray(compute, dtype=float)
    if np.any(c < 0):
        raise ValueError(f"compute must be >= 0, got {float(c[c < 0].flat[0])!r}")
    with np.errstate(divide="ignore"):
        log_c: NDArray[np.float64] = np.log(c)
    return log_c


def gain_fraction(compute: ArrayLike, B: ArrayLike, Cmid: ArrayLike) -> NDArray[np.float64]:
    """Fraction of (A - R0) gained: 1 / (1 + (Cmid/C)^B).

    Written as a logistic in log C, logistic(B (ln C - ln Cmid)), so that (Cmid/C)^B can neither
    overflow nor divide by zero: C = 0 gives exactly 0 for any B > 0, i.e. R(0) = R0.
    """
    z = np.asarray(B, dtype=float) * (log_compute(compute) - np.log(np.asarray(Cmid, dtype=float)))
    return logistic(z)


def sigmoid(compute: ArrayLike, A: ArrayLike, B: ArrayLike, Cmid: ArrayLike, R0: ArrayLike) -> NDArray[np.float64]:
    """Pass rate predicted at `compute` (any shape; parameters broadcast against it).

    Parameters may be arrays so that many parameter sets are evaluated at once (bootstrap bands:
    params of shape (K, 1) against compute of shape (n,) give (K, n)). NaN parameters give NaN.
    """
    b = np.asarray(B, dtype=float)
    cmid = np.asarray(Cmid, dtype=float)
    if np.any(b <= 0):
        raise ValueError(f"B must be > 0, got {float(b[b <= 0].flat[0])!r}")
    if np.any(cmid <= 0):
        raise ValueError(f"Cmid must be > 0, got {float(cmid[cmid <= 0].flat[0])!r}")
    r0 = np.asarray(R0, dtype=float)
    rate: NDArray[np.float64] = r0 + (np.asarray(A, dtype=float) - r0) * gain_fraction(compute, b, cmid)
    return rate


@dataclass(frozen=True)
class FitResult:
    """One fitted curve.

    `method` says which method produced the numbers: "fast", "reference", or "fast->reference"
    when the fast method fell back to the reference grid and the grid's answer was kept.
    `compute_min`/`compute_max` span the fitted window (after the cutoff), and `sse`/`r2` are
    measured on that window. Failed fits carry NaN parameters and a failure flag, never raise, so
    a report over a thousand curves is not stopped by one short or broken run.
    """

    A: float
    B: float
    Cmid: float
    R0: float
    r2: float
    sse: float
    n_points: int
    compute_min: float
    compute_max: float
    method: str
    flags: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the parameters are usable (finite, no failure flag)."""
        finite = all(math.isfinite(v) for v in (self.A, self.B, self.Cmid, self.R0))
        return finite and not FAILURE_FLAGS.intersection(self.flags)

    def has(self, flag: str) -> bool:
        """Whether the fit carries `flag` (one of FLAGS)."""
        if flag not in FLAGS:
            raise ValueError(f"flag must be one of {FLAGS}, got {flag!r}")
        return flag in self.flags

    def predict(self, compute: ArrayLike) -> NDArray[np.float64]:
        """Pass rate the fitted curve predicts at `compute` (NaN for a failed fit)."""
        return predict(self, compute)


def predict(fit: FitResult, compute: ArrayLike) -> NDArray[np.float64]:
    """Pass rate `fit` predicts at `compute`; NaN everywhere when the fit failed."""
    if not fit.ok:
        log_compute(compute)  # still reject negative compute
        return np.full(np.shape(compute), np.nan)
    return sigmoid(compute, fit.A, fit.B, fit.Cmid, fit.R0)


def failed_result(
    *, R0: float, n_points: int, compute_min: float, compute_max: float, method: str, flags: tuple[str, ...]
) -> FitResult:
    """A FitResult with NaN parameters, for fits that could not be made."""
    nan = float("nan")
    return FitResult(nan, nan, nan, R0, nan, nan, n_points, compute_min, compute_max, method, flags)
