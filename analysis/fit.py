"""Fitting the sigmoid: the paper's grid search (reference) and a bounded direct fit (fast).

reference: the paper's procedure. A on a grid (0.450..0.800 step 0.005, widened to the data, see
    FitOptions), Cmid on `num_cmid` values linear in a range scaled to the compute axis, and at
    each (A, Cmid) B from scipy.optimize.curve_fit (from B = 1, unbounded; B <= 0 is discarded);
    the grid point with the smallest squared error wins. ~7,100 curve_fit calls: 1-2 s a curve.
fast (default): least squares over all parameters at once, bounded, in ln B and ln Cmid. Start
    points: the local minima of a coarse (B, Cmid) profile with A (and R0) solved in closed form
    (distinct basins), plus the best near-step curve (which no gradient reaches); then a bounded
    Levenberg-Marquardt from all of them at once (analysis.solver); the lowest squared error
    wins. ~5-10 ms a curve. Its search space contains the reference's (the A grid lies within
    a_bounds, the Cmid grid within cmid_bounds) except for B beyond b_bounds, so when it ends on a
    B bound, or fails, it also runs the reference and keeps whichever has the lower squared
    error (method "fast->reference" when the reference's numbers are kept). In practice that
    happens only for runs that barely learn, whose best fit is a near step.
    Checked on 90 varied curves (Table 1 shapes, toy scale, collapsing, flat, 10-130 evals, both
    R0 modes): fast squared error <= reference on every one. (A scipy least_squares polish of the
    winner was tried: on 300 noisy curves it never improved the squared error by more than 1e-10
    relative and cost 25% more time, so it was dropped.)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from analysis.curve import (
    FLAG_A_AT_BOUND,
    FLAG_CMID_BEYOND_DATA,
    FLAG_COLLAPSING,
    FLAG_DEGENERATE,
    FLAG_FIT_FAILED,
    FLAG_TOO_FEW_POINTS,
    METHOD_FALLBACK,
    METHOD_FAST,
    METHOD_REFERENCE,
    FitResult,
    failed_result,
    logistic,
)
from analysis.data import CurveLike, as_curve, as_curves
from analysis.diagnostics import is_collapsing
from analysis.options import DEFAULT_OPTIONS, FitOptions, Method, R0Mode, resolve_a_grid, resolve_cmid_bounds, resolve_cmid_range
from analysis.problem import (
    Problem,
    fixed_theta,
    from_theta,
    make_problem,
    make_space,
    num_free,
    to_theta,
)
from analysis.solver import I_A, I_LNB, Space, levenberg_marquardt, profile_starts, step_start

_B_BOUND_TOL = 1e-6  # in ln B
_BOUND_REL = 1e-3  # B or Cmid within this relative distance of a bound is on it (the "degenerate" flag)


def fit_curves(
    curves: Sequence[CurveLike], options: FitOptions = DEFAULT_OPTIONS, *, start: FitResult | None = None
) -> FitResult:
    """Fit R(C) = R0 + (A - R0) / (1 + (Cmid/C)^B) to one configuration: its seeds' curves
    (`(compute, pass_rate)` pairs; one curve is a list of one) jointly, one A, B, Cmid, R0.

    All seeds' points after the cutoff enter one least-squares problem; with r0="first", R0 is the
    mean of the seeds' first measurements; "collapsing" is flagged when any seed collapses.
    `start`: an earlier fit (e.g. the same runs with fewer points) used as one more start point of
    the fast method. Problems of the data themselves (too few points, no convergence) come back as
    NaN results with flags, so a report over many runs is not stopped by one; ValueError only for
    invalid arguments.
    """
    return fit_problem(make_problem(as_curves(curves), options), options, start=start)


def fit_problem(
    problem: Problem, options: FitOptions, *, start: FitResult | None = None, fallback: bool = True
) -> FitResult:
    """Fit a prepared problem with options.method; see the module docstring.

    `fallback=False`: a fast fit on a B bound stays as it is instead of falling back to the
    reference grid (16,100 curve fits): what bootstrap replicates use, whose spread is the point."""
    n_pos = int(problem.design.pos.sum())
    if problem.n_points < options.min_points or n_pos < num_free(options) + 1 or not _r0_known(problem, options):
        return _failed(problem, options.method, FLAG_TOO_FEW_POINTS)
    if options.method == METHOD_REFERENCE:
        found = _reference(problem, options)
        return _result(problem, options, found, METHOD_REFERENCE, _reference_a_bounds(problem, options))
    space = make_space(problem, options)
    fast = _fast(problem, options, space, start)
    fast_a_bounds = (float(space.lo[I_A]), float(space.hi[I_A]))
    if fast is not None and (not fallback or not _on_b_bound(fast[0], space)):
        return _result(problem, options, fast, METHOD_FAST, fast_a_bounds)
    if not fallback:
        return _failed(problem, METHOD_FAST, FLAG_FIT_FAILED)
    ref = _reference(problem, options)
    if ref is not None and (fast is None or ref[1] < fast[1]):
        return _result(problem, options, ref, METHOD_FALLBACK, _reference_a_bounds(problem, options))
    return _result(problem, options, fast, METHOD_FAST, fast_a_bounds)


# --------------------------------------------------------------------------- fast


def _fast(
    problem: Problem, options: FitOptions, space: Space, start: FitResult | None
) -> tuple[NDArray[np.float64], float] | None:
    """Best (theta, sse) of the bounded direct fit, or None when nothing finite came out."""
    y, design, fixed = problem.pass_rate, problem.design, fixed_theta(problem, options)
    starts = profile_starts(y, design, space, fixed)
    step = step_start(y, design, space, fixed)
    if step is not None:
        starts = np.vstack((starts, step))
    if start is not None and start.ok:
        starts = np.vstack((_warm_theta(start, fixed), starts))
    res = levenberg_marquardt(starts, y, design, space)
    ok = np.isfinite(res.sse)
    if not ok.any():
        return None
    best = int(np.argmin(np.where(ok, res.sse, np.inf)))
    return res.theta[best], float(res.sse[best])


def _warm_theta(start: FitResult, fixed: NDArray[np.float64]) -> NDArray[np.float64]:
    """theta of an earlier fit, with this fit's fixed parameters (A, R0) put in."""
    theta = to_theta(start.A, start.B, start.Cmid, start.R0)
    held = np.isfinite(fixed)
    theta[held] = fixed[held]
    return theta


