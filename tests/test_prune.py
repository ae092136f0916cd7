"""Scaling-aware pruning on synthetic curves with a slow starter that has the highest ceiling:
the asymptote pruner keeps it and prunes the dominated configurations, saving >= 30% of the
compute; a current-value pruner (what ASHA-style tools judge) prunes the eventual winner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.pruning import PrunePolicy, judge, simulate, simulate_current
from analysis.report.prune import live_judgment, run_progress
from analysis.synthetic import LATE_WINNER_COMPUTE, late_winner_sweep
from conftest import add_curve_run
from launcher.cli import cli
from store import NewRun, RunState, Store

COMPUTE = LATE_WINNER_COMPUTE


def curves(seed: int = 0) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    return late_winner_sweep(seed)


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


# ---------------------------------------------------------------------------------------------
# Live pruning: the decision on a running sweep (the store as `sweep status` sees it)

BUDGET = float(COMPUTE[-1])  # each run's budget: {"gpu_hours": 16000}


def running_sweep(store, upto: float, *, prune: dict | None = None, seed: int = 0) -> None:
    """Sweep `live`: the synthetic configurations as running runs (2 seeds each) with their eval
    points up to compute `upto`; a run's progress is its newest GPU-hours over the budget."""
    store.upsert_sweep("live", {"grid": {"prune": {"n_boot": 50} if prune is None else prune}}, "/nowhere", "local")
    known = {r.id for r in store.runs("live")}
    for label, seeds in curves(seed).items():
        for s, (c, r) in enumerate(seeds):
            run_id = f"{label}-{s}"
            if run_id not in known:
                axes = {"variant": label, "seed": s}
                store.register_runs("live", [NewRun(run_id, 0, {}, axes, {"gpu_hours": BUDGET}, "/nowhere")])
                store.set_run_state(run_id, RunState.RUNNING)
            keep = c <= upto
            store.add_eval_points(run_id, [
                dict(step=i, pass_rate=float(y), flops=0.0, tokens=0, device_seconds=0.0, gpu_hours=float(x), num_samples=64)
                for i, (x, y) in enumerate(zip(c[keep], r[keep]))
            ])  # fmt: skip


def apply(store, judgment) -> None:
    """What `sweep status` does with a judgment (without jobs to signal)."""
    store.set_prune_records(judgment.judged)
    for p in judgment.prunes:
        store.prune_runs(p.run_ids, p.reason, p.record)


def test_run_progress_is_the_budget_reached_first():
    from store import EvalRecord, RunRecord

    def rec(state, step, budget):
        return RunRecord("r", "s", 0, {}, {}, budget, "/", state, None, step, None)

    last = EvalRecord("r", 30, 0.5, 5e9, 0, 0.0, 0.0, 16, {})
    assert run_progress(rec(RunState.RUNNING, 30, {"steps": 100}), last) == pytest.approx(0.3)
    assert run_progress(rec(RunState.RUNNING, 30, {"steps": 100, "flops": 1e10}), last) == pytest.approx(0.5)
    assert run_progress(rec(RunState.RUNNING, 30, {"flops": 1e10}), None) == 0.0
    assert run_progress(rec(RunState.COMPLETED, 30, {"steps": 100}), last) == 1.0
    assert run_progress(rec(RunState.RUNNING, 300, {"steps": 100}), last) == 1.0


def test_live_nothing_is_fitted_before_the_first_judgment_point(sqlite_url):
    store = Store(sqlite_url)
    running_sweep(store, 0.29 * BUDGET)
    judgment = live_judgment(store, "live", PrunePolicy(n_boot=50))
    assert judgment.fitted == () and judgment.prunes == () and judgment.judged == {}


