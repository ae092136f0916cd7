"""Model-free checks on a pass-rate series: its noise level and whether it is collapsing.

These do not use the fitted curve on purpose: a run that rises then falls is fitted badly by a
monotone sigmoid, so residual-based noise would be inflated exactly when we need it to be small.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

_MAD_TO_SD = 1.4826  # sd = 1.4826 * MAD for Gaussian noise


def noise_sd(pass_rate: ArrayLike) -> float:
    """Robust sd of the measurement noise of a series ordered by compute.

    From first differences: a smooth trend nearly cancels in y[i+1] - y[i], white noise of sd s
    gives differences of sd s*sqrt(2); the median absolute deviation ignores the occasional jump.
    Returns 0.0 for fewer than 3 points.
    """
    y = np.asarray(pass_rate, dtype=float)
    if y.size < 3:
        return 0.0
    d = np.diff(y)
    mad = float(np.median(np.abs(d - np.median(d))))
    return _MAD_TO_SD * mad / math.sqrt(2.0)


def collapse_drop(pass_rate: ArrayLike, *, tail_frac: float = 0.2) -> float:
    """How far the end of the run lies below its best stretch: peak - tail.

    With m = max(2, ceil(tail_frac * n)): smoothed = moving averages over m consecutive points;
    peak = their maximum (a running maximum that single noisy points cannot inflate much);
    tail = the mean of the last m points. Positive when the run ends below its best.
    """
    y = np.asarray(pass_rate, dtype=float)
    if not 0 < tail_frac < 1:
        raise ValueError(f"tail_frac must lie in (0, 1), got {tail_frac!r}")
    m = max(2, math.ceil(tail_frac * y.size))
    if y.size < m:
        return 0.0
    smoothed = np.convolve(y, np.full(m, 1.0 / m), mode="valid")
    return float(smoothed.max() - smoothed[-1])


def is_collapsing(pass_rate: ArrayLike, *, tail_frac: float = 0.2, k: float = 3.0, min_drop: float = 0.01) -> bool:
    """Whether a series ordered by compute collapses: collapse_drop > max(k * noise_sd, min_drop).

    k * noise_sd makes the test scale with the eval noise (mean@16 over 1k prompts: sd ~0.004);
    `min_drop` keeps near-noiseless series from flagging tiny wiggles. Series of fewer than 5 points
    are never called collapsing: there is no tail to speak of.
    """
    y = np.asarray(pass_rate, dtype=float)
    if y.size < 5:
        return False
    return collapse_drop(y, tail_frac=tail_frac) > max(k * noise_sd(y), min_drop)


def max_drawdown(pass_rate: ArrayLike) -> float:
    """The largest fall of a series ordered by compute below its running maximum (0 for a rising one)."""
    y = np.asarray(pass_rate, dtype=float)
    if y.size < 2:
        return 0.0
    return float((np.maximum.accumulate(y) - y).max())


def unstable_drop(pass_rate: ArrayLike, *, margin: float = 1.0, min_drop: float = 0.02) -> float | None:
    """How far an unstable series falls below its best, or None for a stable one.

    The series is smoothed by a running median of 3 points (a single eval off the curve, a noisy
    draw or a one-step transient of the policy that the next eval no longer shows, does not move
    it; a fall that lasts two evals does); it is unstable when the smoothed series falls below its running maximum by more
    than `noise_drawdown(n, s)` anywhere, not only at its end: a dip and a recovery count, since
    the sigmoid assumes a monotone rise and neither a fit nor its extrapolation holds across a
    dip. s is the eval noise estimated from the series itself (`curvature_noise_sd`), so the drop
    is judged in units of that noise, and against the largest drop that pure noise gives over n
    points (it grows like sqrt(2 ln n)): white noise around a clean curve is not unstable however
    many evaluations there are, while a fall of several noise sds is. `min_drop` (0.02, the
    paper's noise margin on A) keeps near-noiseless series from flagging wiggles. Series of fewer
    than 4 points are never called unstable.
    """
    y = np.asarray(pass_rate, dtype=float)
    if y.size < 4:
        return None
    drop = max_drawdown(running_median3(y))
    threshold = max(noise_drawdown(y.size, curvature_noise_sd(y), margin=margin), min_drop)
    return drop if drop > threshold else None


def running_median3(y: np.ndarray) -> np.ndarray:
    """The median of each point and its two neighbours; the two end points are kept."""
    if y.size < 3:
        return y.copy()
    out = y.copy()
    out[1:-1] = np.median(np.stack([y[:-2], y[1:-1], y[2:]]), axis=0)
    return out


def transients(pass_rate: ArrayLike, *, k: float = 4.0, min_jump: float = 0.02) -> np.ndarray:
    """Mask of the evals that are one-off drops: a point more than max(k * noise sd, `min_jump`)
    below the median of itself and its two neighbours (so below both neighbours), with the noise sd
    from the series itself (`curvature_noise_sd`). A policy that has one bad step and recovers by
    the next eval is not the curve; a fall that lasts two evals is kept (and may make the series
    unstable). Only drops: a point above both neighbours is as often the top of a rise that then
    falls, which the instability rule must see. End points are never one.
    """
    y = np.asarray(pass_rate, dtype=float)
    mask = np.zeros(y.size, dtype=bool)
    if y.size < 5:
        return mask
    mask[1:-1] = (running_median3(y) - y)[1:-1] > max(k * curvature_noise_sd(y), min_jump)
    return mask


def noise_drawdown(n: int, sd: float, *, margin: float = 1.0) -> float:
    """The largest drawdown of a running median of 3 that white noise of `sd` plausibly gives
    over n points: (2 sqrt(2 ln n) + margin) sd.

    The drawdown is the largest difference of two smoothed points, each ~0.67 sd from the curve;
    the extreme of n of them lies about sqrt(2 ln n) of their sds out, on either side. Measured on
    white noise (with sd estimated by `curvature_noise_sd`, as the rule does), the 99.9th percentile
    of drawdown / sd is below 6.4 at n = 60 and 5.8 at n = 120, against 6.7 and 7.2 here.
    """
    return (2.0 * math.sqrt(2.0 * math.log(max(n, 2))) + margin) * sd


def curvature_noise_sd(pass_rate: ArrayLike) -> float:
    """Robust sd of the measurement noise from second differences (0.0 for fewer than 4 points).

    Like `noise_sd`, but y[i+1] - 2 y[i] + y[i-1] also cancels a steady rise (white noise of sd s
    gives second differences of sd s * sqrt(6)), so the fast early rise of a run, where first
    differences are all large, does not pass for noise.
    """
    y = np.asarray(pass_rate, dtype=float)
    if y.size < 4:
        return 0.0
    d2 = np.diff(y, n=2)
    mad = float(np.median(np.abs(d2 - np.median(d2))))
    return _MAD_TO_SD * mad / math.sqrt(6.0)
