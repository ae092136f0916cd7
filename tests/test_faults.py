"""Faults and hostile input at the store and the local executor, through the real `sweep` CLI:
each bad input exits non-zero with one line that names the value, nothing is created or changed,
and no secret is printed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, text

from launcher import local
from launcher.cli import cli
from store import (
    ACTIVE_STATES,
    CANCELLABLE_STATES,
    RUN_STATES,
    TERMINAL_STATES,
    AttemptState,
    BadURLError,
    NewRun,
    NotFoundError,
    RunState,
    Store,
    StoreError,
    mask_url,
)

REPO = Path(__file__).resolve().parents[1]
SECRET = "hunter2SECRET"


def sweep(*args: str) -> tuple[int, str]:
    """`sweep ARGS` in-process; (exit code, stdout and stderr)."""
    result = CliRunner().invoke(cli, list(args), terminal_width=200)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def sweep_process(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`sweep ARGS` as a real process: stdout and stderr apart, as a user sees them."""
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert "Traceback" not in output
    return lines[0]


def store_with_runs(url: str, n: int = 3, sweep_name: str = "s") -> Store:
    store = Store(url)
    store.upsert_sweep(sweep_name, {"name": sweep_name}, "/tmp/s", "local")
    runs = [NewRun(f"run{i}abc", i, {"seed": i}, {"seed": i}, {"steps": 10}, f"/tmp/s/run{i}") for i in range(n)]
    store.register_runs(sweep_name, runs)
    return store


# ---------------------------------------------------------------------------------------------
# 1. States: one enum, the named sets


def test_states_are_the_stored_strings_and_records_carry_the_enum(db_url):
    store = store_with_runs(db_url, 1)
    (run,) = store.runs("s")
    assert run.state is RunState.REGISTERED and run.state == "registered"  # the DB is unchanged
    store.add_attempt(run.id, "local", state=AttemptState.QUEUED)
    (attempt,) = store.attempts(run.id)
    assert attempt.state is AttemptState.QUEUED
    assert set(ACTIVE_STATES) | set(TERMINAL_STATES) | {RunState.REGISTERED} == set(RUN_STATES)
    assert not set(ACTIVE_STATES) & set(TERMINAL_STATES)
    assert RunState.COMPLETED not in CANCELLABLE_STATES and RunState.REGISTERED in CANCELLABLE_STATES


def test_not_found_is_a_store_error_not_a_key_error(sqlite_url):
    store = store_with_runs(sqlite_url)
    with pytest.raises(NotFoundError) as info:
        store.get_run("zzz")
    assert isinstance(info.value, StoreError) and not isinstance(info.value, KeyError)
    code, out = sweep("--db", sqlite_url, "logs", "zzz")
    assert code == 1 and "no run with id 'zzz'" in one_line(out)


# ---------------------------------------------------------------------------------------------
# 3. Read commands create nothing and migrate nothing


@pytest.mark.parametrize(
    "command", [["status"], ["status", "s"], ["logs", "abc"], ["cancel", "s"], ["report", "s"]]
)
def test_read_commands_on_a_missing_store_create_nothing(tmp_path, command):
    db = tmp_path / "no" / "such" / "dir" / "x.db"
    code, out = sweep("--db", f"sqlite:///{db}", *command)
    assert code == 1
    assert f"no store at sqlite:///{db}" in one_line(out)
    assert not (tmp_path / "no").exists()


def test_status_of_slash_nonexistent_creates_no_directory():
    assert not Path("/nonexistent").exists()
    proc = sweep_process("--db", "sqlite:////nonexistent/x.db", "status")
    assert proc.returncode == 1 and "no store at sqlite:////nonexistent/x.db" in one_line(proc.stderr)
    assert not Path("/nonexistent").exists()


def test_read_commands_do_not_migrate_an_empty_database(tmp_path):
    db = tmp_path / "empty.db"
    db.touch()
    code, out = sweep("--db", f"sqlite:///{db}", "status")
    assert code == 1 and "holds no scalesweep store yet" in one_line(out)
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM sqlite_master")).all() == []  # still empty
    engine.dispose()


