"""Launching and tracking on a real Slurm cluster (slurm/dev-cluster.sh), with real training jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import sweep_cli as sweep
from conftest import wait_ended, wait_for

import launcher.slurm
from recipe.config import RecipeConfig
from store import NewRun, Store

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]

TINY = """\
name: {name}
recipe:
  batch: {{prompts: 4, generations: 4}}
  optim: {{lr: 3.0e-4, warmup_steps: 0}}
  eval: {{every: 50, samples: 2}}
  data: {{num_valid_prompts: 32}}
  checkpoint: {{every: 50}}
{extra}
budget: {{steps: {steps}}}
"""


def tiny(name: str, steps: int, extra: str = "") -> str:
    return TINY.format(name=name, steps=steps, extra=extra)




def expected_eval_steps(cfg: RecipeConfig) -> list[int]:
    from recipe.loop.train import is_eval_step

    steps = [s for s in range(cfg.budget.steps + 1) if is_eval_step(s, cfg)]
    return steps if steps[-1] == cfg.budget.steps else [*steps, cfg.budget.steps]


def assert_clean_curve(store: Store, run_id: str) -> None:
    cfg = RecipeConfig.from_dict(store.get_run(run_id).config)
    assert [p.step for p in store.eval_points(run_id)] == expected_eval_steps(cfg)


def running_past(store: Store, run_id: str, step: int):
    run = store.get_run(run_id)
    attempts = store.attempts(run_id)
    if run.state == "running" and run.step > step and attempts and attempts[-1].state == "running":
        return attempts[-1]
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The project's dev cluster, brought up when the tests run as root; any other Slurm (a real
    login node's) is never used: the tests skip, or fail under SWEEP_REQUIRE_SERVICES=1."""
    from conftest import require_dev_cluster

    script = ROOT / "slurm" / "dev-cluster.sh"
    up = subprocess.run(["bash", str(script), "status"], capture_output=True).returncode == 0
    if not up and os.geteuid() == 0:  # `up` on a running cluster would undo the settings others' tests made
        proc = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"slurm/dev-cluster.sh up failed:\n{proc.stderr[-3000:]}")
    require_dev_cluster()


@pytest.fixture(autouse=True)
def empty_queue(slurm_cluster, own_slurm_queue):
    """Each test starts and ends with no job of this test session in the queue (conftest's
    own_slurm_queue: only the jobs the tests submitted, by id)."""


@pytest.fixture
def cluster_setting(slurm_cluster):
    """Change a setting of the running cluster for one test, restored after it."""
    script = ROOT / "slurm" / "dev-cluster.sh"
    restore = []

    def change(key: str, value: str, default: str) -> None:
        subprocess.run(["bash", str(script), "set", f"{key}={value}"], check=True, capture_output=True)
        restore.append((key, default))

    yield change
    for key, default in restore:
        subprocess.run(["bash", str(script), "set", f"{key}={default}"], check=True, capture_output=True)


def test_grid_runs_as_job_arrays_and_status_asks_slurm_once(slurm_cluster, sweep_file, sqlite_url, monkeypatch):
    grid = sweep_file(tiny("arrays", 20, "grid:\n  loss.type: [cispo, grpo, dapo]"))
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "slurm")
    assert code == 0 and "3 runs, 3 new, 3 submitted (slurm)" in out, out
    store = Store(sqlite_url)
    attempts = [store.attempts(r.id)[0] for r in store.runs("arrays")]
    assert len({a.array_job_id for a in attempts}) == 1
    assert sorted(a.array_index for a in attempts) == [0, 1, 2]

    calls: list[list[str]] = []
    real_run = subprocess.run

    def counting_run(args, *rest, **kwargs):
        calls.append(list(args))
        return real_run(args, *rest, **kwargs)

    monkeypatch.setattr(launcher.slurm.subprocess, "run", counting_run)
    code, out = sweep(sqlite_url, "status", "arrays")
    assert code == 0
    assert [c[0] for c in calls if c[0] in ("sacct", "squeue")] == ["sacct"]
    for a in attempts:
        assert a.job_id in out
    monkeypatch.undo()

    runs = wait_ended(sqlite_url, "arrays")
    assert [r["state"] for r in runs] == ["completed"] * 3
    for r in runs:
        assert_clean_curve(store, r["run"])


