"""The store's functions, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import pytest

from store import NewRun, NotFoundError, Store, StoreError, mask_url, resolve_url


def _point(step: int, pass_rate: float = 0.5) -> dict:
    return dict(
        step=step,
        pass_rate=pass_rate,
        flops=1e9 * step,
        tokens=10 * step,
        device_seconds=0.1 * step,
        gpu_hours=0.0,
        num_samples=64,
    )


def _store_with_runs(url: str, n: int = 3) -> Store:
    store = Store(url)
    store.upsert_sweep("s", {"name": "s"}, "/tmp/s", "local")
    store.register_runs(
        "s", [NewRun(f"run{i}", i, {"seed": i}, {"seed": i}, {"steps": 10}, f"/tmp/s/run{i}") for i in range(n)]
    )
    return store


def test_register_is_idempotent(db_url):
    store = _store_with_runs(db_url)
    again = store.register_runs(
        "s", [NewRun("run1", 1, {}, {}, {}, "x"), NewRun("run9", 9, {"seed": 9}, {}, {"steps": 10}, "y")]
    )
    assert again == ["run9"]
    assert [r.id for r in store.runs("s")] == ["run0", "run1", "run2", "run9"]
    assert store.runs("s")[1].config == {"seed": 1}  # the existing row was not overwritten


def test_configs_come_back_whole_and_config_values_read_dotted_keys(db_url):
    store = Store(db_url)
    store.upsert_sweep("s", {"name": "s"}, "/tmp/s", "local")
    config = {"async": {"mode": "pipeline", "max_lag": 2}, "engine": {"generator_ranks": 0}, "optim": {"lr": 1e-4}}
    other = {"async": {"mode": "ppo-offpolicy"}, "engine": {"generator_ranks": 2}}
    store.register_runs("s", [NewRun("a", 0, config, {}, {}, "/a"), NewRun("b", 1, other, {}, {}, "/b")])
    assert [r.config for r in store.runs("s")] == [config, other]
    assert store.get_run("a").config == config
    values = store.config_values("s", ["async.mode", "engine.generator_ranks", "async.max_lag", "nothing.here"])
    assert values == {"a": ("pipeline", 0, 2, None), "b": ("ppo-offpolicy", 2, None, None)}


def test_same_eval_step_twice_keeps_one_row_with_the_latest_values(db_url):
    store = _store_with_runs(db_url)
    store.add_eval_points("run0", [_point(0, 0.1), _point(5, 0.2)])
    store.add_eval_points("run0", [_point(5, 0.3)])
    points = store.eval_points("run0")
    assert [(p.step, p.pass_rate) for p in points] == [(0, 0.1), (5, 0.3)]


def test_delete_eval_points_after_a_step(db_url):
    store = _store_with_runs(db_url)
    store.add_eval_points("run0", [_point(s) for s in (0, 1, 2, 4, 8)])
    assert store.delete_eval_points_after("run0", 2) == 2
    assert [p.step for p in store.eval_points("run0")] == [0, 1, 2]


def test_claims_are_exclusive(db_url):
    store = _store_with_runs(db_url)
    first = store.claim_runs(["run0", "run1"], ["registered"], "a")
    second = store.claim_runs(["run0", "run1", "run2"], ["registered"], "b")
    assert sorted(first) == ["run0", "run1"] and second == ["run2"]
    assert {r.state for r in store.runs("s")} == {"submitting"}


def test_attempts_take_over_the_submitted_one_then_number_requeues(db_url):
    store = _store_with_runs(db_url)
    store.add_attempt("run0", "slurm", job_id="42", state="queued", stdout_path="/o", stderr_path="/e")
    first = store.begin_attempt("run0", "slurm", job_id="42", node="n1", pid=10)
    assert (first.number, first.state, first.stdout_path, first.node) == (1, "running", "/o", "n1")
    store.end_attempt(first.id, "preempted", "USR2")
    second = store.begin_attempt("run0", "slurm", job_id="42", node="n2", pid=11)  # the requeued job
    assert (second.number, second.job_id, second.stderr_path, second.node) == (2, "42", "/e", "n2")
    assert [a.state for a in store.attempts("run0")] == ["preempted", "running"]
    assert store.latest_attempts("s")["run0"].number == 2
    assert store.attempt_counts("s") == {"run0": 2}
    assert store.get_run("run0").state == "running"


def test_an_attempt_that_never_said_how_it_ended_is_closed_when_its_job_starts_again(db_url):
    """A node failure kills trainer rank 0 with its node: Slurm requeues the job, and the next
    attempt's start closes the silent one instead of leaving it running for ever."""
    store = _store_with_runs(db_url)
    first = store.begin_attempt("run0", "slurm", job_id="42", node="n1", pid=10)
    second = store.begin_attempt("run0", "slurm", job_id="42", node="n1", pid=11)
    old, new = store.attempts("run0")
    assert (old.id, old.state, new.id, new.state) == (first.id, "preempted", second.id, "running")
    assert old.ended_at is not None
    assert "without a word" in old.exit_reason and "attempt 2" in old.exit_reason