def _on_b_bound(theta: NDArray[np.float64], space: Space) -> bool:
    lnb = theta[I_LNB]
    return bool(lnb <= space.lo[I_LNB] + _B_BOUND_TOL or lnb >= space.hi[I_LNB] - _B_BOUND_TOL)


# --------------------------------------------------------------------------- reference


def _reference(problem: Problem, options: FitOptions) -> tuple[NDArray[np.float64], float] | None:
    """The paper's grid: for each (A, Cmid), B (and R0 when fitted) by curve_fit; lowest SSE wins."""
    from scipy.optimize import OptimizeWarning, curve_fit  # lazy: ~0.25 s to import

    y, pos, log_c = problem.pass_rate, problem.design.pos, problem.design.log_c
    lo, hi = resolve_cmid_range(options, problem.compute_max)
    a_grid = resolve_a_grid(options, y)
    best: tuple[NDArray[np.float64], float] | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        for a in a_grid:
            for cmid in np.linspace(lo, hi, options.num_cmid):
                x = np.where(pos, log_c - math.log(cmid), 0.0)
                found = _fit_b(curve_fit, float(a), x, problem, options)
                if found is not None and (best is None or found[1] < best[1]):
                    best = (to_theta(float(a), found[0], float(cmid), found[2]), found[1])
    return best


