"""Shared ceilings (`analysis.ceilings`): configurations that agree on the ceiling axes are
extrapolated with one A, on synthetic sweeps whose true curves are known."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.backtest import BacktestOptions, backtest
from analysis.ceilings import separating_axes, shared_a, task_ceiling_axes
from analysis.curve import sigmoid
from analysis.options import DEFAULT_OPTIONS
from analysis.synthetic import noisy_curve
from launcher.cli import cli

COMPUTE = np.concatenate([np.linspace(0, 4000, 21), np.linspace(4500, 16000, 24)])  # dense early evals
# budget sets the ceiling; warm-up only moves Cmid and B (the quickstart's design)
TRUTH = {
    ("9", "20"): (0.40, 1.2, 3000.0),
    ("9", "80"): (0.40, 1.4, 4500.0),
    ("13", "20"): (0.75, 1.1, 3500.0),
    ("13", "80"): (0.75, 1.3, 5000.0),
    ("13", "40"): (0.75, 1.2, 4200.0),
}
R0 = 0.2


def _label(budget: str, warmup: str) -> str:
    return f"budget={budget}, warmup={warmup}"


def _sweep(seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    curves = {_label(b, w): [(COMPUTE, noisy_curve(COMPUTE, A, B, C, R0, rng=rng, drift_sd=0.004))] for (b, w), (A, B, C) in TRUTH.items()}
    axes = {_label(b, w): {"budget": int(b), "warmup": int(w)} for b, w in TRUTH}
    return curves, axes


def _true_final(label: str) -> float:
    (b, w), = [k for k in TRUTH if _label(*k) == label]
    A, B, C = TRUTH[(b, w)]
    return float(sigmoid(COMPUTE[-1], A, B, C, R0))


def test_shared_a_recovers_the_common_ceiling_of_noiseless_curves():
    windows = [[(COMPUTE, sigmoid(COMPUTE, 0.75, B, C, R0))] for B, C in ((1.1, 3500.0), (1.3, 5000.0), (1.2, 4200.0))]
    assert shared_a(windows, DEFAULT_OPTIONS) == pytest.approx(0.75, abs=2e-3)


def test_a_quarter_of_the_compute_predicts_better_with_the_ceiling_shared():
    """Over several noise draws: from 25% the shared-A predictions of the final pass rate are
    closer to the truth than each configuration's own, and every one shares its budget's A."""
    own_errors, shared_errors = [], []
    options = BacktestOptions(n_boot=30, workers=1, cuts=(0.25,))
    for seed in range(4):
        curves, axes = _sweep(seed)
        own = backtest(curves, options, axes)  # no ceiling axes: each its own A
        shared = backtest(curves, BacktestOptions(n_boot=30, workers=1, cuts=(0.25,), ceiling_axes=("budget",)), axes)
        for cut in own.cuts[0].configs:
            assert cut.shared_with == 1
            own_errors.append(abs(cut.predicted - _true_final(cut.label)))
        for cut in shared.cuts[0].configs:
            budget = cut.label.split(",")[0].split("=")[1]
            assert cut.shared_with == sum(1 for b, _ in TRUTH if b == budget)  # 2 at budget 9, 3 at 13
            shared_errors.append(abs(cut.predicted - _true_final(cut.label)))
            assert cut.lo <= cut.predicted <= cut.hi
    assert np.mean(shared_errors) < 0.85 * np.mean(own_errors), (np.mean(shared_errors), np.mean(own_errors))  # 0.023 vs 0.030 here


def test_an_axis_that_already_moves_a_separates_without_being_declared():
    """Declaring no ceiling axis shares A only where the data do not already tell the ceilings
    apart: from all the compute the budget's two ceilings are far apart, so they stay separate."""
    curves, axes = _sweep(0)
    result = backtest(curves, BacktestOptions(n_boot=30, workers=1, cuts=(0.9,), ceiling_axes=()), axes)
    sizes = {c.label: c.shared_with for c in result.cuts[0].configs}
    assert sizes == {_label(b, w): 2 if b == "9" else 3 for b, w in TRUTH}


def test_the_tasks_know_their_ceiling_axes():
    assert "length.max_new_tokens" in task_ceiling_axes(["sumk", "sumk"])
    assert task_ceiling_axes(["math-jsonl"]) is None  # nothing known: each configuration its own A
    assert task_ceiling_axes(["sumk", "sort6"]) is None


def test_separating_axes_are_the_declared_ones_when_nothing_moves_a():
    assert separating_axes([], ("budget",)) == {"budget"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ceiling-axes", "bugdet"], "--ceiling-axes: 'bugdet' is not an axis of sweep paper (closest: budget)"),
        (["--ceiling-axes", "budget", "--own-ceilings"], "give --ceiling-axes or --own-ceilings, not both"),
    ],
)
def test_cli_refuses_a_ceiling_axis_the_sweep_does_not_have(tmp_path, sqlite_url, args, message):
    lines = ["run,compute,pass_rate,budget,warmup"]
    curves, _ = _sweep(1)
    for label, [(c, r)] in curves.items():
        budget, warmup = (part.split("=")[1] for part in label.split(", "))
        lines += [f"{budget}-{warmup},{x:g},{y:.6f},{budget},{warmup}" for x, y in zip(c, r)]
    (tmp_path / "curves.csv").write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    imported = runner.invoke(cli, ["--db", sqlite_url, "import", str(tmp_path / "curves.csv"), "--sweep", "paper"])
    assert imported.exit_code == 0, imported.output
    result = runner.invoke(cli, ["--db", sqlite_url, "report", "paper", "--fit-until", "25%", "--predict", "100%", *args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
