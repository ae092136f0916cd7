"""`sweep report` over curves written into a real store: ranking, seeds pooled, flags kept out of
the ranking, extrapolation, the documented JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from analysis.synthetic import PAPER_TABLE1
from launcher.cli import cli
from conftest import paper_sweep
from store import Store

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "analysis" / "report" / "report.schema.json").read_text())
COMPUTE = np.linspace(0, 16000, 81)  # GPU-hours, an eval every 200


@pytest.fixture
def paper_store(db_url) -> str:
    """Three configurations with Table 1's parameters, two seeds each, plus one collapsing run."""
    paper_sweep(Store(db_url), COMPUTE, ("scalerl", "bs2048", "scout"), rng_seed=7, collapse_tail=20)
    return db_url


def _report(db: str, *args: str) -> dict:
    result = CliRunner().invoke(cli, ["--db", db, "report", "paper", "--format", "json", *args])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    jsonschema.validate(report, SCHEMA, format_checker=jsonschema.FormatChecker())
    return report


def test_report_ranks_by_asymptote_pools_seeds_and_keeps_flagged_runs_out(paper_store):
    report = _report(paper_store, "--bootstrap", "100")
    assert report["compute_axis"] == "gpu_hours"
    by_variant = {r["axes"]["variant"]: r for r in report["runs"]}
    assert [r["axes"]["variant"] for r in report["runs"] if r["rank"]] == ["scout", "bs2048", "scalerl"]
    assert by_variant["scout"]["run_ids"] == ["scout-0", "scout-1"] and by_variant["scout"]["seeds"] == [0, 1]
    for name in ("scalerl", "bs2048", "scout"):
        fit = by_variant[name]
        assert fit["A"] == pytest.approx(PAPER_TABLE1[name][0], abs=0.02)
        lo, hi = fit["intervals"]["A"]
        assert lo <= fit["A"] <= hi
        assert fit["r2"] > 0.98 and fit["flags"] == []
    assert "collapsing" in by_variant["collapse"]["flags"] and by_variant["collapse"]["rank"] is None
    (effect,) = report["effects"]
    assert effect["axis"] == "variant" and effect["verdict"] == "asymptote"
    assert len(report["comparisons"]) == 2


def test_include_flagged_ranks_everything(paper_store):
    report = _report(paper_store, "--bootstrap", "0", "--include-flagged")
    assert sorted(r["rank"] for r in report["runs"]) == [1, 2, 3, 4]
    assert report["intervals"] is None and all(r["intervals"] is None for r in report["runs"])


def test_extrapolation_from_half_the_compute_shows_the_error(paper_store):
    report = _report(paper_store, "--bootstrap", "50", "--fit-until", "8000", "--predict", "16000")
    for run in report["runs"]:
        e = run["extrapolation"]
        assert e["fit_until"] == 8000 and e["predict_at"] == 16000
        assert e["observed"] is not None and e["error"] == pytest.approx(e["predicted"] - e["observed"])
    scalerl = next(r for r in report["runs"] if r["axes"]["variant"] == "scalerl")
    assert abs(scalerl["extrapolation"]["error"]) < 0.02


def test_report_table_renders(paper_store):
    result = CliRunner().invoke(cli, ["--db", paper_store, "report", "paper", "--bootstrap", "0"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "scout" in result.output and "collapsing" in result.output and "Effects of each axis" in result.output


def test_bad_extrapolation_options_are_usage_errors(paper_store):
    result = CliRunner().invoke(cli, ["--db", paper_store, "report", "paper", "--fit-until", "8000"])
    assert result.exit_code == 2 and "--fit-until needs --predict" in result.output


def test_predict_ranks_at_c_with_the_odds_of_the_winner(paper_store):
    """`--predict C` alone fits all data; each configuration gets its rank at C and p_best. At
    C = 100k GPU-hours Table 1's scout (A = 0.71) is far ahead of scalerl (0.61) and bs2048 (0.645)."""
    report = _report(paper_store, "--bootstrap", "60", "--predict", "100000")
    every = {r["axes"]["variant"]: r["extrapolation"] for r in report["runs"]}
    # The collapsing run is unstable: it gets no prediction, and no rank or odds at C.
    assert every["collapse"]["withheld"].startswith("unstable") and every["collapse"]["predicted"] is None
    assert every["collapse"]["rank_at_predict"] is None and every["collapse"]["p_best"] is None
    predictions = {v: e for v, e in every.items() if v != "collapse"}
    ranked = sorted(predictions, key=lambda v: predictions[v]["rank_at_predict"])
    assert [predictions[v]["rank_at_predict"] for v in ranked] == list(range(1, len(ranked) + 1))
    assert all(
        predictions[a]["predicted"] >= predictions[b]["predicted"] for a, b in zip(ranked, ranked[1:])
    )
    assert ranked[0] == "scout" and predictions["scout"]["p_best"] > 0.9
    assert sum(e["p_best"] for e in predictions.values()) == pytest.approx(1.0)
    assert all(e["fit_until"] == 16000 and e["observed"] is None for e in predictions.values())
    jsonschema.validate(report, SCHEMA)


def test_predict_percent_of_each_configurations_range(paper_store):
    report = _report(paper_store, "--bootstrap", "30", "--fit-until", "50%", "--predict", "100%")
    for run in report["runs"]:
        e = run["extrapolation"]
        assert e["fit_until"] == pytest.approx(8000) and e["predict_at"] == pytest.approx(16000)
        assert e["observed"] is not None
