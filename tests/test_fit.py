"""Fitting the ScaleRL sigmoid: the curve, both methods, R0 modes, cutoff, flags, validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import analysis.fit as fit_module
from analysis import (
    FLAG_A_AT_BOUND,
    FLAG_CMID_BEYOND_DATA,
    FLAG_COLLAPSING,
    FLAG_FIT_FAILED,
    FLAG_TOO_FEW_POINTS,
    FitOptions,
    fit_curves,
        predict,
    sigmoid,
)
from analysis.options import PAPER_A_GRID, resolve_a_grid
from analysis.problem import fixed_theta, from_theta, make_problem, make_space
from analysis.solver import step_start
from analysis.synthetic import PAPER_TABLE1, noisy_curve

# Table 1 runs with the compute they were run to (ScaleRL's long run and Scout: shorter here).
RUNS = {
    "scalerl": (*PAPER_TABLE1["scalerl"], 16_000.0),
    "bs2048": (*PAPER_TABLE1["bs2048"], 100_000.0),
    "gen32k": (*PAPER_TABLE1["gen32k"], 100_000.0),
    "scout": (*PAPER_TABLE1["scout"], 50_000.0),
}
R0 = 0.35


def table1_curve(name: str, num: int = 101) -> tuple[np.ndarray, np.ndarray, float]:
    """Noise-free curve of a Table 1 run, evals from 0 to its budget; returns the paper's cutoff
    (1.5k of 16k GPU-hours, scaled)."""
    A, B, Cmid, cmax = RUNS[name]
    compute = np.linspace(0.0, cmax, num)
    return compute, sigmoid(compute, A, B, Cmid, R0), cmax * 1500 / 16000


# --------------------------------------------------------------------------- the curve


def test_sigmoid_anchor_points() -> None:
    c = np.array([0.0, 2542.0, 1e12])
    r = sigmoid(c, 0.61, 1.92, 2542.0, 0.35)
    assert r[0] == 0.35  # C = 0 is exactly R0, no division by zero
    assert r[1] == pytest.approx((0.61 + 0.35) / 2)
    assert r[2] == pytest.approx(0.61, abs=1e-12)


def test_sigmoid_matches_the_paper_formula_and_broadcasts() -> None:
    c = np.linspace(100, 50_000, 7)
    expected = 0.3 + (0.7 - 0.3) / (1 + (4000 / c) ** 1.65)
    np.testing.assert_allclose(sigmoid(c, 0.7, 1.65, 4000, 0.3), expected, rtol=1e-12)
    many = sigmoid(c, np.array([[0.6], [0.7]]), 1.65, 4000, 0.3)
    assert many.shape == (2, 7)
    np.testing.assert_allclose(many[1], expected, rtol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"compute": [-1.0]}, "compute"), ({"B": 0.0}, "B"), ({"Cmid": -5.0}, "Cmid")]
)
def test_sigmoid_rejects_bad_values_by_name(kwargs: dict, name: str) -> None:
    args = {"compute": [1.0], "A": 0.6, "B": 1.5, "Cmid": 100.0, "R0": 0.3} | kwargs
    with pytest.raises(ValueError, match=name):
        sigmoid(**args)


# --------------------------------------------------------------------------- recovery


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fast_recovers_table1(name: str) -> None:
    A, B, Cmid, _ = RUNS[name]
    compute, rate, cutoff = table1_curve(name)
    fit = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff))
    assert fit.method == "fast"
    assert abs(fit.A - A) <= 0.005
    assert abs(fit.B / B - 1) <= 0.05
    assert abs(fit.Cmid / Cmid - 1) <= 0.05
    assert fit.R0 == R0 and fit.r2 > 0.9999 and fit.flags == ()


@pytest.mark.parametrize("name", sorted(RUNS))
def test_fast_recovers_table1_under_eval_noise(name: str) -> None:
    """Binomial mean@16 noise over 1,000 prompts plus AR(1) drift: A stays well inside the paper's
    +-0.02 noise margin."""
    A, B, Cmid, cmax = RUNS[name]
    compute = np.linspace(0.0, cmax, 121)
    rate = noisy_curve(compute, A, B, Cmid, R0, rng=np.random.default_rng(7))
    fit = fit_curves([(compute, rate)], FitOptions(cutoff=cmax * 1500 / 16000))
    assert abs(fit.A - A) <= 0.01
    assert abs(fit.B / B - 1) <= 0.2


def test_reference_recovers_scalerl() -> None:
    A, B, Cmid, _ = RUNS["scalerl"]
    compute, rate, cutoff = table1_curve("scalerl", num=61)
    fit = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff, method="reference"))
    assert fit.method == "reference"
    assert abs(fit.A - A) <= 0.005
    assert abs(fit.B / B - 1) <= 0.05
    assert abs(fit.Cmid / Cmid - 1) <= 0.05  # the Cmid grid step here is 0.4 GPU-kh, 1.6% of Cmid


def test_fast_reaches_reference_sse_on_noisy_curves() -> None:
    """The fast method must reach the paper's grid search's squared error or lower."""
    rng = np.random.default_rng(11)
    cases = [("scalerl", 0.35), ("bs2048", 0.30), ("scout", 0.40), ("gen32k", 0.25)]
    for name, r0 in cases:
        A, B, Cmid, cmax = RUNS[name]
        compute = np.linspace(0.0, cmax, 50)
        rate = noisy_curve(compute, A, B, Cmid, r0, rng=rng, drift_sd=0.004)
        cutoff = cmax * 1500 / 16000
        fast = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff))
        ref = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff, method="reference"))
        assert fast.sse <= ref.sse * (1 + 1e-9), (name, fast, ref)
    # a run that barely learns, in very noisy evals: the best fits are near steps (B on its bound,
    # so the fast method also runs the reference and keeps the better)
    compute = np.linspace(0.0, 200.0, 55)
    rate = noisy_curve(compute, 0.1, 1.5, 30.0, 0.08, rng=rng, num_prompts=50, drift_sd=0.01)
    fast = fit_curves([(compute, rate)], FitOptions(cutoff=40.0, r0="fit"))
    ref = fit_curves([(compute, rate)], FitOptions(cutoff=40.0, r0="fit", method="reference"))
    assert fast.sse <= ref.sse * (1 + 1e-9), (fast, ref)


def test_step_start_finds_the_jump_no_gradient_can() -> None:
    compute = np.arange(0.0, 201.0, 10.0)
    rate = np.where(compute < 95.0, 0.3, 0.6)
    problem = make_problem([(compute, rate)], FitOptions(r0="fit"))
    space = make_space(problem, FitOptions(r0="fit"))
    theta = step_start(rate, problem.design, space, fixed_theta(problem, FitOptions(r0="fit")))
    assert theta is not None
    A, B, Cmid, r0 = from_theta(theta)
    assert (A, r0) == (pytest.approx(0.6), pytest.approx(0.3)) and 90.0 < Cmid < 100.0 and B == pytest.approx(1000)


def test_fast_falls_back_to_reference_when_it_ends_on_a_b_bound() -> None:
    compute, rate, cutoff = table1_curve("scalerl", num=41)
    fit = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff, b_bounds=(0.05, 1.0)))  # true B = 1.92
    assert fit.method == "fast->reference"
    assert fit.B == pytest.approx(1.92, rel=0.05)


def test_warm_start_reproduces_the_cold_fit() -> None:
    A, B, Cmid, cmax = RUNS["scout"]
    compute = np.linspace(0.0, cmax, 101)
    rate = noisy_curve(compute, A, B, Cmid, R0, rng=np.random.default_rng(3))
    early = fit_curves([(compute[:70], rate[:70])], FitOptions(cutoff=3000))
    cold = fit_curves([(compute, rate)], FitOptions(cutoff=3000))
    warm = fit_curves([(compute, rate)], FitOptions(cutoff=3000), start=early)
    assert warm.sse <= cold.sse * (1 + 1e-9)
    assert warm.A == pytest.approx(cold.A, abs=1e-5)


# --------------------------------------------------------------------------- R0, cutoff, compute 0


def test_r0_first_uses_the_first_eval_even_before_the_cutoff() -> None:
    compute, rate, _ = table1_curve("scalerl")
    rate = rate.copy()
    rate[0] = 0.3
    fit = fit_curves([(compute, rate)], FitOptions(cutoff=1500))
    assert fit.R0 == 0.3
    assert fit.compute_min >= 1500 and fit.n_points == int((compute >= 1500).sum())


def test_r0_fit_recovers_r0_when_evals_start_late() -> None:
    A, B, Cmid, _ = RUNS["scalerl"]
    compute = np.linspace(800.0, 16_000.0, 80)  # first eval already well up the curve
    rate = sigmoid(compute, A, B, Cmid, 0.2)
    fitted = fit_curves([(compute, rate)], FitOptions(r0="fit"))
    assert fitted.R0 == pytest.approx(0.2, abs=0.005)
    assert fitted.A == pytest.approx(A, abs=0.005)
    first = fit_curves([(compute, rate)])  # the documented bias of "first" when C1 is not << Cmid
    assert first.R0 == pytest.approx(rate[0]) and first.R0 > 0.2 + 0.01


def test_r0_float_is_held() -> None:
    compute, rate, cutoff = table1_curve("scout")
    fit = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff, r0=0.35))
    assert fit.R0 == 0.35 and abs(fit.A - RUNS["scout"][0]) < 1e-4


@pytest.mark.filterwarnings("error")
def test_compute_zero_gives_no_warnings() -> None:
    compute, rate, _ = table1_curve("scalerl")
    assert compute[0] == 0.0
    fit = fit_curves([(compute, rate)])  # the C = 0 point is inside the fitted window
    assert fit.compute_min == 0.0 and fit.r2 > 0.9999
    assert predict(fit, [0.0])[0] == fit.R0


def test_unsorted_input_is_sorted_by_compute() -> None:
    compute, rate, cutoff = table1_curve("scout")
    order = np.random.default_rng(0).permutation(compute.size)
    a = fit_curves([(compute[order], rate[order])], FitOptions(cutoff=cutoff))
    b = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff))
    assert a == b


def test_pooled_seeds_fit_one_curve() -> None:
    A, B, Cmid, cmax = RUNS["scalerl"]
    compute = np.linspace(0.0, cmax, 81)
    rng = np.random.default_rng(5)
    seeds = [(compute, noisy_curve(compute, A, B, Cmid, R0, rng=rng)) for _ in range(3)]
    fit = fit_curves(seeds, options=FitOptions(cutoff=1500))
    assert fit.n_points == 3 * int((compute >= 1500).sum())
    assert fit.R0 == pytest.approx(np.mean([s[1][0] for s in seeds]))
    assert abs(fit.A - A) < 0.006


# --------------------------------------------------------------------------- the reference A grid


def test_a_grid_defaults_to_the_papers_and_widens_to_the_data() -> None:
    assert PAPER_A_GRID[0] == 0.45 and PAPER_A_GRID[-1] == 0.8 and len(PAPER_A_GRID) == 71
    options = FitOptions()
    np.testing.assert_allclose(resolve_a_grid(options, np.array([0.3, 0.7])), PAPER_A_GRID)
    wide = resolve_a_grid(options, np.array([0.1, 0.98]))
    assert wide[0] == 0.45 and wide[-1] == 1.0 and len(wide) == 111
    np.testing.assert_allclose(np.diff(wide), 0.005, atol=1e-9)
    low = resolve_a_grid(options, np.array([0.05, 0.3]))
    assert low[0] <= 0.05 and low[-1] == 0.8
    assert resolve_a_grid(FitOptions(widen_a_grid=False), np.array([0.98]))[-1] == 0.8


def test_reference_widens_its_a_grid_for_a_toy_task_near_one() -> None:
    """Our CPU toy task climbs to ~0.98: the paper's grid tops out at 0.8 and would misfit."""
    compute = np.linspace(0.0, 200.0, 40)
    rate = sigmoid(compute, 0.985, 1.5, 40.0, 0.1)
    widened = fit_curves([(compute, rate)], FitOptions(method="reference", num_cmid=25))
    paper = fit_curves([(compute, rate)], FitOptions(method="reference", num_cmid=25, widen_a_grid=False))
    assert widened.A > 0.95
    assert paper.A == 0.8 and FLAG_A_AT_BOUND in paper.flags
    assert widened.sse < paper.sse / 50