@pytest.mark.parametrize("command", [["status"], ["report", "s"], ["cancel", "s"], ["logs", "run0"]])
def test_a_schema_newer_than_the_code_is_refused_by_every_command(db_url, command, sweep_file):
    store_with_runs(db_url).close()
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0999'"))
    code, out = sweep("--db", db_url, *command)
    assert code == 1 and "schema revision '0999'" in one_line(out) and "upgrade scalesweep" in out
    grid = sweep_file("name: s2\ngrid:\n  loss.type: [cispo]\n")
    code, out = sweep("--db", db_url, "launch", str(grid), "--cluster", "local")
    assert code == 1 and "schema revision '0999'" in one_line(out)
    with engine.connect() as conn:  # nothing migrated, nothing registered
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0999"
        assert conn.execute(text("SELECT count(*) FROM sweeps")).scalar() == 1
    engine.dispose()


def test_status_reads_a_store_in_a_read_only_directory(tmp_path):
    """A read-only bind mount (root ignores file modes): SQLite cannot make its WAL index there."""
    results = tmp_path / "results"
    results.mkdir()
    store = store_with_runs(f"sqlite:///{results / 'sweeps.db'}")
    store.close()
    assert not (results / "sweeps.db-wal").exists()
    script = (
        f"mount --bind {results} {results} && mount -o remount,ro,bind {results} && "
        f"{sys.executable} -m launcher.cli --db sqlite:///{results / 'sweeps.db'} status s"
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    if proc.returncode != 0 and "mount:" in proc.stderr:
        pytest.fail(f"could not make a read-only mount here: {proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    assert "3 registered" in proc.stdout and "migrating" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# 4. Bad URLs, connect timeout


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://user@host/db", "unsupported database URL scheme 'mysql'"),
        ("postgresql+nosuchdriver://user@host/db", "unsupported database URL scheme 'postgresql+nosuchdriver'"),
        ("postgresql://user@127.0.0.1:notaport/db", "its port is not a number"),
        ("postgresql://user@127.0.0.1:99999/db", "bad port 99999"),
        ("not a url at all", "not a URL"),
        ("sqlite://", "names no file"),
        ("sqlite:////tmp/x.db?password=abc", "SQLite takes no query parameters (password)"),
    ],
)
def test_bad_db_urls_are_one_line_usage_errors(url, says, tmp_path):
    for command in (["status"], ["cancel", "x"], ["logs", "x"]):
        code, out = sweep("--db", url, *command)
        assert code == 2 and says in one_line(out)
        assert "allowed" in out or "expected" in out
    assert list(tmp_path.iterdir()) == []


def test_a_port_that_never_answers_fails_within_the_connect_timeout():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts, never speaks PostgreSQL
    try:
        port = listener.getsockname()[1]
        start = time.monotonic()
        proc = sweep_process(
            "--db", f"postgresql://u:{SECRET}@127.0.0.1:{port}/db", "status",
            env={"SWEEP_DB_CONNECT_TIMEOUT_S": "2"}, timeout=30,
        )  # fmt: skip
        elapsed = time.monotonic() - start
    finally:
        listener.close()
    assert proc.returncode == 1 and elapsed < 10, (elapsed, proc.stderr)
    line = one_line(proc.stderr)
    assert "timeout" in line and f"127.0.0.1:{port}" in line and SECRET not in proc.stdout + proc.stderr


def test_the_connect_timeout_default_is_set_on_postgres_engines(pg_url, monkeypatch):
    """10 s unless the URL names its own `connect_timeout` or SWEEP_DB_CONNECT_TIMEOUT_S sets another."""
    monkeypatch.delenv("SWEEP_DB_CONNECT_TIMEOUT_S", raising=False)

    def connect_timeout(url):
        store = Store(url)
        try:
            with store._engine.connect() as conn:  # as the server connection was really made
                return conn.connection.dbapi_connection.info.get_parameters().get("connect_timeout")
        finally:
            store.close()

    assert connect_timeout(pg_url) == "10"
    assert connect_timeout(pg_url + "?connect_timeout=3") == "3"
    monkeypatch.setenv("SWEEP_DB_CONNECT_TIMEOUT_S", "4")
    assert connect_timeout(pg_url) == "4"


# ---------------------------------------------------------------------------------------------
# 5. Secrets never printed


