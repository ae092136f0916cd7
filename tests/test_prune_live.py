"""Live pruning on the local executor, for real: three configurations of the tiny CPU task, two
at a time; one cannot learn (a learning rate of 1e-9). The local scheduler applies the sweep's
prune policy while it serves them (nobody calls `sweep status` until it has): the two learners
are judged against each other and kept, and train to completion; the frozen run, started when a
slot frees, is judged once it passes 20% of its budget, against the learners' fits, is stopped
after a checkpoint and ends `pruned`, with the fit that decided; `sweep launch --resume-pruned`
then resumes it from its checkpoint to completion.

Measured here: the learners end with lower bounds on A of 0.18-0.23 (still climbing: their
upper bounds are 1); the frozen run's upper bound from 20% of its budget on is 0.07-0.12.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher import local
from store import RunState, Store
from test_cli_local import sweep, wait_for


def waiting(store: Store, condition, timeout_s: float, what: str):
    """`wait_for`, saying on a timeout where the runs stand and what the scheduler logged."""
    try:
        return wait_for(condition, timeout_s, what)
    except AssertionError as exc:
        log = local.lock_path(store.url).with_suffix(".log")
        states = [(r.axes, r.state, r.step, r.prune) for r in store.runs("live")]
        raise AssertionError(f"{exc}; runs: {states}; scheduler log: {log.read_text()[-3000:] if log.exists() else '-'}")

LIVE = """\
name: live
recipe:
  batch: {prompts: 16, generations: 4}
  optim: {lr: 3.0e-4, warmup_steps: 100}
  eval: {every: 20, samples: 1}
  data: {num_valid_prompts: 128}
  checkpoint: {every: 20}
grid:
  optim.lr: [3.0e-4, 2.5e-4, 1.0e-9]
prune: {first_at: 0.2, every: 0.2, n_boot: 50}
budget: {steps: 180}
"""


@pytest.mark.slow
def test_the_scheduler_prunes_the_dominated_run_after_a_checkpoint_and_it_resumes(
    sweep_file, sqlite_url, monkeypatch
):
    monkeypatch.setenv("SWEEP_PRUNE_POLL_S", "1")  # the scheduler's `sweep status` child, every second
    grid = str(sweep_file(LIVE))
    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--max-parallel", "2")
    assert code == 0 and "3 runs, 3 new, 3 submitted (local)" in out, out
    store = Store(sqlite_url)
    runs = {r.axes["optim.lr"]: r.id for r in store.runs("live")}
    frozen, learners = runs[1e-9], [runs[3e-4], runs[2.5e-4]]

    def pruned_and_stopped():
        attempt = store.attempts(frozen)[-1]
        return store.get_run(frozen).state == RunState.PRUNED and attempt.state == "pruned" and attempt

    attempt = waiting(store, pruned_and_stopped, 240, "the frozen run to be pruned and its job to stop")
    run = store.get_run(frozen)
    record = run.prune
    assert record["decision"] == "pruned" and record["best"] != "optim.lr=1e-09" and record["at"] >= 0.2
    assert record["A"][1] < record["best_A"][0] - record["margin"] and record["margin"] == 0.02
    assert run.state_reason.startswith(f"pruned at {record['at']:.0%} of its budget: A <= ")
    stopped_at = int(attempt.exit_reason.split("pruned at step ")[1].split(";")[0])
    assert 0.2 * 180 <= stopped_at < 180, attempt.exit_reason
    checkpoint = store.checkpoints(frozen)[-1]
    assert checkpoint.step == stopped_at and Path(checkpoint.path).exists()  # checkpointed, and kept
    # The learners are not pruned (one may still wait for the slot the pruned run just gave back).
    assert all(
        store.get_run(r).state in (RunState.QUEUED, RunState.PENDING, RunState.RUNNING, RunState.COMPLETED)
        for r in learners
    ), [store.get_run(r).state for r in learners]

    waiting(store, lambda: all(store.get_run(r).state == RunState.COMPLETED for r in learners), 240, "the others")
    assert all(store.get_run(r).step == 180 and store.get_run(r).prune["judged_at"] >= 0.2 for r in learners)
    assert Path(checkpoint.path).exists() and store.get_run(frozen).state == RunState.PRUNED

    code, out = sweep(sqlite_url, "status")
    line = next(x for x in out.splitlines() if x.startswith(f"{frozen}:"))
    assert "pruned at" in line and "[fit on tokens up to" in line and f"pruned at step {stopped_at}; checkpoint" in line
    code, out = sweep(sqlite_url, "status", "--json")
    row = next(r for r in json.loads(out)["runs"] if r["run"] == frozen)
    assert row["state"] == "pruned" and row["prune"] == record

    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--resume-pruned")
    assert code == 0 and f"resumed 1 pruned run(s): {frozen} (from its checkpoint at step {stopped_at})" in out, out
    assert "1 submitted" in out
    waiting(store, lambda: store.get_run(frozen).state == RunState.COMPLETED, 180, "the resumed run to complete")
    attempts = store.attempts(frozen)
    assert [a.state for a in attempts] == ["pruned", "completed"] and attempts[1].resumed_from_step == stopped_at
    assert store.get_run(frozen).prune["exempt"] and store.get_run(frozen).prune["overruled"] == record
    assert all(store.get_run(r).state == RunState.COMPLETED and len(store.attempts(r)) == 1 for r in learners)
