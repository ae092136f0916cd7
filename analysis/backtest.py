"""Backtest: how early could a finished sweep have been called?

For each cut fraction f (10%, 20%, ..., 90%), every configuration is fitted on its points up to
f x its own largest compute and extrapolated to that largest compute, exactly as
`sweep report --fit-until f --predict 100%` would have done at the time; the prediction is then
checked against the final pass rate that the configuration went on to reach. Per cut:

- the prediction error (predicted - final) of each configuration, and the share within `tol`
  (0.02, the paper's noise margin on A), counting configurations without a prediction as misses;
- the band's coverage: the share of predicted configurations whose final lies in the band;
- Kendall's tau between the predicted and the final order (over the predicted configurations),
  and the same over the pairs whose finals differ by more than `tol` only (`tau_separated`);
- p_best of the eventual winner: the bootstrap's probability, at that cut, that the configuration
  which finished highest is the best.

"final" is the observed pass rate at the end (`analysis.extrapolation.observed_at`: the points within
`window` of the last compute, moved along a fit on the whole run to it and averaged, a seed's
one-eval transients left out as the fits leave them out), so one noisy last eval does not decide
the check.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from scipy.stats import kendalltau

from analysis.data import CurveLike, as_curves
from analysis.extrapolation import Extrapolation, extrapolate, measured_points, observed_at
from analysis.fit import fit_curves
from analysis.options import DEFAULT_OPTIONS, FitOptions
from analysis.ranking import p_best

DEFAULT_CUTS: tuple[float, ...] = tuple(sorted({round(0.1 * i, 1) for i in range(1, 10)} | {0.25}))
TOLERANCE = 0.02
PARALLEL_ABOVE = 4  # (configuration, cut) jobs / 9; below this a process pool costs more than it saves


@dataclass(frozen=True, kw_only=True)
class BacktestOptions:
    """How the backtest fits: the fit's options, bootstrap size, band level, the error tolerance."""

    fit: FitOptions = DEFAULT_OPTIONS
    cuts: tuple[float, ...] = DEFAULT_CUTS
    n_boot: int = 200
    level: float = 0.95
    tol: float = TOLERANCE
    window: float = 0.1
    seed: int = 0
    workers: int | None = None
    ceiling_axes: tuple[str, ...] | None = None
    """The axes that set the ceiling: at each cut, configurations that agree on them (and on every
    axis that already moves A) share one A (`analysis.ceilings`), as `sweep report --fit-until`
    extrapolates; None: each configuration its own A."""

    def __post_init__(self) -> None:
        if not self.cuts or not all(math.isfinite(f) and 0 < f < 1 for f in self.cuts):
            raise ValueError(f"cuts must be fractions in (0, 1), got {self.cuts!r}")
        object.__setattr__(self, "cuts", tuple(sorted(set(float(f) for f in self.cuts))))
        if self.n_boot < 1:
            raise ValueError(f"n_boot must be >= 1, got {self.n_boot!r}")
        if not 0 < self.level < 1:
            raise ValueError(f"level must lie in (0, 1), got {self.level!r}")
        if not self.tol > 0:
            raise ValueError(f"tol must be > 0, got {self.tol!r}")


@dataclass(frozen=True)
class ConfigCut:
    """One configuration at one cut: the prediction of its final pass rate and how it fared."""

    label: str
    fraction: float
    predicted: float  # NaN when withheld
    lo: float
    hi: float
    final: float | None
    withheld: str | None
    shared_with: int = 1
    """How many configurations share the A of this prediction (`analysis.ceilings`); 1: its own."""
    task_ceiling: float | None = None
    """The task's ceiling where A was held there (`analysis.ceilings.holds_ceiling`), else None."""

    @property
    def predicts(self) -> bool:
        return self.withheld is None and math.isfinite(self.predicted)

    @property
    def error(self) -> float | None:
        return self.predicted - self.final if self.predicts and self.final is not None else None

    @property
    def covered(self) -> bool | None:
        if not self.predicts or self.final is None or not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return None
        return self.lo <= self.final <= self.hi


