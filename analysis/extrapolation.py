"""Extrapolation: fit a run up to compute C1, predict its pass rate at C2 > C1 with a band.

The paper's use of the curve: fit to half the budget (8k of 16k GPU-hours; 50k of 100k) and
extend. Once the run reaches C2 the prediction is checked against what was measured there.

The paper claims such predictions for stable recipes only. A configuration whose fitted window
is unstable (some seed falls below its running maximum by more than its eval noise allows,
`analysis.diagnostics.unstable_drop`) or whose window cannot be fitted gets no prediction: the
Extrapolation says why (`withheld`) and its predicted value is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from analysis.curve import FitResult
from analysis.data import CurveLike, as_curves
from analysis.diagnostics import transients, unstable_drop
from analysis.intervals import BootstrapResult, Interval, Scheme, bootstrap_problem
from analysis.options import DEFAULT_OPTIONS, FitOptions
from analysis.problem import make_problem


@dataclass(frozen=True)
class Extrapolation:
    """Prediction at `predict_at` from a fit on compute <= `fit_until`.

    band: prediction band for what is measured at predict_at: the bootstrap curves there plus the
    noise of that measurement, a mean of `n_observed` evals (one while the run has not got there;
    `BootstrapResult.prediction_band`). observed: the measured pass rate at predict_at when the
    data reach it (the points within `window` relative compute of it, each moved along the fitted
    curve to predict_at, then averaged; else linear interpolation between its neighbours), else
    None; n_observed: how many points that mean used (0 when interpolated).
    error = predicted - observed. within_band: whether observed lies in the band.
    withheld: why no prediction is made (an unstable window or a failed fit), else None; then
    predicted is NaN, the band unknown, error and within_band None (observed is still given).
    """

    fit_until: float
    predict_at: float
    predicted: float
    band: Interval
    level: float
    observed: float | None
    n_observed: int
    error: float | None
    within_band: bool | None
    fit: FitResult
    bootstrap: BootstrapResult = field(repr=False, compare=False)
    withheld: str | None = None
    shared_with: int = 1
    """Configurations whose fitted A this prediction shares (`analysis.ceilings`); 1: its own A."""
    task_ceiling: float | None = None
    """The task's ceiling when A was held there (`analysis.ceilings.holds_ceiling`), else None."""

    @property
    def predicts(self) -> bool:
        return self.withheld is None and math.isfinite(self.predicted)


def extrapolate(
    curves: Sequence[CurveLike],
    options: FitOptions = DEFAULT_OPTIONS,
    *,
    fit_until: float,
    predict_at: float,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    window: float = 0.1,
    scheme: Scheme = "noise_model",
) -> Extrapolation:
    """Fit one configuration's seeds on compute <= fit_until jointly and predict at `predict_at`.

    Each seed stays its own series (its own R0 measurement, its own noise in the bootstrap), so
    interleaved seeds are never read as one time series. R0 ("first") still comes from the first
    points; points past fit_until are used only for the observed value, the mean over all seeds.
    A seed's one-eval transients (a point below both neighbours by several noise sds) are left out
    of the fit and of the observed value (`_without_transients`). `window`: relative half-width around predict_at whose points are averaged into the observed
    value. One eval is noisy (binomial sd ~0.004-0.007, plus the policy's own wander from step to
    step, which near convergence is the larger part), so the check averages a few points to be
    about the curve, not about one draw; each point is first moved along the fitted curve to
    predict_at, so a curve still rising inside the window does not bias the mean low.
    """
    seeds = as_curves(curves)
    if not (math.isfinite(fit_until) and fit_until > options.cutoff):
        raise ValueError(f"fit_until must be a finite number > cutoff ({options.cutoff}), got {fit_until!r}")
    if not (math.isfinite(predict_at) and predict_at > 0):
        raise ValueError(f"predict_at must be a finite number > 0, got {predict_at!r}")
    if not 0 <= window < 1:
        raise ValueError(f"window must lie in [0, 1), got {window!r}")
    windows = fit_window(seeds, fit_until)
    problem = make_problem(windows, options)
    boot = bootstrap_problem(problem, options, n_boot=n_boot, seed=seed, level=level, scheme=scheme)
    withheld = withheld_reason(windows, boot.fit)
    c_all, r_all = measured_points(seeds)
    trend = boot.fit.predict if withheld is None else None
    observed, n_obs = observed_at(c_all, r_all, predict_at, window=window, trend=trend)
    if withheld is None:
        predicted = float(boot.fit.predict(predict_at))
        band = boot.prediction_band(predict_at, max(n_obs, 1), seed=seed)
    else:
        predicted, band = math.nan, Interval(math.nan, math.nan)
    error = None if observed is None or math.isnan(predicted) else predicted - observed
    within = None if observed is None or not band.known else band.contains(observed)
    return Extrapolation(
        fit_until=fit_until,
        predict_at=predict_at,
        predicted=predicted,
        band=band,
        level=level,
        observed=observed,
        n_observed=n_obs,
        error=error,
        within_band=within,
        fit=boot.fit,
        bootstrap=boot,
        withheld=withheld,
    )


def fit_window(curves: Sequence[CurveLike], fit_until: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """What an extrapolation fits: each seed's points up to `fit_until`, one-eval transients out."""
    return [_without_transients(c[c <= fit_until], r[c <= fit_until]) for c, r in as_curves(curves)]


def measured_points(curves: Sequence[CurveLike]) -> tuple[np.ndarray, np.ndarray]:
    """What an observed value is measured on: every seed's points, its one-eval transients out
    (as a fit leaves them out: a policy that has one bad step and recovers by the next eval was
    never at that level), all seeds together in compute order."""
    kept = [_without_transients(c, r) for c, r in as_curves(curves)]
    c_all = np.concatenate([c for c, _ in kept])
    order = np.argsort(c_all, kind="stable")
    return c_all[order], np.concatenate([r for _, r in kept])[order]


def _without_transients(compute: np.ndarray, pass_rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One seed's window without its one-eval transients (`analysis.diagnostics.transients`): a
    least-squares fit follows a single eval 0.1 off the curve far enough to move the prediction
    by several hundredths, and a curve that recovers at the next eval was never there."""
    keep = ~transients(pass_rate)
    return compute[keep], pass_rate[keep]


def withheld_reason(windows: Sequence[tuple[np.ndarray, np.ndarray]], fit: FitResult) -> str | None:
    """Why the fitted window supports no prediction, or None: a failed fit, or an unstable seed."""
    if not fit.ok:
        return "fit failed: " + ", ".join(fit.flags)
    for c, r in windows:
        drop = unstable_drop(r[np.argsort(c, kind="stable")])
        if drop is not None:
            return f"unstable: falls {drop:.3f} below its best before C1"
    return None


def observed_at(
    compute: np.ndarray,
    pass_rate: np.ndarray,
    at: float,
    *,
    window: float = 0.1,
    trend: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[float | None, int]:
    """Measured pass rate at compute `at` from sorted data: (value, number of points averaged).

    Mean of points with |C - at| <= window * at, each moved to `at` along `trend` (a fitted
    curve: point + trend(at) - trend(C)) when one is given; failing that, linear interpolation
    when `at` lies inside the measured range (n = 0); None when the data do not reach `at`.
    """
    near = np.abs(compute - at) <= window * at
    if near.any():
        values = pass_rate[near]
        if trend is not None:
            values = values + (float(trend(np.asarray(at))) - trend(compute[near]))
        return float(values.mean()), int(near.sum())
    if compute.size and compute[0] <= at <= compute[-1]:
        return float(np.interp(at, compute, pass_rate)), 0
    return None, 0
