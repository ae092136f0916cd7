"""A model of eval noise along a run, fitted to a curve fit's residuals: white noise + AR(1) drift.

Why: successive evals of one training run are not independent (the policy drifts slowly between
them), and the drift is what makes a single run's asymptote uncertain. Its low-frequency part is
also what a least-squares fit absorbs: residuals are the noise projected away from the curve's
own directions, so they look whiter and smaller than the noise was. Estimating the noise model by
REML (restricted maximum likelihood, which scores only the part of the data the fit did not use)
corrects for exactly that projection; resampling residuals, in blocks or not, cannot.

Model, per seed, in eval order (evals every k steps, so the index is the time axis):
    e_t = x_t + w_t,  x_t = rho x_{t-1} + eta_t  (stationary AR(1) drift),  w_t white,
    var(e_t) = sd^2,  var(x_t) = drift_frac sd^2.
Seeds are independent of each other. Fitted on a grid of (drift_frac, rho) with sd profiled out.

Whitening and re-colouring run through the model's Kalman filter, which produces exactly the
Cholesky whitening L^-1 e of cov = L L^T in O(n) small array operations and no matrix
factorisation: large LAPACK/BLAS-3 calls are avoided on purpose (on small machines OpenBLAS's
thread wake-up can cost ~0.1 s per call, which would dominate a 1,000-curve report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

DRIFT_FRACS = tuple(float(f) for f in np.round(np.linspace(0.1, 1.0, 10), 3))
RHOS = (0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
WHITE_PRIOR = 0.25
"""Prior mass on "no drift"; the rest is spread evenly over the (drift_frac, rho) grid. A judgement
call, measured on 150 synthetic ScaleRL curves (binomial mean@16 noise, sd ~0.004): 95% intervals on
A covered the truth in 0.97 / 0.93 / 0.87 of curves with no drift / AR(1) drift sd 0.002 rho 0.8 /
sd 0.004 rho 0.9; a flat prior over the grid (mass 1/81 on no drift) gave 1.00 / 0.93 / 0.87 with
intervals 15% wider on drift-free curves, prior 1/2 gave 0.96 / 0.90 / 0.88."""


@dataclass(frozen=True)
class NoiseModel:
    """sd: marginal sd of one eval's noise; drift_frac: share of its variance that is AR(1) drift
    with lag-1 correlation rho (drift_frac = 0: white noise)."""

    sd: float
    drift_frac: float
    rho: float

    def __post_init__(self) -> None:
        if not self.sd >= 0:
            raise ValueError(f"sd must be >= 0, got {self.sd!r}")
        if not 0.0 <= self.drift_frac <= 1.0:
            raise ValueError(f"drift_frac must lie in [0, 1], got {self.drift_frac!r}")
        if not 0.0 <= self.rho < 1.0:
            raise ValueError(f"rho must lie in [0, 1), got {self.rho!r}")

    def correlation(self, n: int) -> NDArray[np.float64]:
        """n x n correlation matrix of the noise of n consecutive evals."""
        lag = np.abs(np.subtract.outer(np.arange(n), np.arange(n)))
        return (1.0 - self.drift_frac) * np.eye(n) + self.drift_frac * self.rho**lag

    def whiten(self, series: NDArray[np.float64]) -> NDArray[np.float64]:
        """Uncorrelated unit-variance innovations of a noise series (n,) under this model."""
        x = np.asarray(series, dtype=float)
        unit = _whiten(x[:, None], self._filter(x.size))[:, 0, 0]
        return unit / self.sd if self.sd > 0 else np.zeros_like(unit)

    def color(self, innovations: NDArray[np.float64]) -> NDArray[np.float64]:
        """Noise series (K, n) with this model's covariance from unit innovations (K, n)."""
        u = np.asarray(innovations, dtype=float)
        index = np.zeros(u.shape[0], dtype=np.int64)
        return _color(u, self._filter(u.shape[1]), index, np.full(u.shape[0], self.sd))

    def _filter(self, n: int) -> _Filter:
        return _make_filter(n, np.array([self.drift_frac]), np.array([self.rho]))