@dataclass(frozen=True)
class CutSummary:
    """Every configuration at one cut fraction, and the figures that say how good the call was."""

    fraction: float
    configs: tuple[ConfigCut, ...]
    tau: float | None
    tau_separated: float | None
    """Kendall's tau over the pairs whose finals differ by more than tol: two configurations that
    end within the eval noise of each other have no order for a prediction to get right."""
    winner: str | None
    p_best_winner: float | None
    tol: float

    @property
    def n(self) -> int:
        return len(self.configs)

    @property
    def n_predicted(self) -> int:
        return sum(c.predicts for c in self.configs)

    @property
    def errors(self) -> list[float]:
        return [e for c in self.configs if (e := c.error) is not None]

    @property
    def n_within(self) -> int:
        return sum(abs(e) <= self.tol for e in self.errors)

    @property
    def share_within(self) -> float:
        """Configurations within tol of their final, over all configurations (withheld = miss)."""
        return self.n_within / self.n if self.n else math.nan

    @property
    def coverage(self) -> float | None:
        judged = [c.covered for c in self.configs if c.covered is not None]
        return sum(judged) / len(judged) if judged else None

    @property
    def median_abs_error(self) -> float | None:
        return float(np.median(np.abs(self.errors))) if self.errors else None

    @property
    def max_abs_error(self) -> float | None:
        return float(np.max(np.abs(self.errors))) if self.errors else None


@dataclass(frozen=True)
class Backtest:
    options: BacktestOptions
    cuts: tuple[CutSummary, ...]

    def earliest(self, *, share: float = 0.9, tau: float = 0.8) -> float | None:
        """The first cut from which every later cut has >= `share` within tol and a tau over the
        separated pairs >= `tau` (a cut with no such pair, every final within tol of the others,
        has no order to get right)."""
        ok = [c.share_within >= share and (c.tau_separated is None or c.tau_separated >= tau) for c in self.cuts]
        for i in range(len(ok)):
            if all(ok[i:]):
                return self.cuts[i].fraction
        return None


def backtest(
    configs: Mapping[str, Sequence[CurveLike]],
    options: BacktestOptions = BacktestOptions(),
    axes: Mapping[str, Mapping[str, Any]] | None = None,
    task_ceilings: Mapping[str, float] | None = None,
) -> Backtest:
    """Replay the extrapolation of every configuration (label -> its seeds' curves) at each cut;
    with `axes` (label -> its axis values) and `options.ceiling_axes`, configurations that share a
    ceiling share one A, held at the task's ceiling (`task_ceilings`: label -> value) where the
    windows do not reject it (`analysis.ceilings`)."""
    if not configs:
        raise ValueError("backtest needs at least one configuration")
    data = {label: as_curves(curves) for label, curves in configs.items()}
    jobs = [(label, curves, f, options) for f in options.cuts for label, curves in data.items()]
    workers = options.workers or len(os.sched_getaffinity(0))
    if len(data) >= PARALLEL_ABOVE and workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    else:
        results = [_one(job) for job in jobs]
    finals = {label: final_value(curves, options) for label, curves in data.items()}
    cuts = []
    for f in options.cuts:
        at_cut = [(cut, ex) for cut, ex in results if cut.fraction == f]
        if options.ceiling_axes is not None and axes is not None and (len(at_cut) > 1 or task_ceilings):
            at_cut = _shared(at_cut, data, axes, options, task_ceilings)
        summarised = [(replace(cut, final=finals[cut.label]), _draws(ex)) for cut, ex in at_cut]
        cuts.append(_summarise(f, summarised, options.tol))
    return Backtest(options=options, cuts=tuple(cuts))


def _one(job: tuple[str, list, float, BacktestOptions]) -> tuple[ConfigCut, Extrapolation | None]:
    label, curves, fraction, options = job
    end = max(float(c.max()) for c, _ in curves)
    fit_until = fraction * end
    try:
        ex = extrapolate(
            curves, options.fit, fit_until=fit_until, predict_at=end,
            n_boot=options.n_boot, seed=options.seed, level=options.level, window=options.window,
        )  # fmt: skip
    except ValueError as exc:  # a cut below the fit's cutoff
        return ConfigCut(label, fraction, math.nan, math.nan, math.nan, None, f"not fitted: {exc}"), None
    return _config_cut(label, fraction, ex), ex


