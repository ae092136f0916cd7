"""Bootstrap intervals on A, B, Cmid (and a prediction band) for a fitted curve.

The noise schemes are residual bootstraps around the fit: the eval schedule (which compute points
were measured) is fixed by design, so each replicate keeps the compute points and adds resampled
noise to the fitted curve, y* = f(theta_hat) + e*, then refits. (Resampling (compute, pass_rate)
pairs would leave holes in the curve that the sigmoid's shape parameters are very sensitive to.)
The eval points of one run are a time series: neighbours share the slow drift of one training
trajectory, so the noise must be resampled with its correlation.

"noise_model" (default): fit a white + AR(1) noise model to the residuals by REML
    (analysis.noise), whiten the residuals with it, resample the whitened innovations iid and
    re-colour them (a sieve bootstrap, Kreiss 1992 / Buhlmann 1997, with a REML-fitted
    ARMA(1,1)-type sieve). REML matters: the fit absorbs the low-frequency part of the noise
    along the curve's own directions, exactly the part that moves A, so residuals understate it.
    Each replicate also draws its noise model from the REML posterior over the model grid, so
    that an uncertain amount of drift widens the interval instead of being guessed once.
"block": circular moving-block bootstrap of the residuals (Politis & Romano 1992), block length
    from their lag-1 autocorrelation rho, L = ceil((2 rho / (1 - rho^2))^(2/3) n^(1/3)) (the AR(1)
    form of the Buhlmann-Kunsch / Politis-White n^(1/3) rule). Model-free; right when the noise
    is nearly white, too narrow when the run drifts.
"seeds" (several seeds only): resample whole seeds with replacement (a cluster bootstrap: the
    replicate refits the observed curves weighted by how often each seed was drawn). Carries
    run-to-run variation as the seeds show it; coarse with 2-3 seeds.

Measured coverage of the 95% interval on A (150 synthetic ScaleRL curves, 101 evals to 16k
GPU-hours, binomial mean@16 noise over 1,000 prompts; single runs):
    AR(1) drift added to the noise:   none   sd 0.002 rho 0.8   sd 0.004 rho 0.9
    noise_model                       0.97         0.93               0.87
    block                             0.93         0.79               0.58
Run-to-run variation (each seed's own A drawn with sd 0.008 around the truth) is invisible to a
single run, and only partly visible to a few pooled seeds: coverage of the configuration's A with
3 / 6 pooled seeds was 0.75 / 0.80 (noise_model) and 0.73 / 0.87 (seeds). This is why the paper's
+-0.02 margin on A, not a single run's interval, is the yardstick for "different".

R0: with r0="first", R0 is itself a noisy measurement, so each replicate re-measures it (R0 plus
one resampled noise draw per seed, averaged; under "seeds", the mean first value of the drawn
seeds) instead of treating it as known.
Pooled seeds under the noise schemes: each replicate fills every seed's slot with noise resampled
from a seed drawn with replacement (whole seeds' noise), so a noisier seed's noise travels as a
whole.

Replicates are refitted with the fast method's batched Levenberg-Marquardt, warm-started at the
point estimate; the few that do not converge are refitted from scratch. Intervals are percentile
intervals; `band` is the pointwise percentile band of the replicate curves, i.e. a band for the
mean curve, and `prediction_band` adds the noise of the measurement it will be checked against
(a mean of a few evals, under the fitted noise model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from analysis.curve import FitResult, sigmoid
from analysis.data import CurveLike, as_curve, as_curves
from analysis.fit import fit_problem
from analysis.noise import NoiseModel, NoisePosterior, fit_noise
from analysis.options import DEFAULT_OPTIONS, FitOptions
from analysis.problem import Problem, make_problem, make_space, to_theta
from analysis.solver import I_A, I_LNB, I_LNC, I_R0, Design, levenberg_marquardt, model_and_jac

PARAM_NAMES = ("A", "B", "Cmid", "R0")
Scheme = Literal["noise_model", "block", "seeds"]
SCHEMES = ("noise_model", "block", "seeds")
_NOISE_DRAWS = 16
"""Measurement-noise draws per replicate curve in a prediction band."""


@dataclass(frozen=True)
class Interval:
    """A closed interval [lo, hi]; NaN ends mean "unknown" (nothing contains or overlaps it)."""

    lo: float
    hi: float

    @property
    def known(self) -> bool:
        return math.isfinite(self.lo) and math.isfinite(self.hi)

    @property
    def width(self) -> float:
        return self.hi - self.lo

    def contains(self, value: float) -> bool:
        return self.known and self.lo <= value <= self.hi

    def overlaps(self, other: Interval) -> bool:
        return self.known and other.known and self.lo <= other.hi and other.lo <= self.hi


UNKNOWN = Interval(math.nan, math.nan)


@dataclass(frozen=True, eq=False)
class BootstrapResult:
    """Point fit plus percentile intervals at `level`.

    samples: one row per successful replicate (A, B, Cmid, R0); `n_failed` replicates could not be
    refitted and are left out. scheme: the resampling scheme; noise: the fitted noise model
    ("noise_model" scheme) and block_len: the block length ("block" scheme), else None.
    """

    fit: FitResult
    level: float
    A: Interval
    B: Interval
    Cmid: Interval
    R0: Interval
    n_boot: int
    n_failed: int
    scheme: str
    noise: NoiseModel | None = None
    block_len: int | None = None
    samples: NDArray[np.float64] = field(default_factory=lambda: np.empty((0, 4)), repr=False)

    def interval(self, name: str, level: float | None = None) -> Interval:
        """Percentile interval of parameter `name` (A, B, Cmid, R0) at `level` (default: self.level)."""
        if name not in PARAM_NAMES:
            raise ValueError(f"name must be one of {PARAM_NAMES}, got {name!r}")
        return _percentile(self.samples[:, PARAM_NAMES.index(name)], _level(level, self.level))

    def draws(self, compute: float) -> NDArray[np.float64]:
        """The fitted curve at `compute` in every successful replicate (empty without samples)."""
        a, b, cmid, r0 = (self.samples[:, i] for i in range(4))
        return np.asarray(sigmoid(np.full(a.shape, float(compute)), a, b, cmid, r0), dtype=float)

    def band(self, compute: ArrayLike, level: float | None = None) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Pointwise (lo, hi) band of the fitted curve at `compute`; NaN when there are no samples."""
        lvl = _level(level, self.level)
        c = np.asarray(compute, dtype=float)
        if self.samples.shape[0] == 0:
            nan = np.full(c.shape, np.nan)
            return nan, nan.copy()
        a, b, cmid, r0 = (self.samples[:, i].reshape((-1,) + (1,) * c.ndim) for i in range(4))
        curves = sigmoid(c, a, b, cmid, r0)
        tail = (1.0 - lvl) / 2.0
        lo, hi = np.quantile(curves, [tail, 1.0 - tail], axis=0)
        return lo, hi

    def measurement_sd(self, n_points: int) -> float:
        """sd of the noise of a mean of `n_points` consecutive evals under the fitted noise model
        (its drift does not average away like its white part); 0 without a noise model."""
        if n_points < 1:
            raise ValueError(f"n_points must be >= 1, got {n_points!r}")
        if self.noise is None:
            return 0.0
        return float(self.noise.sd * math.sqrt(self.noise.correlation(n_points).mean()))

    def prediction_band(
        self, compute: float, n_points: int = 1, level: float | None = None, *, seed: int = 0
    ) -> Interval:
        """Band for what will be measured at `compute` as a mean of `n_points` evals: the
        replicate curves there plus that mean's measurement noise (`measurement_sd`), drawn
        `_NOISE_DRAWS` times per replicate. A band for the mean curve alone (`band`) is too narrow
        to hold a measured final once the fit's own uncertainty is small. Deterministic per seed."""
        lvl = _level(level, self.level)
        curve = self.draws(compute)
        if curve.size == 0:
            return UNKNOWN
        sd = self.measurement_sd(n_points)
        noise = np.random.default_rng(seed).standard_normal((curve.size, _NOISE_DRAWS)) * sd
        return _percentile((curve[:, None] + noise).ravel(), lvl)