def _fit_b(
    curve_fit: Callable[..., Any], a: float, x: NDArray[np.float64], problem: Problem, options: FitOptions
) -> tuple[float, float, float] | None:
    """curve_fit of B (and R0) at one grid point, x = ln C - ln Cmid, as the paper does.

    Returns (B, SSE over the window, R0), or None when curve_fit fails or B <= 0 (outside the
    model). B starts at 1; the paper does not say where it started.
    """
    y, pos = problem.pass_rate, problem.design.pos

    def curve(xx: NDArray[np.float64], b: float, r0: float) -> NDArray[np.float64]:
        return r0 + (a - r0) * np.where(pos, logistic(b * xx), 0.0)

    try:
        if options.fits_r0:
            (b, r0), _ = curve_fit(curve, x, y, p0=[1.0, float(y[0])])
        else:
            r0 = problem.r0
            (b,), _ = curve_fit(lambda xx, bb: r0 + (a - r0) * logistic(bb * xx), x[pos], y[pos], p0=[1.0])
    except (RuntimeError, ValueError):
        return None
    if not (b > 0 and math.isfinite(b) and math.isfinite(r0)):
        return None
    sse = float(np.sum((y - curve(x, b, r0)) ** 2))
    return (float(b), sse, float(r0)) if math.isfinite(sse) else None


def _reference_a_bounds(problem: Problem, options: FitOptions) -> tuple[float, float]:
    grid = resolve_a_grid(options, problem.pass_rate)
    return float(grid.min()), float(grid.max())


# --------------------------------------------------------------------------- results


def _r0_known(problem: Problem, options: FitOptions) -> bool:
    return options.fits_r0 or math.isfinite(problem.r0)


def _failed(problem: Problem, method: str, flag: str) -> FitResult:
    return failed_result(
        R0=problem.r0,
        n_points=problem.n_points,
        compute_min=problem.compute_min,
        compute_max=problem.compute_max,
        method=method,
        flags=(flag,),
    )


def _result(
    problem: Problem,
    options: FitOptions,
    found: tuple[NDArray[np.float64], float] | None,
    method: str,
    a_bounds: tuple[float, float],
) -> FitResult:
    if found is None:
        return _failed(problem, method, FLAG_FIT_FAILED)
    theta, sse = found
    A, B, Cmid, R0 = from_theta(theta)
    y = problem.pass_rate
    sst = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - sse / sst if sst > 0 else math.nan
    return FitResult(
        A=A,
        B=B,
        Cmid=Cmid,
        R0=R0,
        r2=r2,
        sse=sse,
        n_points=problem.n_points,
        compute_min=problem.compute_min,
        compute_max=problem.compute_max,
        method=method,
        flags=_flags(problem, options, A, Cmid, a_bounds) + _degenerate(problem, options, B, Cmid, method),
    )


def _flags(
    problem: Problem, options: FitOptions, A: float, Cmid: float, a_bounds: tuple[float, float]
) -> tuple[str, ...]:
    """Diagnostic flags of a successful fit (see analysis.curve for their meaning)."""
    flags = []
    if options.fix_a is None and min(abs(A - a_bounds[0]), abs(a_bounds[1] - A)) <= options.bound_tol:
        flags.append(FLAG_A_AT_BOUND)
    if Cmid > problem.compute_max:
        flags.append(FLAG_CMID_BEYOND_DATA)
    if any(_seed_collapses(problem.pass_rate[s], options) for s in problem.seed_slices()):
        flags.append(FLAG_COLLAPSING)
    return tuple(flags)


def _degenerate(problem: Problem, options: FitOptions, B: float, Cmid: float, method: str) -> tuple[str, ...]:
    """("degenerate",) when the window has no compute spread or B or Cmid sits on a bound of the
    method's search space (the reference's Cmid grid ends, else the fast method's Cmid bounds;
    B's bounds for both, as the reference's unbounded B below or above them is no estimate either)."""
    positive = problem.compute[problem.design.pos]
    resolve = resolve_cmid_range if method in (METHOD_REFERENCE, METHOD_FALLBACK) else resolve_cmid_bounds
    c_lo, c_hi = resolve(options, problem.compute_max)
    b_lo, b_hi = options.b_bounds
    on_bound = B <= b_lo * (1 + _BOUND_REL) or B >= b_hi * (1 - _BOUND_REL)
    on_bound |= Cmid <= c_lo * (1 + _BOUND_REL) or Cmid >= c_hi * (1 - _BOUND_REL)
    return (FLAG_DEGENERATE,) if np.unique(positive).size < 2 or on_bound else ()


def _seed_collapses(pass_rate: NDArray[np.float64], options: FitOptions) -> bool:
    return is_collapsing(
        pass_rate, tail_frac=options.collapse_frac, k=options.collapse_k, min_drop=options.collapse_min_drop
    )
