"""Bootstrap intervals and the noise model behind them: coverage, determinism, pooling, band."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from analysis import FitOptions, bootstrap, fit_curves, sigmoid
from analysis.intervals import auto_block_len
from analysis.noise import NoiseModel, fit_noise
from analysis.synthetic import PAPER_TABLE1, ar1_drift, noisy_curve

COMPUTE = np.linspace(0.0, 16_000.0, 101)  # an eval every 100 steps of a 16k-GPU-hour run
OPTIONS = FitOptions(cutoff=1500.0)
R0 = 0.35


BUDGETS = {"scalerl": 16_000.0, "bs2048": 100_000.0, "gen32k": 100_000.0, "scout": 50_000.0}


def test_interval_on_a_covers_the_truth_in_at_least_90_percent_of_noisy_curves() -> None:
    """160 synthetic runs (the four Table 1 curves to their budgets, 40 each, 101 evals): binomial
    mean@16 noise over 1,000 prompts plus AR(1) drift (sd 0.002, rho 0.8). The 95% interval must
    cover the true A in >= 90% of them, and must not buy that by being uselessly wide (median width
    < the paper's 0.02 margin)."""
    hits, widths = [], []
    for i in range(160):
        name = sorted(PAPER_TABLE1)[i % 4]
        A, B, Cmid = PAPER_TABLE1[name]
        compute = np.linspace(0.0, BUDGETS[name], 101)
        rate = noisy_curve(compute, A, B, Cmid, R0, rng=np.random.default_rng(10_000 + i))
        options = FitOptions(cutoff=BUDGETS[name] * 1500 / 16000)
        boot = bootstrap([(compute, rate)], options=options, seed=i)
        hits.append(boot.A.contains(A))
        widths.append(boot.A.width)
    assert np.mean(hits) >= 0.90
    assert np.median(widths) < 0.02


def test_same_seed_same_intervals_other_seed_other_samples() -> None:
    rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(1))
    a = bootstrap([(COMPUTE, rate)], options=OPTIONS, seed=3)
    b = bootstrap([(COMPUTE, rate)], options=OPTIONS, seed=3)
    c = bootstrap([(COMPUTE, rate)], options=OPTIONS, seed=4)
    np.testing.assert_array_equal(a.samples, b.samples)
    assert a.A == b.A and a.B == b.B
    assert not np.array_equal(a.samples, c.samples)


def test_intervals_contain_the_point_fit_and_scale_with_noise() -> None:
    quiet = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(2), num_prompts=10_000, drift_sd=0)
    loud = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(2), num_prompts=100, drift_sd=0)
    bq, bl = (bootstrap([(COMPUTE, r)], options=OPTIONS) for r in (quiet, loud))
    for boot in (bq, bl):
        assert boot.A.contains(boot.fit.A) and boot.B.contains(boot.fit.B) and boot.Cmid.contains(boot.fit.Cmid)
        assert boot.n_failed == 0 and boot.samples.shape == (200, 4)
    assert bl.A.width > 3 * bq.A.width  # 100x the eval samples: ~10x less noise


def test_band_brackets_the_fit_and_the_true_curve() -> None:
    rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(4))
    boot = bootstrap([(COMPUTE, rate)], options=OPTIONS)
    at = np.linspace(2000.0, 16_000.0, 15)
    lo, hi = boot.band(at)
    assert np.all(lo <= boot.fit.predict(at)) and np.all(boot.fit.predict(at) <= hi)
    truth = sigmoid(at, 0.61, 1.92, 2542.0, R0)
    assert np.mean((lo <= truth) & (truth <= hi)) >= 0.8
    lo50, hi50 = boot.band(at, level=0.5)
    assert np.all(hi50 - lo50 < hi - lo)


def test_prediction_band_holds_a_measured_final_that_the_curve_band_misses() -> None:
    """20 runs fitted on their first half, checked against the one eval measured at the end (20
    and 17 of 20 held when written): the curve band is a band for the mean curve, narrower than
    that eval's own noise, so it misses finals that the prediction band (curve plus measurement
    noise) holds."""
    curve_hits, prediction_hits = 0, 0
    for i in range(20):
        rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(500 + i))
        boot = bootstrap([(COMPUTE[:51], rate[:51])], options=OPTIONS, seed=i)
        final = rate[-1]
        lo, hi = boot.band(COMPUTE[-1])
        curve_hits += bool(lo <= final <= hi)
        prediction_hits += boot.prediction_band(COMPUTE[-1], n_points=1).contains(final)
    assert prediction_hits >= 18
    assert prediction_hits > curve_hits


def test_measurement_noise_of_a_mean_averages_its_white_part_not_its_drift() -> None:
    rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(6))
    boot = bootstrap([(COMPUTE, rate)], options=OPTIONS)
    white = replace(boot, noise=NoiseModel(sd=0.01, drift_frac=0.0, rho=0.0))
    drifting = replace(boot, noise=NoiseModel(sd=0.01, drift_frac=1.0, rho=0.95))
    assert white.measurement_sd(1) == pytest.approx(0.01)
    assert white.measurement_sd(4) == pytest.approx(0.005)
    assert 0.009 < drifting.measurement_sd(4) < 0.01
    assert replace(boot, noise=None).measurement_sd(4) == 0.0
    one, four = (white.prediction_band(16_000.0, n) for n in (1, 4))
    assert four.width < one.width and one.contains(float(boot.fit.predict(16_000.0)))
    lo, hi = boot.band(16_000.0)
    assert one.lo < lo and hi < one.hi
    with pytest.raises(ValueError, match="n_points"):
        white.measurement_sd(0)