def bootstrap(
    curves: Sequence[CurveLike],
    options: FitOptions = DEFAULT_OPTIONS,
    *,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    scheme: Scheme = "noise_model",
    block_len: int | None = None,
    fit: FitResult | None = None,
) -> BootstrapResult:
    """Fit one configuration's seeds jointly (one A, B, Cmid) and bootstrap intervals on its
    parameters, each seed's noise its own series (scheme: see the module docstring).

    `fit`: a point fit already made with the same options (saves refitting). `block_len` (block
    scheme only): None chooses it from the residuals. Deterministic for a given `seed`.
    """
    problem = make_problem(as_curves(curves), options)
    return bootstrap_problem(
        problem, options, n_boot=n_boot, seed=seed, level=level, scheme=scheme, block_len=block_len, fit=fit
    )


def bootstrap_problem(
    problem: Problem,
    options: FitOptions,
    *,
    n_boot: int = 200,
    seed: int = 0,
    level: float = 0.95,
    scheme: Scheme = "noise_model",
    block_len: int | None = None,
    fit: FitResult | None = None,
) -> BootstrapResult:
    """Bootstrap a prepared problem (shared by the public entry points)."""
    _check_args(n_boot, level, scheme, block_len)
    fit = fit if fit is not None else fit_problem(problem, options)
    if not fit.ok or n_boot == 0:
        failed = n_boot if not fit.ok else 0
        return _result(fit, level, np.empty((0, 4)), n_boot, failed, scheme, None, None)
    rng = np.random.default_rng(seed)
    theta_hat = to_theta(fit.A, fit.B, fit.Cmid, fit.R0)
    f_hat, jac = model_and_jac(theta_hat[None, :], problem.design)
    resid = problem.pass_rate - f_hat[0]
    seeds = [i for i, s in enumerate(problem.seed_slices()) if s.stop > s.start]
    slices = [problem.seed_slices()[i] for i in seeds]
    noise: NoiseModel | None = None
    weights: NDArray[np.float64] | None = None
    if scheme == "seeds":
        if len(seeds) < 2:
            raise ValueError(f"scheme 'seeds' needs at least 2 seeds with points after the cutoff, got {len(seeds)}")
        counts = rng.multinomial(len(seeds), np.full(len(seeds), 1.0 / len(seeds)), size=n_boot)
        weights = np.zeros((n_boot, resid.size))
        for j, s in enumerate(slices):
            weights[:, s] = counts[:, j : j + 1]
        e_star = np.broadcast_to(resid, (n_boot, resid.size))
        firsts = np.array([problem.first_rates[i] for i in seeds])
        r0_noise = counts @ firsts / len(seeds) - fit.R0
    elif scheme == "noise_model":
        posterior = fit_noise(resid, jac[0][:, make_space(problem, options).free], slices)
        noise = posterior.best
        e_star, r0_noise = noise_model_draws(resid, posterior, slices, n_boot, rng)
    else:
        resid = resid - resid.mean()
        block_len = block_len if block_len is not None else auto_block_len(resid, slices)
        e_star = block_draws(resid, slices, n_boot, block_len, rng)
        r0_noise = resid[rng.integers(0, resid.size, size=(n_boot, len(slices)))].mean(axis=1)
    theta0 = np.tile(theta_hat, (n_boot, 1))
    if options.r0 == "first":
        theta0[:, I_R0] = fit.R0 + r0_noise
    samples, n_failed = _refit(problem, options, theta0, f_hat[0] + e_star, weights)
    return _result(fit, level, samples, n_boot, n_failed, scheme, noise, block_len if scheme == "block" else None)