@pytest.mark.timeout(1800)
def test_requeue_usr2_time_limit_and_sigkill_all_end_completed_from_checkpoints(slurm_cluster, sweep_file, pg_url):
    """Four disruptions at once, each on its own run: `scontrol requeue`, `scancel --signal=USR2`,
    a real 2-minute time limit (USR2 60 s before it; Slurm may send it up to 60 s earlier, so an
    attempt trains for at most ~60 s), and a SIGKILL followed by `--retry-failed`. The time-limited
    run has 12,000 steps: 2-3 minutes of training at the ~70-130 steps/s this tiny config runs on a
    quiet machine, so it is cut at least once however fast the recipe gets (4,000 steps once
    finished inside the first attempt's minute)."""
    db = pg_url
    grid = sweep_file(tiny("disrupt", 600, "grid:\n  loss.type: [cispo, grpo, dapo]"))
    limited = sweep_file(
        tiny("limited", 12000, "resources: {timeout_min: 2, signal_delay_s: 60}"),
        name="limited.yaml",
    )
    for path in (grid, limited):
        code, out = sweep(db, "launch", str(path), "--cluster", "slurm")
        assert code == 0, out
    store = Store(db)
    requeued, usr2, killed = [r.id for r in store.runs("disrupt")]

    attempt = wait_for(lambda: running_past(store, requeued, 120), what="the run to requeue")
    subprocess.run(["scontrol", "requeue", attempt.job_id], check=True)
    attempt = wait_for(lambda: running_past(store, usr2, 120), what="the run to signal")
    subprocess.run(["scancel", "--signal=USR2", attempt.job_id], check=True)
    attempt = wait_for(lambda: running_past(store, killed, 120), what="the run to kill")
    os.kill(attempt.pid, signal.SIGKILL)

    def shows_failed():
        code, out = sweep(db, "status", "disrupt", "--json")
        rows = {r["run"]: r for r in json.loads(out)["runs"]}
        return rows[killed] if rows[killed]["state"] == "failed" else None

    row = wait_for(shows_failed, 120, "the killed run to show as failed")
    assert "signal 9" in row["reason"] or "exit code" in row["reason"], row["reason"]
    assert "log:" in row["reason"]
    code, out = sweep(db, "launch", str(grid), "--cluster", "slurm", "--retry-failed")
    assert code == 0 and "1 submitted" in out, out

    for name in ("disrupt", "limited"):
        runs = wait_ended(db, name, timeout_s=900)
        assert [r["state"] for r in runs] == ["completed"] * len(runs), runs
    for run_id in (requeued, usr2, killed, store.runs("limited")[0].id):
        attempts = store.attempts(run_id)
        assert len(attempts) >= 2, (run_id, attempts)
        assert attempts[-1].state == "completed"
        assert all(a.resumed_from_step for a in attempts[1:]), attempts
        assert_clean_curve(store, run_id)
    assert store.attempts(killed)[0].state == "failed"
    assert store.attempts(usr2)[0].state == "preempted"
    assert any("USR2" in (a.exit_reason or "") for a in store.attempts(store.runs("limited")[0].id))


def test_sweep_larger_than_max_array_size_is_split_into_arrays_from_zero(cluster_setting, sweep_file, sqlite_url):
    cluster_setting("MaxArraySize", "3", "1001")
    grid = sweep_file(tiny("chunks", 10, "seeds: [0, 1, 2, 3, 4]"))
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "slurm")
    assert code == 0 and "5 submitted" in out, out
    store = Store(sqlite_url)
    arrays: dict[str, list[int]] = {}
    for run in store.runs("chunks"):
        (attempt,) = store.attempts(run.id)
        arrays.setdefault(attempt.array_job_id, []).append(attempt.array_index)
    assert sorted(sorted(v) for v in arrays.values()) == [[0, 1], [0, 1, 2]]
    runs = wait_ended(sqlite_url, "chunks")
    assert [r["state"] for r in runs] == ["completed"] * 5


def test_runs_over_the_submit_limit_wait_and_go_out_at_the_next_status(cluster_setting, sweep_file, sqlite_url):
    # The limit counts every job of the user: others' (never cancelled here) leave room for 2 of ours.
    user = os.environ.get("USER") or "root"
    others = len(subprocess.run(["squeue", "-h", "-r", "-u", user], capture_output=True, text=True).stdout.split("\n")) - 1
    cluster_setting("MaxSubmitJobs", str(others + 2), "-1")
    grid = sweep_file(tiny("limit", 10, "seeds: [0, 1, 2]"))
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "slurm")
    assert code == 0 and "2 submitted" in out, out
    store = Store(sqlite_url)
    waiting = store.runs("limit", states=["registered"])
    assert len(waiting) == 1 and f"MaxSubmitJobs={others + 2}" in waiting[0].state_reason
    runs = wait_ended(sqlite_url, "limit")  # status polls submit the waiting run once there is room
    assert [r["state"] for r in runs] == ["completed"] * 3


