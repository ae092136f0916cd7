"""The paper's comparison rule, extrapolation from half the budget, and per-axis effects."""

from __future__ import annotations

import numpy as np
import pytest

from analysis import FitOptions, axis_effect, bootstrap, compare, extrapolate, fit_curves, sigmoid
from analysis.extrapolation import observed_at
from analysis.intervals import Interval
from analysis.synthetic import noisy_curve

COMPUTE = np.linspace(0.0, 16_000.0, 101)
OPTIONS = FitOptions(cutoff=1500.0)
R0 = 0.35


def run(A: float, B: float, Cmid: float, seed: int, **noise: float) -> tuple[np.ndarray, np.ndarray]:
    return COMPUTE, noisy_curve(COMPUTE, A, B, Cmid, R0, rng=np.random.default_rng(seed), **noise)


# --------------------------------------------------------------------------- compare


def test_equal_a_different_b_the_higher_b_is_more_efficient() -> None:
    steep, shallow = run(0.61, 2.4, 2542.0, seed=1), run(0.61, 1.5, 2542.0, seed=2)
    verdict = compare(shallow, steep, labels=("shallow", "steep"), options=OPTIONS)
    assert verdict.rule == "efficiency" and verdict.winner == "steep" and verdict.resolved
    assert verdict.shared_A == pytest.approx(0.61, abs=0.01)
    assert verdict.shared_A == pytest.approx(sum(verdict.A) / 2)
    assert verdict.B is not None and verdict.B[1] > verdict.B[0]
    assert verdict.shared_fits is not None and all(f.fit.A == verdict.shared_A for f in verdict.shared_fits)
    assert "steep is more efficient" in verdict.reason


def test_asymptotes_apart_the_higher_a_wins_however_slow() -> None:
    low_fast, high_slow = run(0.61, 2.4, 2000.0, seed=3), run(0.71, 1.5, 4000.0, seed=4)
    verdict = compare(low_fast, high_slow, options=OPTIONS)
    assert verdict.rule == "asymptote" and verdict.winner == "b" and verdict.resolved
    assert verdict.delta_A == pytest.approx(-0.1, abs=0.01)
    assert verdict.shared_A is None and verdict.B is None


def test_a_within_the_margin_goes_to_b_even_when_intervals_separate() -> None:
    quiet = {"num_prompts": 4000, "drift_sd": 0.001}
    a, b = run(0.62, 1.7, 2542.0, seed=5, **quiet), run(0.607, 2.3, 2542.0, seed=6, **quiet)
    verdict = compare(a, b, options=OPTIONS)
    lo_a, lo_b = verdict.A_interval
    assert not lo_a.overlaps(lo_b)  # separable, yet within the paper's noise margin
    assert verdict.rule == "efficiency" and verdict.winner == "b"
    assert compare(a, b, margin=0.01, options=OPTIONS).rule == "asymptote"


def test_compare_accepts_seeds_and_reports_failed_fits() -> None:
    seeds = [run(0.61, 1.92, 2542.0, seed=s) for s in (7, 8)]
    verdict = compare(seeds, run(0.70, 1.92, 2542.0, seed=9), n_boot=50, options=OPTIONS)
    assert verdict.rule == "asymptote" and verdict.winner == "b"
    short = (COMPUTE[:12], noisy_curve(COMPUTE[:12], 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(0)))
    failed = compare(short, seeds[0], n_boot=20, options=OPTIONS)
    assert failed.rule == "undetermined" and failed.winner is None and "too_few_points" in failed.reason


def test_compare_without_bootstrap_uses_the_margin_alone() -> None:
    a, b = run(0.61, 2.4, 2542.0, seed=10), run(0.615, 1.5, 2542.0, seed=11)
    verdict = compare(a, b, n_boot=0, options=OPTIONS)
    assert not verdict.A_interval[0].known
    assert verdict.rule == "efficiency" and verdict.winner == "a" and not verdict.resolved


@pytest.mark.parametrize(("kwargs", "name"), [({"margin": -0.1}, "margin"), ({"labels": ("x", "x")}, "labels")])
def test_compare_rejects_bad_arguments_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        compare(run(0.6, 2, 2000, 0), run(0.6, 2, 2000, 1), **kwargs)


# --------------------------------------------------------------------------- extrapolate


def test_extrapolation_from_half_the_budget_lands_in_its_band() -> None:
    """The paper's use: fit to 8k of 16k GPU-hours, predict 16k (clean curve, eval noise only)."""
    compute, rate = run(0.61, 1.92, 2542.0, seed=12, drift_sd=0.0)
    result = extrapolate([(compute, rate)], fit_until=8000.0, predict_at=16_000.0, options=OPTIONS)
    assert result.fit.compute_max == 8000.0
    assert result.band.lo < result.predicted < result.band.hi
    assert result.observed is not None and result.n_observed == 11  # points within 10% of 16k
    assert result.within_band
    assert abs(result.error) < 0.01
    truth = float(sigmoid(16_000.0, 0.61, 1.92, 2542.0, R0))
    assert result.band.contains(truth)


def test_extrapolation_pools_seeds_as_separate_series() -> None:
    """Seeds are fitted jointly, each its own series: the prediction's fit is the pooled fit of
    every seed's points up to fit_until, and the observation averages every seed."""
    seeds = [run(0.61, 1.92, 2542.0, seed=s, drift_sd=0.004) for s in (21, 22, 23)]
    result = extrapolate(seeds, fit_until=8000.0, predict_at=16_000.0, n_boot=20, options=OPTIONS)
    pooled = fit_curves([(c[c <= 8000.0], r[c <= 8000.0]) for c, r in seeds], OPTIONS)
    assert result.fit.A == pytest.approx(pooled.A) and result.fit.Cmid == pytest.approx(pooled.Cmid)
    assert result.n_observed == 3 * 11  # 11 points within 10% of 16k, from each seed
    assert result.bootstrap.fit.n_points == pooled.n_points