# --------------------------------------------------------------------------- flags


def test_flag_a_at_bound() -> None:
    compute, rate, cutoff = table1_curve("scout")  # A = 0.71
    bounded = fit_curves([(compute, rate)], FitOptions(cutoff=cutoff, a_bounds=(0.0, 0.65)))
    assert bounded.A == pytest.approx(0.65) and bounded.flags == (FLAG_A_AT_BOUND,)
    assert FLAG_A_AT_BOUND not in fit_curves([(compute, rate)], FitOptions(cutoff=cutoff)).flags


def test_flag_cmid_beyond_data() -> None:
    compute = np.linspace(0.0, 16_000.0, 101)
    rate = sigmoid(compute, 0.62, 2.0, 24_000.0, 0.3)  # half the gain only at 24k
    fit = fit_curves([(compute, rate)])
    assert fit.Cmid == pytest.approx(24_000, rel=0.01)
    assert FLAG_CMID_BEYOND_DATA in fit.flags
    compute, rate, cutoff = table1_curve("scalerl")
    assert FLAG_CMID_BEYOND_DATA not in fit_curves([(compute, rate)], FitOptions(cutoff=cutoff)).flags


def test_flag_too_few_points_returns_nan_instead_of_raising() -> None:
    compute, rate, _ = table1_curve("scalerl")
    fit = fit_curves([(compute[:14], rate[:14])], FitOptions(cutoff=1500))  # 4 points at >= 1500
    assert fit.flags == (FLAG_TOO_FEW_POINTS,) and fit.n_points == 4
    assert np.isnan(fit.A) and np.isnan(fit.B) and np.isnan(fit.Cmid) and not fit.ok
    assert np.isnan(predict(fit, [1000.0, 2000.0])).all()
    assert fit_curves([(compute[:15], rate[:15])], FitOptions(cutoff=1500)).ok  # 5 points: enough