def test_mask_url_hides_passwords_in_every_part():
    assert SECRET not in mask_url(f"postgresql://u:{SECRET}@h/db")
    assert mask_url(f"postgresql://u@h/db?password={SECRET}&sslmode=require") == (
        "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert mask_url(f"postgresql://u@h/db?sslpassword={SECRET}") == "postgresql://u@h/db?sslpassword=***"
    masked = mask_url(f"postgresql://u:{SECRET[:4]}@{SECRET[4:]}@127.0.0.1:5432/db")  # an unencoded @
    assert masked == "postgresql://u:***@127.0.0.1:5432/db"
    assert "SECRET" not in mask_url(f"postgres:/u:{SECRET}@@h")


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://postgres@127.0.0.1:5432/postgres?password={SECRET}",
        f"postgresql://postgres:{SECRET[:4]}@{SECRET[4:]}@127.0.0.1:5432/postgres",
        f"postgresql://postgres:{SECRET}@127.0.0.1:1/db",  # nothing listens: the driver's error
        f"postgresql://postgres@127.0.0.1:1/db?password={SECRET}",
        f"sqlite:////nonexistent/x.db?password={SECRET}",
    ],
)
def test_no_command_prints_a_password(url, sweep_file):
    grid = sweep_file("name: s\ngrid:\n  loss.type: [cispo]\n")
    for args in (
        ["--db", url, "status"],
        ["--db", url, "logs", "abc"],
        ["--db", url, "cancel", "abc"],
        ["--db", url, "launch", str(grid), "--dry-run", "--cluster", "local"],
        ["--db", url, "launch", str(grid), "--dry-run", "--cluster", "slurm"],
    ):
        proc = sweep_process(*args)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert SECRET[4:] not in proc.stdout + proc.stderr, (args, proc.stdout, proc.stderr)
        assert SECRET[:4] + "@" not in proc.stdout + proc.stderr


def test_errors_from_the_driver_are_scrubbed_of_query_secrets():
    with pytest.raises(StoreError) as info:
        Store(f"postgresql://postgres@127.0.0.1:1/db?password={SECRET}&connect_timeout=2")
    assert SECRET not in str(info.value) and "password=***" in str(info.value)
    with pytest.raises(BadURLError):
        Store(f"postgresql://u:{SECRET[:4]}@{SECRET[4:]}@h/db")


# ---------------------------------------------------------------------------------------------
# 6. sweep cancel matches literally


@pytest.mark.parametrize("target", ["%", "_", "run%", "r_n0abc", "%abc"])
def test_cancel_wildcards_match_nothing(sqlite_url, target):
    store = store_with_runs(sqlite_url)
    code, out = sweep("--db", sqlite_url, "cancel", target)
    assert code == 1 and f"no run with id {target!r}" in one_line(out)
    assert {r.state for r in store.runs("s")} == {RunState.REGISTERED}


@pytest.mark.parametrize("target", ["", " ", "\t"])
def test_cancel_refuses_an_empty_target(sqlite_url, target):
    store = store_with_runs(sqlite_url)
    code, out = sweep("--db", sqlite_url, "cancel", target)
    assert code == 2 and "is empty" in out
    assert {r.state for r in store.runs("s")} == {RunState.REGISTERED}
    with pytest.raises(NotFoundError):
        store.get_run(target)


def test_cancel_by_a_literal_prefix_still_works(sqlite_url):
    store = store_with_runs(sqlite_url)
    code, out = sweep("--db", sqlite_url, "cancel", "run1")
    assert code == 0 and "cancelled 1 run(s): run1abc" in out
    assert [r.state for r in store.runs("s")] == [RunState.REGISTERED, RunState.CANCELLED, RunState.REGISTERED]


# ---------------------------------------------------------------------------------------------
# 10. Markup in user text


def test_status_shows_markup_in_reasons_and_labels_as_text(sqlite_url):
    store = Store(sqlite_url)
    store.upsert_sweep("m", {"name": "m"}, "/tmp/m", "local")
    store.register_runs("m", [NewRun("markup1", 0, {}, {"label[/]": "[/][bold]x"}, {"steps": 1}, "/tmp/m/r")])
    store.set_run_state("markup1", RunState.FAILED, "boom [/] [red]not red[/red] [/")
    code, out = sweep("--db", sqlite_url, "status", "m")
    assert code == 0, out
    assert "boom [/] [red]not red[/red] [/" in out and "[/][bold]x" in out and "label[/]" in out