def test_extrapolation_beyond_the_data_has_no_observation() -> None:
    compute, rate = run(0.61, 1.92, 2542.0, seed=13)
    result = extrapolate([(compute, rate)], fit_until=16_000.0, predict_at=32_000.0, n_boot=50, options=OPTIONS)
    assert result.observed is None and result.error is None and result.within_band is None
    assert result.predicted == pytest.approx(result.fit.predict(32_000.0))
    assert result.band.width > 0


def test_observed_value_averages_near_points_or_interpolates() -> None:
    compute = np.array([0.0, 100.0, 200.0, 1000.0])
    rate = np.array([0.1, 0.2, 0.4, 0.5])
    assert observed_at(compute, rate, 200.0, window=0.05) == (0.4, 1)
    assert observed_at(compute, rate, 600.0, window=0.05) == (pytest.approx(0.45), 0)
    assert observed_at(compute, rate, 2000.0) == (None, 0)


def test_extrapolate_rejects_fit_until_below_the_cutoff() -> None:
    with pytest.raises(ValueError, match="fit_until"):
        extrapolate([run(0.6, 2, 2000, 0)], fit_until=1000.0, predict_at=16_000.0, options=OPTIONS)


# --------------------------------------------------------------------------- effects


def seed_fits(A: float, B: float, Cmid: float, first_seed: int, n: int = 3) -> list:
    return [fit_curves([run(A, B, Cmid, seed=first_seed + i)], FitOptions(cutoff=1500.0)) for i in range(n)]


def test_axis_that_moves_the_asymptote() -> None:
    effect = axis_effect(
        {"cispo": seed_fits(0.61, 1.92, 2542.0, 100), "dapo": seed_fits(0.55, 1.92, 2542.0, 200)}, axis="loss.type"
    )
    assert effect.verdict == "asymptote" and effect.moves_asymptote
    dapo = effect.group("dapo")
    assert effect.reference == "cispo" and dapo.delta_A == pytest.approx(-0.06, abs=0.01)
    assert dapo.n_fits == 3 and dapo.A_interval.known
    assert effect.max_delta_A == pytest.approx(0.06, abs=0.01)


def test_axis_that_moves_only_efficiency() -> None:
    effect = axis_effect(
        {"pipeline": seed_fits(0.61, 2.3, 2542.0, 300), "ppo-offpolicy": seed_fits(0.61, 1.5, 2542.0, 400)}
    )
    assert effect.verdict == "efficiency" and not effect.moves_asymptote and effect.moves_efficiency
    assert effect.group("ppo-offpolicy").B_ratio == pytest.approx(1.5 / 2.3, rel=0.1)
    assert effect.max_B_ratio == pytest.approx(2.3 / 1.5, rel=0.1)


def test_axis_that_moves_nothing() -> None:
    effect = axis_effect({"k4": seed_fits(0.61, 1.92, 2542.0, 500), "k8": seed_fits(0.61, 1.92, 2542.0, 600)})
    assert effect.verdict == "neither"
    assert effect.max_delta_A < 0.02


def test_overlapping_bootstrap_intervals_keep_a_large_gap_from_counting() -> None:
    """Noisy short runs: A differs by more than the margin, but the intervals overlap."""
    a = bootstrap([run(0.63, 1.9, 4000.0, seed=730, num_prompts=60)], options=OPTIONS)
    b = bootstrap([run(0.60, 1.9, 4000.0, seed=731, num_prompts=60)], options=OPTIONS)
    assert abs(a.fit.A - b.fit.A) > 0.02 and a.A.overlaps(b.A)
    assert not axis_effect({"x": a, "y": b}).moves_asymptote
    assert axis_effect({"x": a.fit, "y": b.fit}).moves_asymptote  # no intervals: the margin decides


def test_axis_effect_rejects_bad_input_by_name() -> None:
    fits = seed_fits(0.61, 1.92, 2542.0, 800, n=1)
    with pytest.raises(ValueError, match="groups"):
        axis_effect({"only": fits})
    with pytest.raises(ValueError, match="reference"):
        axis_effect({"a": fits, "b": fits}, reference="c")


def test_interval_semantics() -> None:
    assert Interval(0.1, 0.2).overlaps(Interval(0.2, 0.3))
    assert not Interval(0.1, 0.2).overlaps(Interval(0.21, 0.3))
    assert not Interval(float("nan"), 0.2).overlaps(Interval(0.0, 1.0))


def test_effect_options_are_one_validated_object() -> None:
    from analysis import EffectOptions

    groups = {"cispo": seed_fits(0.61, 1.92, 2542.0, 100), "dapo": seed_fits(0.55, 1.92, 2542.0, 200)}
    assert axis_effect(groups).moves_asymptote
    assert not axis_effect(groups, EffectOptions(margin=0.1)).moves_asymptote  # dA 0.06 is inside a 0.1 margin
    with pytest.raises(ValueError, match="b_tol must be >= 0"):
        EffectOptions(b_tol=-1.0)
    with pytest.raises(ValueError, match="level must lie in"):
        EffectOptions(level=1.5)