def test_flag_too_few_points_counts_free_parameters() -> None:
    compute, rate, _ = table1_curve("scalerl")
    assert fit_curves([(compute[:5], rate[:5])], FitOptions(min_points=1)).ok  # A, B, Cmid from 4 points at C > 0
    assert not fit_curves([(compute[:5], rate[:5])], FitOptions(min_points=1, r0="fit")).ok  # 4 parameters


def test_flag_collapsing() -> None:
    A, B, Cmid, cmax = RUNS["scalerl"]
    compute = np.linspace(0.0, cmax, 101)
    rng = np.random.default_rng(2)
    rate = noisy_curve(compute, A, B, Cmid, R0, rng=rng)
    rate[70:] -= np.linspace(0.0, 0.08, 31)  # the last 30% of the run loses 0.08
    assert FLAG_COLLAPSING in fit_curves([(compute, rate)], FitOptions(cutoff=1500)).flags
    healthy = [noisy_curve(compute, A, B, Cmid, R0, rng=rng, drift_sd=0.003) for _ in range(40)]
    assert not any(FLAG_COLLAPSING in fit_curves([(compute, r)], FitOptions(cutoff=1500)).flags for r in healthy)


def test_flag_fit_failed_when_no_method_produces_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit_module, "_fast", lambda *a, **k: None)
    monkeypatch.setattr(fit_module, "_reference", lambda *a, **k: None)
    compute, rate, _ = table1_curve("scalerl")
    fit = fit_curves([(compute, rate)])
    assert fit.flags == (FLAG_FIT_FAILED,) and not fit.ok and np.isnan(fit.A)