# ---------------------------------------------------------------------------------------------
# 7. --max-parallel


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_parallel_below_one_is_refused(value, sweep_file, sqlite_url, tmp_path):
    grid = sweep_file("name: s\ngrid:\n  loss.type: [cispo]\n")
    code, out = sweep("--db", sqlite_url, "launch", str(grid), "--cluster", "local", "--max-parallel", value)
    assert code == 2 and f"must be >= 1 (runs at once), got {value}" in out
    assert not (tmp_path / "sweeps.db").exists() and not (tmp_path / "runs").exists()


def test_the_saved_limit_survives_and_bad_files_fall_back(sqlite_url):
    url = Store(sqlite_url).url
    local.save_limit(url, 1)
    assert local.read_limit(url) == 1
    local.limit_path(url).write_text("-3\n")
    assert local.read_limit(url) == local.default_parallelism()
    with pytest.raises(ValueError, match="must be >= 1"):
        local.save_limit(url, 0)


# ---------------------------------------------------------------------------------------------
# 8. A local submission that fails


def _queued_run(url: str, tmp_path: Path) -> Store:
    store = Store(url)
    store.upsert_sweep("f", {"name": "f"}, str(tmp_path / "runs" / "f"), "local")
    run_dir = tmp_path / "runs" / "f" / "run0abc"
    store.register_runs("f", [NewRun("run0abc", 0, {}, {}, {"steps": 1}, str(run_dir))])
    store.claim_runs(["run0abc"], [RunState.REGISTERED], "t")
    return store


def test_a_run_the_scheduler_cannot_start_fails_with_the_cause(sqlite_url, tmp_path):
    store = _queued_run(sqlite_url, tmp_path)
    run_dir = Path(store.get_run("run0abc").run_dir)
    run_dir.mkdir(parents=True)
    store.record_submissions(local.EXECUTOR, [{"run_id": "run0abc"}], RunState.QUEUED)
    (run_dir / "logs").write_text("a file where submitit wants its folder")
    local.save_limit(store.url, 1)
    local.serve(store)  # returns: nothing it could start is left queued
    run = store.get_run("run0abc")
    assert run.state == RunState.FAILED
    assert "could not start it" in run.state_reason and "(log: " in run.state_reason
    assert store.attempts("run0abc")[-1].state == AttemptState.FAILED
    assert store.queued_attempts(local.EXECUTOR, limit=5) == []
    code, out = sweep("--db", sqlite_url, "status", "f")  # must not start it again
    assert code == 0 and store.get_run("run0abc").state == RunState.FAILED


def test_a_launch_whose_scheduler_cannot_start_leaves_nothing_queued(sweep_file, sqlite_url, tmp_path, monkeypatch):
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("SWEEP_CACHE", str(blocker))  # the scheduler's lock directory cannot be made
    grid = sweep_file("name: f\ngrid:\n  loss.type: [cispo, grpo]\nbudget: {steps: 1}\n")
    code, out = sweep("--db", sqlite_url, "launch", str(grid), "--cluster", "local")
    assert code == 1 and "submitting 2 runs with the local executor failed" in one_line(out) and "locks" in out
    store = Store(sqlite_url)
    runs = store.runs("f")
    assert {r.state for r in runs} == {RunState.REGISTERED}
    assert all("submission failed" in (r.state_reason or "") for r in runs)
    assert store.queued_attempts(local.EXECUTOR, limit=5) == []
    monkeypatch.setenv("SWEEP_CACHE", str(tmp_path / "cache"))
    code, out = sweep("--db", sqlite_url, "status", "f")
    assert code == 0 and {r.state for r in store.runs("f")} == {RunState.REGISTERED}


# ---------------------------------------------------------------------------------------------
# 7. The limit holds across a SIGKILL of the scheduler (real processes, real training)

TINY3 = """\
name: par
recipe:
  batch: {prompts: 4, generations: 4}
  optim: {lr: 3.0e-4, warmup_steps: 0}
  eval: {every: 10, samples: 2}
  data: {num_valid_prompts: 16}
  checkpoint: {every: 10}
grid:
  optim.lr: [1.0e-4, 2.0e-4, 3.0e-4]
budget: {steps: 12}
"""


def _scheduler_pids(url: str) -> list[int]:
    log = local.lock_path(url).with_suffix(".log")
    if not log.exists():
        return []
    return [int(line.split()[2]) for line in log.read_text().splitlines() if line.startswith("local scheduler ")]


