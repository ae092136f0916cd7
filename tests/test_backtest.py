"""The backtest (`analysis.backtest`, `sweep report --backtest`) on synthetic curves with known answers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.backtest import BacktestOptions, backtest
from analysis.curve import sigmoid
from analysis.synthetic import noisy_curve
from conftest import paper_sweep
from launcher.cli import cli
from store import NewRun, Store

COMPUTE = np.linspace(0, 16000, 81)
# name -> (A, B, Cmid): distinct ceilings, so the final order is the order of A.
KNOWN = {"low": (0.50, 1.8, 3000.0), "mid": (0.60, 1.9, 2500.0), "high": (0.70, 1.7, 4000.0)}
OPTIONS = BacktestOptions(n_boot=50, workers=1, cuts=(0.2, 0.5, 0.9))


def _clean() -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    return {k: [(COMPUTE, sigmoid(COMPUTE, A, B, Cmid, 0.3))] for k, (A, B, Cmid) in KNOWN.items()}


def test_noiseless_sigmoids_are_predicted_from_a_fifth_of_the_compute():
    result = backtest(_clean(), OPTIONS)
    for cut in result.cuts:
        assert cut.n_predicted == 3
        assert cut.max_abs_error < 0.005, cut.fraction
        assert cut.tau == pytest.approx(1.0) and cut.tau_separated == pytest.approx(1.0)
        assert cut.winner == "high"
        assert cut.p_best_winner > 0.9
    assert result.earliest() == 0.2


def test_finals_are_the_true_curve_end_within_eval_noise():
    rng = np.random.default_rng(3)
    data = {k: [(COMPUTE, noisy_curve(COMPUTE, A, B, Cmid, 0.3, rng=rng)) for _ in range(2)] for k, (A, B, Cmid) in KNOWN.items()}
    result = backtest(data, OPTIONS)
    for x in result.cuts[-1].configs:
        A, B, Cmid = KNOWN[x.label]
        assert x.final == pytest.approx(float(sigmoid(np.array(16000.0), A, B, Cmid, 0.3)), abs=0.01)
    half = result.cuts[1]
    assert half.share_within == 1.0 and half.tau == pytest.approx(1.0)
    assert half.coverage is not None and half.coverage >= 2 / 3


def test_a_run_that_collapses_late_is_a_miss_at_early_cuts():
    data = _clean()
    c, r = data["high"][0]
    r = r.copy()
    r[c > 12000] -= np.linspace(0.0, 0.3, int((c > 12000).sum()))
    data["high"] = [(c, r)]
    result = backtest(data, OPTIONS)
    half = result.cuts[1]
    high = next(x for x in half.configs if x.label == "high")
    assert high.error > 0.1  # predicted the ceiling it never reached
    assert half.n_within == 2 and half.winner == "mid"
    assert half.tau < 1.0
    assert result.earliest() is None


def test_a_sweep_whose_finals_all_agree_is_called_on_its_errors_alone():
    """Three configurations that end within 0.02 of each other have no order to predict: tau over
    the separated pairs is undefined, and the sweep is called from the first cut whose
    predictions are within 0.02."""
    close = {"a": (0.60, 1.8, 3000.0), "b": (0.61, 1.9, 2800.0), "c": (0.605, 1.7, 3200.0)}
    data = {k: [(COMPUTE, sigmoid(COMPUTE, A, B, Cmid, 0.3))] for k, (A, B, Cmid) in close.items()}
    result = backtest(data, OPTIONS)
    assert all(cut.tau_separated is None and cut.share_within == 1.0 for cut in result.cuts)
    assert result.earliest() == 0.2


def test_tau_apart_ignores_pairs_that_end_within_the_noise():
    from analysis.backtest import ConfigCut, separated_tau

    def cut(label: str, predicted: float, final: float) -> ConfigCut:
        return ConfigCut(label, 0.5, predicted, predicted - 0.01, predicted + 0.01, final, None)

    # a and b end 0.005 apart and are predicted in the wrong order; c is far above both
    cuts = [cut("a", 0.36, 0.355), cut("b", 0.35, 0.360), cut("c", 0.72, 0.72)]
    assert separated_tau(cuts, 0.02) == 1.0
    assert separated_tau(cuts, 0.001) == pytest.approx(1 / 3)
    assert separated_tau(cuts[:2], 0.02) is None


def test_withheld_predictions_count_as_misses():
    # three points before 20%: too few to fit
    sparse = np.concatenate(([0.0, 1000.0, 2000.0], np.linspace(4000, 16000, 13)))
    data = {k: [(sparse, sigmoid(sparse, A, B, Cmid, 0.3))] for k, (A, B, Cmid) in KNOWN.items()}
    cut = backtest(data, OPTIONS).cuts[0]
    assert cut.n_predicted == 0 and cut.share_within == 0.0 and cut.tau is None
    assert all(x.withheld and "too_few_points" in x.withheld for x in cut.configs)


def test_bad_cuts_are_refused():
    with pytest.raises(ValueError, match="cuts must be fractions"):
        BacktestOptions(cuts=(0.5, 1.0))


@pytest.fixture
def paper_db(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'sweeps.db'}"
    paper_sweep(Store(url), COMPUTE, ("scalerl", "scout"), rng_seed=7, collapse_tail=20)
    return url


def test_cli_prints_the_table_and_writes_the_plot(paper_db, tmp_path):
    out = tmp_path / "plots"
    result = CliRunner().invoke(
        cli, ["--db", paper_db, "report", "paper", "--backtest", "--bootstrap", "50", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    for pct in range(10, 100, 10):
        assert f"{pct}%" in result.output
    assert "winner (highest final): variant=" in result.output
    assert (out / "paper-backtest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_has_every_cut_and_every_configuration(paper_db, tmp_path):
    result = CliRunner().invoke(
        cli,
        ["--db", paper_db, "report", "paper", "--backtest", "--format", "json", "--bootstrap", "50", "--out", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [c["fraction"] for c in doc["cuts"]] == [0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    labels = {x["label"] for x in doc["cuts"][5]["configs"]}
    assert labels == {"variant=scalerl", "variant=scout", "variant=collapse"}
    collapse = next(x for x in doc["cuts"][5]["configs"] if x["label"] == "variant=collapse")
    assert collapse["error"] is None or collapse["error"] > 0.02  # predicted the climb, not the fall


@pytest.mark.parametrize("args", [["--format", "csv"], ["--fit-until", "50%", "--predict", "100%"]])
def test_cli_refuses_what_the_backtest_does_not_do(paper_db, args):
    result = CliRunner().invoke(cli, ["--db", paper_db, "report", "paper", "--backtest", *args])
    assert result.exit_code == 2
    assert "--backtest takes --format table or json" in result.output


def test_cli_on_a_sweep_without_points_is_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'sweeps.db'}"
    store = Store(url)
    store.upsert_sweep("empty", {}, "/nowhere", "local")
    store.register_runs("empty", [NewRun("r-0", 0, {}, {"seed": 0}, {}, "/nowhere")])
    result = CliRunner().invoke(cli, ["--db", url, "report", "empty", "--backtest", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "no completed configuration with evaluation points" in result.output and "Traceback" not in result.output