def test_has_rejects_unknown_flags() -> None:
    compute, rate, _ = table1_curve("scalerl")
    with pytest.raises(ValueError, match="flag"):
        fit_curves([(compute, rate)]).has("A_on_bound")


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("compute", "rate", "kwargs", "name"),
    [
        ([0, 1, 2], [0.1, 0.2], {}, "pass_rate"),
        ([0, 1, -2], [0.1, 0.2, 0.3], {}, "compute"),
        ([0, 1, 2], [0.1, 0.2, 1.3], {}, "pass_rate"),
        ([0, 1, np.nan], [0.1, 0.2, 0.3], {}, "compute"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"r0": "median"}, "r0"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"r0": 1.5}, "r0"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"method": "slow"}, "method"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"cutoff": -1.0}, "cutoff"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"a_bounds": (0.8, 0.2)}, "a_bounds"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"b_bounds": (0.0, 3.0)}, "b_bounds"),
        ([0, 1, 2], [0.1, 0.2, 0.3], {"cmid_range": (10.0, 5.0)}, "cmid_range"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(compute: list, rate: list, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        fit_curves([(compute, rate)], FitOptions(**kwargs))




def test_degenerate_fits_are_flagged_and_not_ranked():
    from analysis.ranking import ConfigResult, rank

    rng = np.random.default_rng(0)
    one_compute = fit_curves([(np.full(10, 5.0), 0.4 + rng.normal(0, 0.01, 10))])  # no compute spread
    assert "degenerate" in one_compute.flags
    c = np.linspace(0, 800, 17)
    log_shaped = 0.3 + 0.01 * np.log1p(c)  # B ~0.37: below a lower bound of 0.5, on it
    assert "degenerate" not in fit_curves([(c, log_shaped)]).flags
    assert "degenerate" in fit_curves([(c, log_shaped)], FitOptions(b_bounds=(0.5, 1000.0))).flags
    clean = fit_curves([(c, sigmoid(c, 0.7, 1.5, 200.0, 0.1))])
    assert clean.flags == ()
    high_but_degenerate = dataclasses.replace(clean, A=0.9, flags=("degenerate",))
    configs = [ConfigResult("degenerate", {}, (), high_but_degenerate), ConfigResult("clean", {}, (), clean)]
    assert [(c.label, c.rank) for c in rank(configs)] == [("clean", 1), ("degenerate", None)]
    assert [(c.label, c.rank) for c in rank(configs, include_flagged=True)] == [("degenerate", 1), ("clean", 2)]
