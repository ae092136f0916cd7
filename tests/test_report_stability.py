"""Judging an axis with the other axes held fixed, and withholding predictions of unstable runs
(analysis.effects.matched_axis_effect, analysis.diagnostics.unstable_drop, the report's check of
its predictions)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import add_curve_run

from analysis import FitOptions, axis_effect, bootstrap, extrapolate, matched_axis_effect
from analysis.diagnostics import max_drawdown, noise_drawdown, unstable_drop
from analysis.curve import sigmoid
from analysis.synthetic import noisy_curve
from launcher.cli import cli
from store import Store

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "analysis" / "report" / "report.schema.json").read_text())
COMPUTE = np.linspace(0, 16000, 41)
OPTIONS = FitOptions(cutoff=0.0)


def curve(A, Cmid, seed, *, B=1.8, R0=0.1):
    return noisy_curve(COMPUTE, A, B, Cmid, R0, rng=np.random.default_rng(seed), num_prompts=1000, num_samples=8)


def dipping(seed):
    """A run that rises, falls by 0.12 at a third of its compute, and recovers (on the steep rise
    there, the 2-point smoothed series falls ~0.07, some 10 noise sds)."""
    rate = curve(0.7, 3000.0, seed)
    rate[13:17] -= np.array([0.06, 0.12, 0.12, 0.06])
    return rate


# ---------------------------------------------------------------------------------------------
# The instability rule


def test_a_noisy_rise_is_stable_and_a_dip_is_not():
    for seed in range(5):
        assert unstable_drop(curve(0.7, 3000.0, seed)) is None
    drop = unstable_drop(dipping(0))
    assert drop is not None and 0.04 < drop < max_drawdown(dipping(0)) < 0.15
    assert max_drawdown([0.1, 0.2, 0.3]) == 0.0 and max_drawdown([0.1, 0.3, 0.2, 0.4]) == pytest.approx(0.1)
    assert unstable_drop([0.5, 0.1, 0.5]) is None  # too short to judge
    assert unstable_drop([0.1, 0.2, 0.3, 0.4, 0.34, 0.5, 0.6]) is None  # one low point: a median of 3 drops it


def test_the_threshold_scales_with_the_noise():
    rng = np.random.default_rng(3)
    rise = np.linspace(0.1, 0.6, 40)
    assert unstable_drop(rise + rng.normal(0, 0.002, 40)) is None
    wild = rise + rng.normal(0, 0.03, 40)  # 256 prompts x 1 sample: drawdowns of ~0.05 are noise
    assert max_drawdown(wild) > 0.02 and unstable_drop(wild) is None
    step = np.r_[rise[:20], rise[20:] - 0.08]  # a lasting fall of 0.08 against a rise of 0.013 per eval
    assert unstable_drop(step) == pytest.approx(0.08 - 3 * (rise[1] - rise[0]))  # median of 3: the rise goes on
    # One eval off the curve, however far, is a transient the next eval no longer shows; two are a fall.
    one = rise.copy()
    one[20] -= 0.1
    assert unstable_drop(one) is None
    one[21] -= 0.1
    assert unstable_drop(one) is not None


def test_white_noise_around_a_clean_sigmoid_is_never_unstable_and_real_collapses_are():
    # The hardening issue's case: 150 clean sigmoids plus white noise of sd 0.01, 60 evals before C1.
    compute = np.linspace(0, 16000, 121)
    rng = np.random.default_rng(11)
    half = compute <= 8000
    truth = sigmoid(compute, 0.6, 1.8, 2500.0, 0.2)
    flagged, predicted, within = 0, 0, 0
    for _ in range(150):
        rate = np.clip(truth + rng.normal(0, 0.01, compute.size), 0, 1)
        flagged += unstable_drop(rate[half]) is not None
        if _ < 30:  # the half-budget prediction is made, and nearly always lands within 0.02
            e = extrapolate([(compute, rate)], OPTIONS, fit_until=compute[half][-1], predict_at=16000.0, n_boot=20)
            predicted += e.predicts
            within += e.predicts and abs(e.error) < 0.02
    assert flagged == 0 and predicted == 30 and within >= 28
    # A fall of 0.1 that lasts, a dip of 0.08 that recovers: caught at the same noise.
    n = int(half.sum())
    for fall in (np.r_[np.zeros(n - 20), np.full(20, 0.1)], np.r_[np.zeros(30), np.full(6, 0.08), np.zeros(n - 36)]):
        rate = np.clip(truth[half] - fall + rng.normal(0, 0.01, n), 0, 1)
        assert unstable_drop(rate) is not None
    assert noise_drawdown(60, 0.01) == pytest.approx((2 * math.sqrt(2 * math.log(60)) + 1) * 0.01)


def test_an_unstable_window_withholds_the_prediction():
    fit_until = COMPUTE[-1] / 2
    at = {"fit_until": fit_until, "predict_at": COMPUTE[-1], "n_boot": 30}
    stable = extrapolate([(COMPUTE, curve(0.7, 3000.0, 1))], OPTIONS, **at)
    assert stable.withheld is None and stable.predicts and abs(stable.error) < 0.02
    bad = extrapolate([(COMPUTE, dipping(1))], OPTIONS, **at)
    assert bad.withheld is not None and bad.withheld.startswith("unstable: falls 0.0")
    assert bad.withheld.endswith("below its best before C1")
    assert not bad.predicts and math.isnan(bad.predicted) and not bad.band.known
    assert bad.error is None and bad.within_band is None and bad.observed is not None
    # A dip after C1 is not seen by the rule: the prediction is made (and may miss).
    late = curve(0.7, 3000.0, 2)
    late[30:34] -= 0.08
    assert extrapolate([(COMPUTE, late)], OPTIONS, **at).predicts


# ---------------------------------------------------------------------------------------------
# Effects with the other axes held fixed


def grid_fits():
    """A 2 x 2 grid: budget moves A (0.35 vs 0.75), lr moves Cmid only (2x). A step of the long
    budget costs more compute, so its Cmid is larger too (as in flops)."""
    fits = {}
    for i, (budget, A, scale) in enumerate((("8", 0.35, 1.0), ("12", 0.75, 2.0))):
        for j, (lr, Cmid) in enumerate((("low", 2500.0), ("high", 1250.0))):
            fits[budget, lr] = bootstrap([(COMPUTE, curve(A, Cmid * scale, 10 * i + j))], OPTIONS, n_boot=60)
    return fits


def test_matched_contexts_separate_what_pooling_cannot():
    fits = grid_fits()
    lr_contexts = [{lr: fits[b, lr] for lr in ("low", "high")} for b in ("8", "12")]
    budget_contexts = [{b: fits[b, lr] for b in ("8", "12")} for lr in ("low", "high")]
    lr = matched_axis_effect(lr_contexts, axis="optim.lr")
    budget = matched_axis_effect(budget_contexts, axis="length.max_new_tokens")
    assert (budget.verdict, lr.verdict) == ("asymptote", "efficiency")
    assert budget.max_delta_A == pytest.approx(0.4, abs=0.03) and lr.max_delta_A < 0.02
    assert lr.max_Cmid_ratio == pytest.approx(2.0, rel=0.2)
    assert lr.group("high").n_fits == 2 and lr.reference == "low"
    # Pooled over the budget, each lr value holds both ceilings: its A and Cmid spread hides everything.
    pooled = axis_effect({v: [fits["8", v], fits["12", v]] for v in ("low", "high")})
    assert pooled.verdict == "neither"


def test_matched_effect_input_is_checked():
    fits = grid_fits()
    with pytest.raises(ValueError, match="at least one context"):
        matched_axis_effect([{"low": fits["8", "low"]}])
    with pytest.raises(ValueError, match="reference"):
        matched_axis_effect([{"low": fits["8", "low"], "high": fits["8", "high"]}], reference="mid")


# ---------------------------------------------------------------------------------------------
# Through the report


@pytest.fixture
def grid_store(sqlite_url) -> str:
    store = Store(sqlite_url)
    store.upsert_sweep("grid", {}, "/nowhere", "local")
    for i, (budget, A, scale) in enumerate(((8, 0.35, 1.0), (12, 0.75, 2.0))):
        for j, (lr, Cmid) in enumerate(((1e-4, 2500.0), (2e-4, 1250.0))):
            rate = curve(A, Cmid * scale, 100 + 10 * i + j)
            axes = {"budget": budget, "lr": lr, "seed": 0}
            add_curve_run(store, "grid", f"r{i}{j}", axes, COMPUTE, rate, num_samples=8)
    rate = dipping(7)
    add_curve_run(store, "grid", "r-dip", {"budget": 16, "lr": 1e-4, "seed": 0}, COMPUTE, rate, num_samples=8)
    return sqlite_url


def test_report_judges_each_axis_within_matched_runs_and_checks_its_predictions(grid_store):
    runner = CliRunner()
    args = ["--db", grid_store, "report", "grid", "--bootstrap", "60", "--fit-until", "50%", "--predict", "100%"]
    result = runner.invoke(cli, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    jsonschema.validate(report, SCHEMA)
    verdicts = {e["axis"]: e["verdict"] for e in report["effects"]}
    assert verdicts == {"budget": "asymptote", "lr": "efficiency"}
    by_run = {r["run_ids"][0]: r["extrapolation"] for r in report["runs"]}
    assert by_run["r-dip"]["withheld"].startswith("unstable") and by_run["r-dip"]["predicted"] is None
    assert all(e["withheld"] is None and abs(e["error"]) < 0.02 for run, e in by_run.items() if run != "r-dip")
    table = runner.invoke(cli, args, terminal_width=250)
    assert table.exit_code == 0, table.output
    assert "withheld (unstable" in table.output
    assert "within 0.02 of the observed pass rate for 4 of 4 configurations; 1 withheld" in table.output


def test_a_leave_one_out_sweep_compares_each_ablation_with_the_base(sqlite_url):
    """Axes of an `ablate:` sweep: each changed key is compared with the base (the `ablate` label,
    which differs for every run, is not held fixed), and `ablate` itself is judged against base."""
    store = Store(sqlite_url)
    store.upsert_sweep("loo", {}, "/nowhere", "local")
    runs = {
        "base": ({"budget": 12, "lr": 1e-4}, 0.75, 2500.0),
        "lr=0.0002": ({"budget": 12, "lr": 2e-4}, 0.75, 1250.0),
        "budget=8": ({"budget": 8, "lr": 1e-4}, 0.35, 2500.0),
    }
    for i, (name, (axes, A, Cmid)) in enumerate(runs.items()):
        rate = curve(A, Cmid, 200 + i)
        add_curve_run(store, "loo", f"r{i}", {**axes, "ablate": name, "seed": 0}, COMPUTE, rate, num_samples=8)
    result = CliRunner().invoke(cli, ["--db", sqlite_url, "report", "loo", "--bootstrap", "60", "--format", "json"])
    assert result.exit_code == 0, result.output
    effects = {e["axis"]: e for e in json.loads(result.output)["effects"]}
    assert {k: e["verdict"] for k, e in effects.items()} == {
        "budget": "asymptote", "lr": "efficiency", "ablate": "asymptote",
    }  # fmt: skip
    assert effects["ablate"]["reference"] == "base"
    assert effects["lr"]["max_Cmid_ratio"] == pytest.approx(2.0, rel=0.2)


def test_the_observed_value_is_a_trend_adjusted_mean_of_the_points_near_c2():
    from analysis.extrapolation import observed_at

    compute = np.array([0.0, 80.0, 90.0, 100.0])
    rate = np.array([0.1, 0.48, 0.53, 0.5])
    assert observed_at(compute, rate, 100.0) == (pytest.approx((0.53 + 0.5) / 2), 2)  # within 10%
    rising = lambda c: 0.2 + 0.003 * np.asarray(c)  # noqa: E731 - a fitted curve, still rising
    value, n = observed_at(compute, rate, 100.0, trend=rising)
    assert n == 2 and value == pytest.approx((0.53 + 0.03 + 0.5) / 2)  # the point at 90 moved to 100


def test_a_one_eval_transient_is_left_out_of_the_extrapolation():
    from analysis.diagnostics import transients

    rate = curve(0.7, 3000.0, 4)
    at = {"fit_until": COMPUTE[-1] / 2, "predict_at": COMPUTE[-1], "n_boot": 20}
    hit = rate.copy()
    hit[8] -= 0.15  # one bad eval on the rise, gone by the next
    assert transients(hit).nonzero()[0].tolist() == [8] and not transients(rate).any()
    with_hit = extrapolate([(COMPUTE, hit)], OPTIONS, **at)
    without = extrapolate([(np.delete(COMPUTE, 8), np.delete(rate, 8))], OPTIONS, **at)
    assert with_hit.predicts and with_hit.predicted == without.predicted
    lasting = hit.copy()
    lasting[9] -= 0.15  # two evals: a fall, not a transient; the later point stays in the fit
    assert not transients(lasting)[9]


def test_a_one_eval_transient_near_the_end_is_left_out_of_the_observed_and_final_values():
    """The value a prediction is checked against is measured as the fit is: a one-eval drop in
    the last points (a bad step the next eval no longer shows) does not lower the observed pass
    rate of `extrapolate` or the backtest's final."""
    from analysis.backtest import BacktestOptions, final_value

    rate = curve(0.7, 3000.0, 4)
    hit = rate.copy()
    hit[-2] -= 0.15  # within 10% of the last compute, recovered at the last eval
    at = {"fit_until": COMPUTE[-1] / 2, "predict_at": COMPUTE[-1], "n_boot": 20}
    clean = extrapolate([(np.delete(COMPUTE, -2), np.delete(rate, -2))], OPTIONS, **at)
    with_hit = extrapolate([(COMPUTE, hit)], OPTIONS, **at)
    assert with_hit.observed == pytest.approx(clean.observed) and with_hit.n_observed == clean.n_observed
    options = BacktestOptions(fit=OPTIONS)
    assert final_value([(COMPUTE, hit)], options) == pytest.approx(final_value([(np.delete(COMPUTE, -2), np.delete(rate, -2))], options), abs=1e-3)
    assert final_value([(COMPUTE, hit)], options) > np.mean(hit[-2:]) + 0.05  # the drop would have pulled it down
    lasting = hit.copy()
    lasting[-1] -= 0.15  # a fall that lasts to the last eval is measured: two of the five points
    assert extrapolate([(COMPUTE, lasting)], OPTIONS, **at).observed == pytest.approx(clean.observed - 2 * 0.15 / 5, abs=0.01)