@dataclass(frozen=True, eq=False)
class NoisePosterior:
    """The REML likelihood over the (drift_frac, rho) grid, read as a posterior (prior: WHITE_PRIOR
    on white noise, the rest flat over the grid): `best` is the likelihood's maximum (grid point
    `best_index`); `sample` draws models from it, so that a bootstrap also carries the uncertainty
    of the noise model itself. From ~100 points, how much of the noise is slow drift is poorly
    determined, and using only the best model understates the drift as often as not."""

    best: NoiseModel
    best_index: int
    weights: NDArray[np.float64]
    quad: NDArray[np.float64]  # r'Pr at each grid point
    dof: int

    def sample(self, size: int, rng: np.random.Generator) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """(grid indices, sds), each (size,): a grid point by posterior weight, then sd^2 from its
        scaled inverse chi-square posterior quad / chi2(dof)."""
        index = rng.choice(self.weights.size, size=size, p=self.weights)
        return index, np.sqrt(self.quad[index] / rng.chisquare(self.dof, size=size))

    def whiten_best(self, series: NDArray[np.float64]) -> NDArray[np.float64]:
        """Innovations of a series (n,) under the best model, in units of its sd (unit variance)."""
        x = np.asarray(series, dtype=float)
        unit = _whiten(x[:, None], _grid_filter(x.size))[:, self.best_index, 0]
        return unit / self.best.sd if self.best.sd > 0 else np.zeros_like(unit)

    def color(
        self, innovations: NDArray[np.float64], index: NDArray[np.int64], sds: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """Noise series (K, n) from unit innovations (K, n), row k under grid model index[k], sd sds[k]."""
        u = np.asarray(innovations, dtype=float)
        return _color(u, _grid_filter(u.shape[1]), index, sds)


def fit_noise(resid: NDArray[np.float64], jac: NDArray[np.float64], slices: Sequence[slice]) -> NoisePosterior:
    """REML fit of the noise model to the residuals `resid` (n,) of a least-squares fit whose
    Jacobian over its free parameters is `jac` (n, p). `slices` delimit the seeds' series.

    The restricted log-likelihood, with V the unit-scale covariance and sd^2 profiled out, is
        -1/2 [ (n - p) log(r'Pr / (n - p)) + log|V| + log|J'V^-1 J| ],
        P = V^-1 - V^-1 J (J'V^-1 J)^-1 J'V^-1,
    and since P J = 0 the least-squares residuals r stand in for the data. Evaluated on the
    whole (drift_frac, rho) grid at once.
    """
    n, p = jac.shape
    if n - p < 1:
        raise ValueError(f"resid must have more points than parameters ({p}), got {n}")
    num = len(_GRID)
    gram, cross, rr, logdet = np.zeros((num, p, p)), np.zeros((num, p)), np.zeros(num), np.zeros(num)
    for s in slices:
        filt = _grid_filter(s.stop - s.start)
        unit = _whiten(np.column_stack((jac[s], resid[s])), filt)  # (n_s, G, p + 1)
        jt, rt = unit[..., :p], unit[..., p]
        gram = gram + np.einsum("ngp,ngq->gpq", jt, jt)
        cross = cross + np.einsum("ngp,ng->gp", jt, rt)
        rr = rr + np.einsum("ng,ng->g", rt, rt)
        logdet = logdet + filt.logdet
    # A flat or saturated run can leave the Jacobian rank-deficient (a parameter the data do not
    # constrain); a ridge far below the data's scale keeps the solve and log-determinant finite.
    scale = np.maximum(np.trace(gram, axis1=1, axis2=2) / p, 1e-300)
    gram = gram + np.eye(p) * (1e-10 * scale)[:, None, None]
    quad = rr - np.einsum("gp,gp->g", cross, np.linalg.solve(gram, cross[..., None])[..., 0])
    dof = n - p
    var = np.maximum(quad, 1e-300) / dof
    loglik = -0.5 * (dof * np.log(var) + logdet + np.linalg.slogdet(gram)[1])
    loglik = np.where(np.isfinite(loglik), loglik, -np.inf)
    best = int(np.argmax(loglik))
    weights = np.exp(loglik - loglik[best]) * _PRIOR
    frac, rho = _GRID[best]
    return NoisePosterior(
        best=NoiseModel(sd=math.sqrt(float(var[best])), drift_frac=frac, rho=rho),
        best_index=best,
        weights=weights / weights.sum(),
        quad=np.maximum(quad, 0.0),
        dof=dof,
    )


_GRID: tuple[tuple[float, float], ...] = ((0.0, 0.0),) + tuple((f, r) for f in DRIFT_FRACS for r in RHOS)
_PRIOR = np.array([WHITE_PRIOR] + [(1.0 - WHITE_PRIOR) / (len(_GRID) - 1)] * (len(_GRID) - 1))


@dataclass(frozen=True)
class _Filter:
    """Kalman filter constants of G models for n steps, time-major; they depend on the models only."""

    sqrt_f: NDArray[np.float64]  # (n, G) sd of each innovation
    gain: NDArray[np.float64]  # (n, G) Kalman gain
    rho: NDArray[np.float64]  # (G,)
    logdet: NDArray[np.float64]  # (G,) log|V| = sum log F


def _make_filter(n: int, fracs: NDArray[np.float64], rhos: NDArray[np.float64]) -> _Filter:
    white = 1.0 - fracs
    innov = fracs * (1.0 - rhos**2)
    pred = fracs.copy()  # stationary start: var(x_1) = drift_frac
    f_all = np.empty((n, fracs.size))
    gain = np.empty((n, fracs.size))
    for t in range(n):
        f = pred + white  # > 0: either white > 0, or pred = drift variance > 0
        f_all[t] = f
        gain[t] = pred / f
        pred = rhos**2 * pred * white / f + innov
    return _Filter(np.sqrt(f_all), gain, rhos, np.log(f_all).sum(axis=0))


@lru_cache(maxsize=64)
def _grid_filter(n: int) -> _Filter:
    fracs, rhos = (np.array(v) for v in zip(*_GRID, strict=True))
    return _make_filter(n, fracs, rhos)


def _whiten(series: NDArray[np.float64], filt: _Filter) -> NDArray[np.float64]:
    """Standardised innovations (n, G, q) of series (n, q) under each of the filter's G models."""
    n, q = series.shape
    inv_sqrt_f = 1.0 / filt.sqrt_f[:, :, None]
    gain = filt.gain[:, :, None]
    rho = filt.rho[:, None]
    state = np.zeros((filt.rho.size, q))
    out = np.empty((n, filt.rho.size, q))
    for t in range(n):
        v = series[t] - state
        out[t] = v * inv_sqrt_f[t]
        state = rho * (state + gain[t] * v)
    return out


def _color(
    innovations: NDArray[np.float64], filt: _Filter, index: NDArray[np.int64], sds: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Inverse of _whiten: unit innovations (K, n) -> series (K, n), row k under model index[k]."""
    n = innovations.shape[1]
    scale = filt.sqrt_f[:, index] * sds  # (n, K)
    gain = filt.gain[:, index]
    rho = filt.rho[index]
    unit = np.ascontiguousarray(innovations.T)
    state = np.zeros(index.size)
    out = np.empty((n, index.size))
    for t in range(n):
        v = scale[t] * unit[t]
        out[t] = state + v
        state = rho * (state + gain[t] * v)
    return np.ascontiguousarray(out.T)