def test_pooled_seeds_narrow_the_interval() -> None:
    rng = np.random.default_rng(6)
    seeds = [(COMPUTE, noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=rng)) for _ in range(4)]
    one = bootstrap([seeds[0]], options=OPTIONS)
    pooled = bootstrap(seeds, options=OPTIONS)
    assert pooled.fit.n_points == 4 * one.fit.n_points
    assert pooled.A.width < 0.8 * one.A.width
    assert pooled.A.contains(0.61)


def test_fixed_a_gives_a_degenerate_a_interval() -> None:
    rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(8))
    boot = bootstrap([(COMPUTE, rate)], options=OPTIONS.replace(fix_a=0.6))
    assert boot.fit.A == 0.6 and boot.A.lo == boot.A.hi == 0.6
    assert boot.B.width > 0


def test_failed_fit_gives_unknown_intervals() -> None:
    boot = bootstrap([(COMPUTE[:5], np.full(5, 0.3))], options=OPTIONS)
    assert not boot.fit.ok and not boot.A.known and boot.n_failed == 200
    assert not boot.A.contains(0.3) and not boot.A.overlaps(boot.B)
    assert np.isnan(boot.band([1000.0])[0]).all()


def test_block_scheme_runs_and_picks_its_block_length_from_the_residuals() -> None:
    rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(9))
    boot = bootstrap([(COMPUTE, rate)], options=OPTIONS, scheme="block")
    assert boot.scheme == "block" and boot.block_len is not None and boot.A.contains(boot.fit.A)
    rng = np.random.default_rng(0)
    white = rng.normal(size=100)
    drifting = ar1_drift(100, sd=1.0, rho=0.9, rng=rng)
    assert auto_block_len(white, [slice(0, 100)]) <= 2
    assert auto_block_len(drifting, [slice(0, 100)]) >= 6


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_boot": -1}, "n_boot"),
        ({"level": 1.0}, "level"),
        ({"scheme": "pairs"}, "scheme"),
        ({"block_len": 0}, "block_len"),
    ],
)
def test_bootstrap_rejects_bad_arguments_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        bootstrap([(COMPUTE, np.full(COMPUTE.size, 0.4))], **kwargs)


def test_bootstrap_reuses_a_given_fit() -> None:
    rate = noisy_curve(COMPUTE, 0.61, 1.92, 2542.0, R0, rng=np.random.default_rng(12))
    fit = fit_curves([(COMPUTE, rate)], FitOptions(cutoff=1500.0))
    assert bootstrap([(COMPUTE, rate)], options=OPTIONS, fit=fit).fit is fit


# --------------------------------------------------------------------------- noise model


def test_kalman_whitening_equals_cholesky_whitening() -> None:
    model = NoiseModel(sd=0.004, drift_frac=0.4, rho=0.8)
    chol = np.linalg.cholesky(model.sd**2 * model.correlation(40))
    series = np.random.default_rng(0).normal(size=40)
    np.testing.assert_allclose(model.whiten(series) * model.sd, np.linalg.solve(chol, series) * model.sd, atol=1e-12)
    unit = np.random.default_rng(1).normal(size=(3, 40))
    np.testing.assert_allclose(model.color(unit), unit @ chol.T, atol=1e-15)


def test_reml_noise_fit_recovers_drift_and_recognises_white_noise() -> None:
    rng = np.random.default_rng(0)
    n = 600
    jac = np.column_stack((np.ones(n), np.linspace(0, 1, n)))  # a fit of level and slope
    drifting = ar1_drift(n, sd=0.003, rho=0.8, rng=rng) + rng.normal(0, 0.003, n)
    resid = drifting - jac @ np.linalg.lstsq(jac, drifting, rcond=None)[0]
    fitted = fit_noise(resid, jac, [slice(0, n)]).best
    assert 0.3 <= fitted.drift_frac <= 0.7 and 0.6 <= fitted.rho <= 0.9
    assert fitted.sd == pytest.approx(np.sqrt(2) * 0.003, rel=0.15)
    white = rng.normal(0, 0.004, n)
    resid = white - jac @ np.linalg.lstsq(jac, white, rcond=None)[0]
    assert fit_noise(resid, jac, [slice(0, n)]).best.drift_frac <= 0.1


def test_seeds_scheme_resamples_whole_seeds() -> None:
    rng = np.random.default_rng(21)
    seeds = [(COMPUTE, noisy_curve(COMPUTE, A, 1.92, 2542.0, R0, rng=rng)) for A in (0.59, 0.61, 0.63)]
    boot = bootstrap(seeds, options=OPTIONS, scheme="seeds", n_boot=100)
    assert boot.n_failed == 0 and boot.A.contains(boot.fit.A)
    firsts = [s[1][0] for s in seeds]
    assert min(firsts) <= boot.samples[:, 3].min() and boot.samples[:, 3].max() <= max(firsts)
    # the seeds' asymptotes are 0.02 apart: replicates drawing mostly one seed must show it
    assert boot.samples[:, 0].max() - boot.samples[:, 0].min() > 0.02
    with pytest.raises(ValueError, match="seeds"):
        bootstrap([seeds[0]], options=OPTIONS, scheme="seeds")


def test_bootstrap_of_a_run_that_never_learns_does_not_raise() -> None:
    """A short run stuck at zero (a real tiny sweep produced this) leaves the Jacobian
    rank-deficient; the bootstrap must still answer."""
    from analysis import bootstrap, fit_curves

    compute = [0.0, 3e7, 6e7, 1.2e8, 2.4e8, 3e8, 6e8, 9e8]
    pass_rate = [0.0, 0.0, 0.0, 0.0, 0.0, 0.015625, 0.0, 0.0]
    fit = fit_curves([(compute, pass_rate)])
    result = bootstrap([(compute, pass_rate)], n_boot=50, fit=fit)
    assert result.fit is fit
    assert result.n_boot == 50