def test_set_run_state_only_from(db_url):
    store = _store_with_runs(db_url)
    assert store.set_run_state("run0", "failed", "boom", only_from=["running"]) is False
    assert store.set_run_state("run0", "failed", "boom") is True
    run = store.get_run("run0")
    assert (run.state, run.state_reason) == ("failed", "boom")
    with pytest.raises(ValueError, match="unknown run state 'done'"):
        store.set_run_state("run0", "done")


def test_queued_attempts_skip_cancelled_runs(db_url):
    store = _store_with_runs(db_url)
    for rid in ("run0", "run1"):
        store.add_attempt(rid, "local", state="queued")
        store.set_run_state(rid, "queued")
    store.set_run_state("run1", "cancelled")
    assert [a.run_id for a in store.queued_attempts("local", limit=5)] == ["run0"]


def test_last_eval_points_and_sweep_points(db_url):
    store = _store_with_runs(db_url)
    store.add_eval_points("run0", [_point(0, 0.1), _point(3, 0.4)])
    store.add_eval_points("run2", [_point(1, 0.9)])
    last = store.last_eval_points("s")
    assert {k: v.step for k, v in last.items()} == {"run0": 3, "run2": 1}
    assert {k: len(v) for k, v in store.sweep_eval_points("s").items()} == {"run0": 2, "run2": 1}


def test_checkpoints_and_train_metrics(db_url):
    store = _store_with_runs(db_url)
    store.add_checkpoint("run0", 10, "/c/10")
    store.add_checkpoint("run0", 20, "/c/20")
    store.delete_checkpoint("run0", 10)
    assert [(c.step, c.path) for c in store.checkpoints("run0")] == [(20, "/c/20")]
    store.add_train_metrics("run0", [(1, {"loss": 1.0}), (2, {"loss": 0.5})])
    store.add_train_metrics("run0", [(2, {"loss": 0.25})])
    assert store.train_metrics("run0") == [(1, {"loss": 1.0}), (2, {"loss": 0.25})]
    assert store.get_run("run0").step == 2  # the run's progress follows its train metrics


def test_get_run_by_prefix(db_url):
    store = _store_with_runs(db_url)
    assert store.get_run("run2").id == "run2"
    with pytest.raises(NotFoundError, match="ambiguous"):
        store.get_run("run")
    with pytest.raises(NotFoundError, match="no run with id 'zzz'"):
        store.get_run("zzz")


def test_reopening_does_not_migrate_again(db_url):
    _store_with_runs(db_url)
    again = Store(db_url)
    assert [r.id for r in again.runs("s")] == ["run0", "run1", "run2"]


def test_passwords_are_masked():
    url = "postgresql://alice:s3cret@db.example:5432/sweeps"
    assert "s3cret" not in mask_url(url)
    assert resolve_url(url).startswith("postgresql+psycopg://alice:s3cret@")


def test_unreachable_database_error_names_the_cause_and_hides_the_password():
    with pytest.raises(StoreError) as info:
        Store("postgresql://bob:hunter2@127.0.0.1:1/nothing")
    message = str(info.value)
    assert "hunter2" not in message and "127.0.0.1:1" in message and "migrating the schema" in message


def test_relative_sqlite_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_url(None) == f"sqlite:///{tmp_path / 'sweeps.db'}"
    assert resolve_url("sqlite:///sub/x.db") == f"sqlite:///{tmp_path / 'sub' / 'x.db'}"
