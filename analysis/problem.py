"""A fit's data, prepared once: the window after the cutoff (pooled over seeds), R0, search space.

Kept apart from the fitting methods so the bootstrap can build a problem once and refit it many
times with resampled pass rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from analysis.data import Curve
from analysis.options import FitOptions, resolve_cmid_bounds
from analysis.solver import I_A, I_LNB, I_LNC, I_R0, NUM_PARAMS, Design, Space

R0_BOUNDS = (0.0, 1.0)


@dataclass(frozen=True)
class Problem:
    """The fitted window: points with compute >= cutoff from every seed, in seed order.

    `lengths[i]` is seed i's number of window points (its residuals form one time series for the
    bootstrap). `r0` is the resolved R0, NaN when R0 is fitted.
    """

    compute: NDArray[np.float64]
    pass_rate: NDArray[np.float64]
    lengths: tuple[int, ...]
    r0: float
    design: Design
    first_rates: tuple[float, ...] = ()  # each seed's first measured pass rate (NaN if empty)

    @property
    def n_points(self) -> int:
        return int(self.compute.size)

    @property
    def compute_min(self) -> float:
        return float(self.compute.min()) if self.compute.size else math.nan

    @property
    def compute_max(self) -> float:
        return float(self.compute.max()) if self.compute.size else math.nan

    def seed_slices(self) -> list[slice]:
        """Where each seed's window lies in the pooled arrays."""
        ends = np.cumsum(self.lengths)
        return [slice(int(e - n), int(e)) for e, n in zip(ends, self.lengths, strict=True)]


def make_problem(curves: list[Curve], options: FitOptions) -> Problem:
    """Cut each seed's curve at the cutoff, pool the windows and resolve R0 (see FitOptions.r0)."""
    windows = [(c[c >= options.cutoff], r[c >= options.cutoff]) for c, r in curves]
    compute = np.concatenate([w[0] for w in windows]) if windows else np.empty(0)
    pass_rate = np.concatenate([w[1] for w in windows]) if windows else np.empty(0)
    return Problem(
        compute=compute,
        pass_rate=pass_rate,
        lengths=tuple(int(w[0].size) for w in windows),
        r0=resolve_r0(curves, options),
        design=Design.from_compute(compute),
        first_rates=tuple(_first_rate(c, r) for c, r in curves),
    )


def resolve_r0(curves: list[Curve], options: FitOptions) -> float:
    """R0 per FitOptions.r0: "first" = mean over seeds of each seed's first measured pass rate."""
    if options.r0 == "fit":
        return math.nan
    if not isinstance(options.r0, str):
        return float(options.r0)
    firsts = [_first_rate(c, r) for c, r in curves if c.size]
    return float(np.mean(firsts)) if firsts else math.nan


def _first_rate(compute: NDArray[np.float64], pass_rate: NDArray[np.float64]) -> float:
    """Pass rate at the lowest compute of a sorted curve (mean over ties); NaN for no points."""
    return float(np.mean(pass_rate[compute == compute[0]])) if compute.size else math.nan


def num_free(options: FitOptions) -> int:
    """Number of free parameters: B and Cmid, plus A unless fixed, plus R0 when fitted."""
    return 2 + (options.fix_a is None) + options.fits_r0


def make_space(problem: Problem, options: FitOptions) -> Space:
    """Bounds of the fast method in theta = [A, ln B, ln Cmid, R0]."""
    c_lo, c_hi = resolve_cmid_bounds(options, problem.compute_max)
    lo = np.array([options.a_bounds[0], math.log(options.b_bounds[0]), math.log(c_lo), R0_BOUNDS[0]])
    hi = np.array([options.a_bounds[1], math.log(options.b_bounds[1]), math.log(c_hi), R0_BOUNDS[1]])
    free = np.array([options.fix_a is None, True, True, options.fits_r0])
    return Space(lo, hi, free)


def fixed_theta(problem: Problem, options: FitOptions) -> NDArray[np.float64]:
    """A theta row holding the fixed parameters (A if fixed, R0 unless fitted); NaN elsewhere."""
    theta = np.full(NUM_PARAMS, math.nan)
    if options.fix_a is not None:
        theta[I_A] = options.fix_a
    if not options.fits_r0:
        theta[I_R0] = problem.r0
    return theta


def to_theta(A: float, B: float, Cmid: float, R0: float) -> NDArray[np.float64]:
    theta = np.empty(NUM_PARAMS)
    theta[I_A], theta[I_LNB], theta[I_LNC], theta[I_R0] = A, math.log(B), math.log(Cmid), R0
    return theta


def from_theta(theta: NDArray[np.float64]) -> tuple[float, float, float, float]:
    """(A, B, Cmid, R0) from a theta row."""
    return float(theta[I_A]), math.exp(theta[I_LNB]), math.exp(theta[I_LNC]), float(theta[I_R0])