def noise_model_draws(
    resid: NDArray[np.float64],
    posterior: NoisePosterior,
    slices: Sequence[slice],
    n_boot: int,
    rng: np.random.Generator,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(n_boot, n) noise series, and (n_boot,) noise draws for re-measuring R0.

    Each replicate draws a noise model from the REML posterior (NoisePosterior.sample), then
    re-colours innovations resampled iid from the residuals whitened under the best model and
    standardised to mean 0, sd 1 (their shape, e.g. skew or heavy tails, is kept; their scale comes
    from the model, because whitening leaves them slightly under-dispersed: the fit used p of
    their degrees of freedom). R0 gets one innovation per seed slot, averaged, times the sd.
    """
    pools = [_standardise(posterior.whiten_best(resid[s])) for s in slices]
    index, sds = posterior.sample(n_boot, rng)
    out = np.empty((n_boot, resid.size))
    r0_noise = np.zeros(n_boot)
    for s in slices:
        unit = _pooled_draws(pools, _seed_draw(len(slices), n_boot, rng), s.stop - s.start + 1, rng)
        out[:, s] = posterior.color(unit[:, 1:], index, sds)
        r0_noise += sds * unit[:, 0] / len(slices)
    return out, r0_noise


def _pooled_draws(
    pools: Sequence[NDArray[np.float64]], src: NDArray[np.int64], n: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    """(len(src), n) iid draws, row k from pools[src[k]]."""
    sizes = np.array([p.size for p in pools])
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    flat: NDArray[np.float64] = np.concatenate(pools)
    idx = np.floor(rng.random((src.size, n)) * sizes[src][:, None]).astype(np.int64)
    draws: NDArray[np.float64] = flat[idx + offsets[src][:, None]]
    return draws


def auto_block_len(resid: NDArray[np.float64], slices: Sequence[slice]) -> int:
    """Block length from the pooled lag-1 autocorrelation of the residuals (module docstring)."""
    num = sum(float(np.dot(resid[s][:-1], resid[s][1:])) for s in slices)
    den = sum(float(np.dot(resid[s], resid[s])) for s in slices)
    rho = min(max(num / den, 0.0), 0.95) if den > 0 else 0.0
    n = int(np.median([s.stop - s.start for s in slices]))
    length = math.ceil((2 * rho / (1 - rho**2)) ** (2 / 3) * n ** (1 / 3))
    return int(min(max(length, 1), max(1, n // 4)))


def block_draws(
    resid: NDArray[np.float64], slices: Sequence[slice], n_boot: int, block_len: int, rng: np.random.Generator
) -> NDArray[np.float64]:
    """(n_boot, n) residual series: per seed slot, a seed drawn with replacement (when there are
    several), then circular blocks of `block_len` consecutive residuals of that seed."""
    out = np.zeros((n_boot, resid.size))
    starts = np.array([s.start for s in slices])
    sizes = np.array([s.stop - s.start for s in slices])
    for s in slices:
        n = s.stop - s.start
        src = _seed_draw(len(slices), n_boot, rng)
        num_blocks = -(-n // block_len)
        first = np.floor(rng.random((n_boot, num_blocks)) * sizes[src][:, None]).astype(int)
        offsets = (first[:, :, None] + np.arange(block_len)) % sizes[src][:, None, None]
        idx = (offsets + starts[src][:, None, None]).reshape(n_boot, -1)[:, :n]
        out[:, s] = resid[idx]
    return out


def _seed_draw(num_seeds: int, n_boot: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """Which seed each replicate takes its noise from: any seed, with replacement."""
    if num_seeds == 1:
        return np.zeros(n_boot, dtype=np.int64)
    return rng.integers(0, num_seeds, size=n_boot)


def _standardise(x: NDArray[np.float64]) -> NDArray[np.float64]:
    sd = float(np.std(x))
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


def _refit(
    problem: Problem,
    options: FitOptions,
    theta0: NDArray[np.float64],
    y_star: NDArray[np.float64],
    weights: NDArray[np.float64] | None,
) -> tuple[NDArray[np.float64], int]:
    """Refit all replicates at once; refit the non-converged ones one by one from scratch."""
    space = make_space(problem, options)
    res = levenberg_marquardt(theta0, y_star, problem.design, space, weights=weights)
    theta = res.theta.copy()
    ok = res.converged & np.isfinite(res.sse)
    fast = options.replace(method="fast")
    for k in np.flatnonzero(~ok):
        replica = _replica(problem, y_star[k], None if weights is None else weights[k], float(theta0[k, I_R0]))
        fit = fit_problem(replica, fast, fallback=False)  # never the reference grid per replicate
        if fit.ok:
            theta[k] = to_theta(fit.A, fit.B, fit.Cmid, fit.R0)
            ok[k] = True
    good = theta[ok]
    samples = np.column_stack((good[:, I_A], np.exp(good[:, I_LNB]), np.exp(good[:, I_LNC]), good[:, I_R0]))
    return samples, int((~ok).sum())


def _replica(
    problem: Problem, pass_rate: NDArray[np.float64], weights: NDArray[np.float64] | None, r0: float
) -> Problem:
    """Replicate k as a plain problem (points repeated by their integer weights) for a scalar refit."""
    if weights is None:
        return replace(problem, pass_rate=pass_rate, r0=r0)
    idx = np.repeat(np.arange(pass_rate.size), weights.astype(np.int64))
    compute = problem.compute[idx]
    return replace(
        problem,
        compute=compute,
        pass_rate=pass_rate[idx],
        lengths=(idx.size,),
        r0=r0,
        design=Design.from_compute(compute),
    )


def _result(
    fit: FitResult,
    level: float,
    samples: NDArray[np.float64],
    n_boot: int,
    n_failed: int,
    scheme: str,
    noise: NoiseModel | None,
    block_len: int | None,
) -> BootstrapResult:
    a, b, cmid, r0 = (_percentile(samples[:, i], level) for i in range(4))
    samples.setflags(write=False)  # part of a frozen result
    return BootstrapResult(
        fit, level, a, b, cmid, r0, n_boot, n_failed, scheme, noise=noise, block_len=block_len, samples=samples
    )


def _percentile(values: NDArray[np.float64], level: float) -> Interval:
    if values.size == 0:
        return UNKNOWN
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return Interval(float(lo), float(hi))


def _level(level: float | None, default: float) -> float:
    lvl = default if level is None else level
    if not 0 < lvl < 1:
        raise ValueError(f"level must lie in (0, 1), got {lvl!r}")
    return lvl


def _check_args(n_boot: int, level: float, scheme: str, block_len: int | None) -> None:
    if n_boot < 0:
        raise ValueError(f"n_boot must be >= 0, got {n_boot!r}")
    _level(level, level)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if block_len is not None and block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len!r}")