def _config_cut(label: str, fraction: float, ex: Extrapolation) -> ConfigCut:
    return ConfigCut(
        label, fraction, ex.predicted, ex.band.lo, ex.band.hi, None, ex.withheld, ex.shared_with, ex.task_ceiling
    )


def _draws(ex: Extrapolation | None) -> np.ndarray:
    return ex.bootstrap.draws(ex.predict_at) if ex is not None and ex.predicts else np.empty(0)


def _shared(
    at_cut: list[tuple[ConfigCut, Extrapolation | None]],
    data: Mapping[str, list],
    axes: Mapping[str, Mapping[str, Any]],
    options: BacktestOptions,
    task_ceilings: Mapping[str, float] | None = None,
) -> list[tuple[ConfigCut, Extrapolation | None]]:
    """One cut's extrapolations with shared ceilings (`analysis.ceilings.share_ceilings`)."""
    from analysis.ceilings import share_ceilings
    from analysis.ranking import ConfigResult, Curve

    configs = [
        ConfigResult(
            label=cut.label,
            axes=dict(axes.get(cut.label, {})),
            curves=tuple(Curve(cut.label, None, "completed", tuple(map(float, c)), tuple(map(float, r))) for c, r in data[cut.label]),
            fit=ex.fit,
            extrapolation=ex,
        )
        for cut, ex in at_cut
        if ex is not None
    ]
    shared = {
        c.label: c.extrapolation
        for c in share_ceilings(
            configs, options.fit, ceiling_axes=options.ceiling_axes,
            n_boot=options.n_boot, level=options.level, window=options.window, seed=options.seed,
            task_ceilings=task_ceilings,
        )  # fmt: skip
    }
    out = []
    for cut, ex in at_cut:
        new = shared.get(cut.label)
        out.append((cut, ex) if new is None else (_config_cut(cut.label, cut.fraction, new), new))
    return out


def final_value(curves: list, options: BacktestOptions) -> float | None:
    """The final pass rate: the points within `window` of the last compute, each moved along a fit
    on all the data to it, then averaged (one value for every cut)."""
    end = max(float(c.max()) for c, _ in curves)
    c_all, r_all = measured_points(curves)
    full = fit_curves(curves, options.fit)
    value, _ = observed_at(c_all, r_all, end, window=options.window, trend=full.predict if full.ok else None)
    return value


def _summarise(fraction: float, results: list[tuple[ConfigCut, np.ndarray]], tol: float) -> CutSummary:
    cuts = [c for c, _ in results]
    finals = {c.label: c.final for c in cuts if c.final is not None}
    winner = max(finals, key=lambda k: finals[k]) if finals else None
    predicted = [c for c in cuts if c.predicts and c.final is not None]
    tau = None
    if len(predicted) >= 2:
        value = kendalltau([c.predicted for c in predicted], [c.final for c in predicted]).statistic
        tau = None if value is None or math.isnan(value) else float(value)
    probabilities = p_best([d for _, d in results])
    p_winner = next((p for (c, _), p in zip(results, probabilities) if c.label == winner), None)
    return CutSummary(fraction, tuple(cuts), tau, separated_tau(predicted, tol), winner, p_winner, tol)


def separated_tau(cuts: Sequence[ConfigCut], tol: float) -> float | None:
    """(concordant - discordant) / pairs, over the pairs whose finals differ by more than tol."""
    signs = [
        np.sign(a.predicted - b.predicted) * np.sign(a.final - b.final)  # type: ignore[operator]
        for i, a in enumerate(cuts)
        for b in cuts[i + 1 :]
        if abs(a.final - b.final) > tol  # type: ignore[operator]
    ]
    return float(np.mean(signs)) if signs else None