def test_two_concurrent_launches_submit_each_run_once(slurm_cluster, sweep_file, pg_url):
    grid = sweep_file(tiny("race", 5, "seeds: [0, 1, 2, 3, 4, 5]"))
    command = [sys.executable, "-m", "launcher.cli", "--db", pg_url, "launch", str(grid), "--cluster", "slurm"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    store = Store(pg_url)
    runs = store.runs("race")
    assert len(runs) == 6
    assert all(len(store.attempts(r.id)) == 1 for r in runs)
    job_ids = {store.attempts(r.id)[0].job_id for r in runs}
    assert len(job_ids) == 6
    wait_ended(pg_url, "race")


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_32_concurrent_writers_lose_and_duplicate_nothing(slurm_cluster, backend, request, tmp_path):
    db = f"sqlite:///{tmp_path / 'w.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    store = Store(db)
    store.upsert_sweep("writers", {}, str(tmp_path), "slurm")
    store.register_runs("writers", [NewRun(f"writer-{i}", i, {}, {}, {}, str(tmp_path)) for i in range(32)])
    points = 100
    env = {**os.environ, "SWEEP_DB": store.url, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        ["sbatch", "--parsable", "--array=0-31", f"--output={tmp_path}/w_%a.out", "--wait",
         "--wrap", f"{sys.executable} {ROOT / 'bench' / 'writer.py'} --points {points}"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    counts = {run_id: len(pts) for run_id, pts in store.sweep_eval_points("writers").items()}
    assert counts == {f"writer-{i}": points for i in range(32)}
    for i in range(32):
        assert [p.step for p in store.eval_points(f"writer-{i}")] == list(range(points))


def test_shell_metacharacters_in_paths_never_reach_a_shell(slurm_cluster, sweep_file, sqlite_url, tmp_path):
    root = tmp_path / "runs $(touch PWNED); `touch PWNED2`"
    grid = sweep_file(tiny("meta", 5, ""))
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "slurm", "--root", str(root))
    assert code == 0, out
    runs = wait_ended(sqlite_url, "meta")
    assert runs[0]["state"] == "completed"
    assert Path(runs[0]["run_dir"]).parent.parent == root
    assert not list(Path.cwd().glob("PWNED*")) and not list(tmp_path.glob("PWNED*")) and not Path("/PWNED").exists()


def test_database_password_is_masked_in_every_output_and_log(slurm_cluster, sweep_file, pg_url):
    secret = "s3cr3t-pw"  # the local server trusts everyone, so any password connects
    db = pg_url.replace("postgres@", f"postgres:{secret}@")
    grid = sweep_file(tiny("masked", 5, ""))
    outputs = [sweep(db, "launch", str(grid), "--cluster", "slurm")[1]]
    runs = wait_ended(db, "masked")
    outputs.append(sweep(db, "status", "masked")[1])
    outputs.append(sweep(db, "status", "masked", "--json")[1])
    outputs.append(sweep(db, "logs", runs[0]["run"], "--stdout")[1])
    outputs.append(sweep(db, "logs", runs[0]["run"])[1])
    outputs.append(sweep(db.replace(":5432/", ":1/"), "status")[1])  # a connection error
    for text in outputs:
        assert secret not in text
    assert "***" in outputs[3]  # the job log names the store, masked
    assert "***" in outputs[-1]


def test_the_tests_cancel_only_their_own_jobs_on_the_dev_cluster(slurm_cluster, tmp_path, tmp_path_factory):
    """A job of someone else (its output outside this test session's directory) survives the
    fixtures' cleanup; and no test names `scancel -u`."""
    from conftest import cancel_own_jobs, own_jobs

    outside = Path("/tmp") / f"not-a-test-{os.getpid()}.out"
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={outside}", "--wrap", "sleep 120"], capture_output=True, text=True, check=True
    )
    theirs = proc.stdout.strip().split(";")[0]
    try:
        mine = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp_path / 'mine.out'}", "--wrap", "sleep 120"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().split(";")[0]  # fmt: skip
        assert own_jobs(tmp_path_factory.getbasetemp()) == [mine]
        cancel_own_jobs(tmp_path_factory.getbasetemp())
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
        assert theirs in queued and mine not in queued
    finally:
        subprocess.run(["scancel", theirs], check=False)
        outside.unlink(missing_ok=True)
    for test in Path(__file__).parent.glob("*.py"):
        assert not re.search(r'"scancel",\s*"-u"', test.read_text()), test.name


def test_a_slurm_other_than_the_dev_cluster_is_never_touched(slurm_cluster, tmp_path):
    """The same daemons, reached through a slurm.conf that dev-cluster.sh did not write (as on a
    login node), or under another cluster name: the check refuses both, so the fixtures neither
    cancel nor submit there."""
    from conftest import dev_cluster_problem

    assert dev_cluster_problem() is None
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(Path("/etc/slurm/slurm.conf").read_text().splitlines()[1:]) + "\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(conf))
        assert "not written by slurm/dev-cluster.sh" in (dev_cluster_problem() or "")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEV_CLUSTER_NAME", "prod")
        assert "not the dev cluster 'prod'" in (dev_cluster_problem() or "")
