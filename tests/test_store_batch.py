"""The store's batched paths write what the one-by-one paths wrote (SQLite and PostgreSQL):
settle_attempts (sweep status settles every ended Slurm job in one call), register_runs, and
the plain-row reads behind runs / latest_attempts / tracked_attempts / latest_executors."""

from __future__ import annotations

from datetime import UTC, datetime

from store import NewRun, RunState, Store

ENDED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _sweep(store: Store, name: str, n: int) -> list[str]:
    store.upsert_sweep(name, {"name": name}, f"/tmp/{name}", "slurm")
    ids = [f"{name}-run{i}" for i in range(n)]
    store.register_runs(
        name, [NewRun(r, i, {"seed": i}, {"seed": i}, {"steps": 10}, f"/tmp/{r}") for i, r in enumerate(ids)]
    )
    store.claim_runs(ids, [RunState.REGISTERED], "t")
    store.record_submissions(
        "slurm",
        [{"run_id": r, "job_id": f"7_{i}", "array_job_id": "7", "array_index": i, "stderr_path": f"/l/{i}.err"} for i, r in enumerate(ids)],
        RunState.PENDING,
    )  # fmt: skip
    return ids


def _outcomes(store: Store, name: str) -> list[tuple[int, str, str | None, dict]]:
    """A mix: plain ends, given and missing end times, a node, attempts twice in one batch (a
    requeue then a failure; a cancel then a failure), an old attempt of a run with a newer one, a
    run no longer active, an unknown attempt."""
    latest = store.latest_attempts(name)
    ids = [r.id for r in store.runs(name)]  # in position order
    a = {r: latest[r].id for r in ids}
    store.set_run_state(ids[5], RunState.COMPLETED)  # the recipe's own word: Slurm's must not override it
    old = a[ids[6]]
    store.record_submissions("slurm", [{"run_id": ids[6], "job_id": "8"}], RunState.PENDING)  # ids[6] resubmitted
    store.claim_runs([ids[6]], [RunState.PENDING], "t2")  # (submitting: still active)
    out: list[tuple[int, str, str | None, dict]] = [
        (a[ids[0]], RunState.CANCELLED, "cancelled 0", {"ended_at": ENDED, "node": "n1"}),
        (a[ids[1]], RunState.FAILED, "failed 1", {}),
        (a[ids[2]], RunState.PREEMPTED, "requeued 2", {"node": "n2"}),
        (a[ids[3]], RunState.TIMEOUT, "timeout 3", {"ended_at": None}),
        (a[ids[4]], RunState.CANCELLED, "cancelled 4", {}),
        (a[ids[2]], RunState.FAILED, "failed 2 after the requeue", {"ended_at": ENDED}),  # preempted is still open
        (a[ids[4]], RunState.FAILED, "failed 4", {"ended_at": ENDED, "node": "n4"}),  # closed now: fields only
        (a[ids[5]], RunState.FAILED, "late 5", {}),
        (old, RunState.FAILED, "old attempt of 6", {}),
        (10**9, RunState.FAILED, "no such attempt", {}),
    ]
    out += [(a[r], RunState.CANCELLED, f"cancelled {r.split('-')[1]}", {"ended_at": ENDED}) for r in ids[7:]]
    return out


def _snapshot(store: Store, name: str) -> list[tuple]:
    runs = [(r.id.split("-", 1)[1], r.state, r.state_reason, r.step) for r in store.runs(name)]
    attempts = []
    for r in store.runs(name):
        for at in store.attempts(r.id):
            ended = at.ended_at == ENDED if at.ended_at is not None else None
            attempts.append((r.id.split("-", 1)[1], at.number, at.state, at.exit_reason, at.node, ended))
    return runs + attempts


def test_settle_attempts_in_one_batch_equals_one_by_one(db_url):
    store = Store(db_url)
    _sweep(store, "batch", 40)
    _sweep(store, "single", 40)
    batch, single = _outcomes(store, "batch"), _outcomes(store, "single")
    changed_batch = store.settle_attempts(batch)
    changed_single = sum(store.settle_attempt(i, state, reason, **fields) for i, state, reason, fields in single)
    assert changed_batch == changed_single == 1 + 1 + 2 + 1 + 1 + 33  # runs 0, 1, 2 (twice), 3, 4, 7..39
    assert _snapshot(store, "batch") == _snapshot(store, "single")

    runs = {r.id.split("-", 1)[1]: r for r in store.runs("batch")}
    assert runs["run0"].state == RunState.CANCELLED and runs["run0"].state_reason == "cancelled 0"
    assert runs["run2"].state == RunState.FAILED  # preempted is active: the later failure moves it
    assert runs["run5"].state == RunState.COMPLETED and runs["run6"].state == RunState.SUBMITTING
    attempts = {r: store.attempts(runs[r].id) for r in ("run0", "run2", "run3", "run4", "run6")}
    assert attempts["run0"][-1].ended_at == ENDED and attempts["run0"][-1].node == "n1"
    assert attempts["run2"][-1].state == "failed" and attempts["run2"][-1].exit_reason == "failed 2 after the requeue"
    assert attempts["run2"][-1].ended_at == ENDED and attempts["run2"][-1].node == "n2"
    assert runs["run4"].state == RunState.CANCELLED and runs["run4"].state_reason == "cancelled 4"
    assert attempts["run4"][-1].state == "cancelled" and attempts["run4"][-1].exit_reason == "cancelled 4"
    assert attempts["run4"][-1].ended_at == ENDED and attempts["run4"][-1].node == "n4"  # the later word's fields
    assert attempts["run3"][-1].ended_at is not None  # no end time given: now
    assert [a.state for a in attempts["run6"]] == ["failed", "pending"]  # the old one ended, the new one untouched


def test_plain_row_reads(db_url):
    store = Store(db_url)
    ids = _sweep(store, "s", 5)
    store.add_eval_points(ids[0], [{"step": 3, "pass_rate": 0.5, "flops": 1.0, "tokens": 2, "device_seconds": 0.1, "gpu_hours": 0.0, "num_samples": 4}])  # fmt: skip
    store.set_run_state(ids[1], RunState.COMPLETED)
    runs = store.runs("s")
    assert [r.id for r in runs] == ids and runs[0].config == {"seed": 0} and runs[0].sweep == "s"
    assert runs[0].updated_at.tzinfo is not None and runs[0].state is RunState.PENDING
    latest = store.latest_attempts("s")
    assert latest[ids[0]] == store.attempts(ids[0])[-1]  # the plain-row record equals the ORM one
    assert store.last_eval_points("s")[ids[0]] == store.eval_points(ids[0])[-1]
    assert store.latest_executors("s") == {"slurm"}
    tracked = store.tracked_attempts("s", "slurm")
    assert [t.run_id for t in tracked] == [ids[0], *ids[2:]]  # the completed run is not tracked
    assert tracked[0].job_id == "7_0" and tracked[0].stderr_path == "/l/0.err" and tracked[0].run_state == "pending"
    assert store.tracked_attempts("s", "local") == [] and store.latest_executors("nothing") == set()


def test_register_runs_returns_only_the_new_ones_in_order(db_url):
    store = Store(db_url)
    store.upsert_sweep("s", {}, "/tmp/s", "slurm")
    first = store.register_runs("s", [NewRun(f"r{i}", i, {}, {}, {}, "d") for i in range(0, 2500, 2)])
    second = store.register_runs("s", [NewRun(f"r{i}", i, {}, {}, {}, "d") for i in range(2500)])
    assert len(first) == 1250 and second == [f"r{i}" for i in range(1, 2500, 2)]
    assert len(store.runs("s")) == 2500