def test_live_prunes_the_dominated_keeps_the_best_and_decides_once(sqlite_url):
    store = Store(sqlite_url)
    running_sweep(store, 0.3 * BUDGET)
    policy = PrunePolicy(n_boot=50)
    judgment = live_judgment(store, "live", policy)
    assert sorted(judgment.fitted) == ["variant=fast-low", "variant=late", "variant=low", "variant=mid"]
    pruned = {p.label: p for p in judgment.prunes}
    assert set(pruned) == {"variant=fast-low", "variant=low"}  # as the replay: both at 4,800 (docs/pruning.md)
    for p in pruned.values():
        r = p.record
        assert r["decision"] == "pruned" and r["best"] not in pruned and r["at"] == 0.3
        assert r["A"][1] < r["best_A"][0] - r["margin"] and (r["margin"], r["level"]) == (0.02, 0.9)
        assert r["compute_axis"] == "gpu_hours" and r["compute"] == 4800.0
        assert sorted(p.run_ids) == [f"{p.label.split('=')[1]}-0", f"{p.label.split('=')[1]}-1"]
        assert p.reason.startswith("pruned at 30% of its budget: A <= ")
    assert sorted(judgment.judged) == ["late-0", "late-1", "mid-0", "mid-1"]
    assert all(r["judged_at"] == 0.3 and r["A"] is not None for r in judgment.judged.values())
    apply(store, judgment)
    states = {r.id: r.state for r in store.runs("live")}
    assert states["low-0"] == states["fast-low-1"] == RunState.PRUNED and states["late-0"] == RunState.RUNNING
    decided = {r.id: r.prune for r in store.runs("live")}

    # Once decided: asking again fits nothing and changes nothing, until a configuration passes the next point.
    assert live_judgment(store, "live", policy) == type(judgment)()
    running_sweep(store, 0.39 * BUDGET)
    assert live_judgment(store, "live", policy).fitted == ()
    running_sweep(store, 0.4 * BUDGET)
    again = live_judgment(store, "live", policy)
    assert sorted(again.fitted) == ["variant=late", "variant=mid"]  # the pruned are out of it
    assert all(p.label == "variant=mid" for p in again.prunes)  # never the best, never a pruned one again
    assert {r.id: r.prune for r in store.runs("live") if r.state == RunState.PRUNED} == {
        k: v for k, v in decided.items() if k.startswith(("low", "fast-low"))
    }


def test_live_respects_the_margin_and_the_level(sqlite_url):
    store = Store(sqlite_url)
    running_sweep(store, 0.3 * BUDGET, prune={"n_boot": 50, "margin": 0.3})
    assert live_judgment(store, "live", PrunePolicy(n_boot=50, margin=0.3)).prunes == ()
    wide = live_judgment(store, "live", PrunePolicy(n_boot=50, level=0.99)).judged
    narrow = live_judgment(store, "live", PrunePolicy(n_boot=50, level=0.5)).judged
    width = lambda judged: judged["late-0"]["A"][1] - judged["late-0"]["A"][0]  # noqa: E731
    assert width(wide) > width(narrow)


def test_live_waits_for_the_least_advanced_seed(sqlite_url):
    store = Store(sqlite_url)
    running_sweep(store, 0.3 * BUDGET)
    store.delete_eval_points_after("low-1", 10)  # one seed of `low` is at 10 / 80 of its budget
    judgment = live_judgment(store, "live", PrunePolicy(n_boot=50))
    assert "variant=low" not in judgment.fitted and {p.label for p in judgment.prunes} == {"variant=fast-low"}


def test_a_resumed_run_is_exempt_from_the_policy(db_url):
    store = Store(db_url)
    running_sweep(store, 0.3 * BUDGET)
    apply(store, live_judgment(store, "live", PrunePolicy(n_boot=50)))
    claimed = store.claim_pruned_runs(["low-0", "low-1", "late-0"], "token")
    assert sorted(claimed) == ["low-0", "low-1"] and claimed["low-0"]["decision"] == "pruned"
    for run_id in claimed:
        store.set_run_state(run_id, RunState.RUNNING)
    record = store.get_run("low-0").prune
    assert record["exempt"] and record["overruled"]["decision"] == "pruned"
    running_sweep(store, 0.4 * BUDGET)
    judgment = live_judgment(store, "live", PrunePolicy(n_boot=50))
    assert "variant=low" in judgment.fitted and not any(p.label == "variant=low" for p in judgment.prunes)


def test_sweep_status_prunes_live_and_shows_why(db_url):
    store = Store(db_url)
    running_sweep(store, 0.3 * BUDGET)
    result = CliRunner().invoke(cli, ["--db", db_url, "status", "live", "--json"])
    assert result.exit_code == 0, result.output
    runs = {r["run"]: r for r in json.loads(result.output)["runs"]}
    assert runs["low-0"]["state"] == "pruned" and runs["low-0"]["reason"].startswith("pruned at 30% of its budget")
    assert runs["low-0"]["prune"]["best_A"][0] - runs["low-0"]["prune"]["margin"] > runs["low-0"]["prune"]["A"][1]
    assert runs["late-0"]["state"] == "running" and runs["late-0"]["prune"]["judged_at"] == 0.3

    result = CliRunner().invoke(cli, ["--db", db_url, "status", "live"], terminal_width=300)
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("low-0:"))
    assert "pruned at 30% of its budget: A <= " in line and "[fit on gpu_hours up to 4.8e+03: A in " in line
    assert "margin 0.02, level 0.9]" in line and "7 pruned" not in result.output and "4 pruned" in result.output


def test_a_sweep_without_a_prune_block_is_never_pruned(sqlite_url):
    store = Store(sqlite_url)
    running_sweep(store, 0.5 * BUDGET)
    store.upsert_sweep("live", {"grid": {}}, "/nowhere", "local")
    result = CliRunner().invoke(cli, ["--db", sqlite_url, "status", "live", "--json"])
    assert result.exit_code == 0 and {r["state"] for r in json.loads(result.output)["runs"]} == {"running"}