def _wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_max_parallel_one_holds_after_the_scheduler_is_sigkilled(sweep_file, sqlite_url):
    grid = sweep_file(TINY3)
    code, out = sweep("--db", sqlite_url, "launch", str(grid), "--cluster", "local", "--max-parallel", "1")
    assert code == 0, out
    store = Store(sqlite_url)

    def open_attempts() -> list:
        return [a for a in store.active_attempts(local.EXECUTOR) if a.state != AttemptState.QUEUED]

    _wait(lambda: [a for a in open_attempts() if a.state == AttemptState.RUNNING], 120, "a running attempt")
    (first,) = _scheduler_pids(store.url)
    os.kill(first, signal.SIGKILL)
    # SIGKILL is not instant (a process in an uninterruptible disk wait dies after it): until it is
    # gone its lock is held, and `sweep status` would rightly see a scheduler serving the database.
    _wait(lambda: not local.is_alive(first), 60, f"scheduler {first} to die")
    code, out = sweep("--db", sqlite_url, "status", "par")  # restarts a scheduler (the sync step)
    assert code == 0, out
    most = 0
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        most = max(most, len(open_attempts()))
        if all(r.state in TERMINAL_STATES for r in store.runs("par")):
            break
        time.sleep(0.2)
    runs = store.runs("par")
    assert {r.state for r in runs} == {RunState.COMPLETED}, [(r.id, r.state, r.state_reason) for r in runs]
    assert most == 1
    assert len(_scheduler_pids(store.url)) >= 2  # a second scheduler did the rest
    spans = sorted((a.started_at, a.ended_at) for r in runs for a in store.attempts(r.id))
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans


# ---------------------------------------------------------------------------------------------
# 9. A checkpoint whose state dict does not fit: the run resumes from an older valid one


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from recipe.tasks import builtin

    base = builtin.WarmupRecipe(num_steps=100, lr=1e-3, label_smoothing=0.0)
    return builtin.builtin_model_dir("sort6-test", base, tmp_path_factory.mktemp("cache"), lambda _: None)


@pytest.mark.usefixtures("torch_one_thread")
def test_training_resumes_from_an_older_checkpoint_when_the_newest_does_not_fit(tiny_model_dir, tmp_path):
    import torch

    from recipe.config import resolve
    from recipe.loop import checkpoint
    from recipe.loop.train import train
    from recipe.telemetry.sinks import MemorySink

    flat = {
        "model.path": str(tiny_model_dir), "data.num_train_prompts": 200, "data.num_valid_prompts": 16,
        "batch.prompts": 4, "batch.generations": 4, "eval.every": 4, "eval.samples": 2,
        "checkpoint.every": 3, "checkpoint.keep": 3, "budget.steps": 8,
    }  # fmt: skip
    train(resolve(flat), tmp_path, MemorySink(), log=lambda _: None)
    newest = checkpoint.checkpoint_path(tmp_path, 8)
    saved = torch.load(newest, weights_only=True)
    name = next(iter(saved["model"]))
    saved["model"][name] = torch.zeros(1)  # right keys, wrong tensor: what a changed model leaves
    checkpoint.save(tmp_path, 8, saved)

    logs: list[str] = []
    sink = MemorySink()
    outcome = train(resolve(flat | {"budget.steps": 10}), tmp_path, sink, log=logs.append)
    assert outcome.resumed_from_step == 6 and outcome.final_step == 10
    assert any("skipping checkpoint" in m and "step_00000008.pt" in m and name in m for m in logs), logs
    assert newest.with_name("step_00000008.pt.corrupt").exists()


def test_a_local_job_failing_in_its_imports_is_reported_by_its_exception_line(tmp_path):
    """submitit's error ends with the log paths; the cause a user sees is the traceback's exception line."""
    import importlib

    import submitit

    from launcher.local import failure_cause

    executor = submitit.LocalExecutor(folder=tmp_path / "logs")
    job = executor.submit(importlib.import_module, "scalesweep_no_such_module")
    with pytest.raises(Exception) as raised:
        job.result()
    assert failure_cause(raised.value) == "ModuleNotFoundError: No module named 'scalesweep_no_such_module'"
    assert failure_cause(RuntimeError("plain\nlast line")) == "last line"
