"""Scaling-aware pruning on synthetic curves with a slow starter that has the highest ceiling:
the asymptote pruner keeps it and prunes the dominated configurations, saving >= 30% of the
compute; a current-value pruner (what ASHA-style tools judge) prunes the eventual winner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.pruning import PrunePolicy, judge, simulate, simulate_current
from analysis.synthetic import noisy_curve
from conftest import add_curve_run
from launcher.cli import cli
from store import Store

COMPUTE = np.linspace(0, 16000, 81)
CONFIGS = {  # A, B, Cmid: "late" starts slowest and ends highest
    "late": (0.75, 1.6, 8000.0),
    "fast-low": (0.55, 2.0, 1500.0),
    "mid": (0.62, 1.9, 2500.0),
    "low": (0.50, 1.8, 3000.0),
}


def curves(seed: int = 0) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    return {k: [(COMPUTE, noisy_curve(COMPUTE, *v, 0.3, rng=rng)) for _ in range(2)] for k, v in CONFIGS.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_late_winner_survives_and_a_third_of_the_compute_is_saved(seed):
    sim = simulate(curves(seed), PrunePolicy(n_boot=50))
    verdicts = {v.label: v for v in sim.verdicts}
    assert sim.best == "late" and sim.best_survived and not verdicts["late"].pruned
    assert verdicts["low"].pruned and verdicts["fast-low"].pruned
    assert sim.saved_fraction >= 0.30


def test_a_current_value_pruner_prunes_the_late_winner():
    sim = simulate_current(curves(0), PrunePolicy(n_boot=50))
    assert not sim.best_survived and {v.label: v for v in sim.verdicts}["late"].pruned


def test_nothing_is_pruned_on_too_little_data():
    early = {k: [(c[:12], r[:12]) for c, r in seeds] for k, seeds in curves(0).items()}  # up to 2,200
    assert not any(v.pruned for v in judge(early, PrunePolicy(n_boot=50)).values())


def test_bad_policies_are_refused():
    for kwargs in ({"first_at": 0}, {"every": 1.5}, {"margin": float("nan")}, {"level": 1.0}):
        with pytest.raises(ValueError, match="prune."):
            PrunePolicy(**kwargs)


def test_sweep_prune_simulate_json(sqlite_url):
    store = Store(sqlite_url)
    store.upsert_sweep("paper", {"grid": {"prune": {"n_boot": 50}}}, "/nowhere", "local")
    for label, seeds in curves(0).items():
        for seed, (c, r) in enumerate(seeds):
            add_curve_run(store, "paper", f"{label}-{seed}", {"variant": label, "seed": seed}, c, r)
    result = CliRunner().invoke(cli, ["--db", sqlite_url, "prune", "paper", "--simulate", "--json"])
    assert result.exit_code == 0, result.output
    asymptote, current = json.loads(result.output)["simulations"]
    assert asymptote["pruner"] == "asymptote" and asymptote["best_survived"] and asymptote["saved_fraction"] >= 0.3
    runs = {r["label"]: r for r in asymptote["runs"]}
    assert not runs["variant=late"]["pruned"] and runs["variant=low"]["pruned"] and runs["variant=low"]["pruned_at"] > 0
    assert current["pruner"] == "current value" and not current["best_survived"]

    result = CliRunner().invoke(cli, ["--db", sqlite_url, "prune", "paper", "--dry-run"])
    assert result.exit_code == 0 and "variant=late: keep" in result.output and "variant=low: prune (A <=" in result.output

    result = CliRunner().invoke(cli, ["--db", sqlite_url, "prune", "paper"])
    assert result.exit_code == 2 and "one of --simulate and --dry-run" in result.output
