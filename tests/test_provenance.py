"""Provenance, `sweep show` and `sweep rerun` on real runs (local executor, the tiny CPU model)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from launcher.cli import cli
from recipe.telemetry.provenance import code_version, collect
from store import Store

TINY = """\
name: prov
recipe:
  batch: {prompts: 4, generations: 4}
  optim: {lr: 3.0e-4, warmup_steps: 0}
  eval: {every: 4, samples: 2}
  data: {num_valid_prompts: 16}
  checkpoint: {every: 4}
budget: {steps: 4}
"""


def sweep(db: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--db", db, *args], terminal_width=200)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_collect_names_code_packages_and_machine():
    record = collect(sweep_file="g.yaml", sweep_file_sha256="ab", config={"seed": 1})
    assert record["code"]["commit"] == code_version()["commit"]  # this checkout is a git tree
    assert len(record["code"]["commit"]) == 40 and isinstance(record["code"]["dirty"], bool)
    assert set(record["packages"]) >= {"scalesweep", "torch", "transformers", "vllm", "deepspeed"}
    assert record["packages"]["torch"] is not None and record["python"].count(".") == 2
    assert record["gpus"]["count"] == 0 and record["host"]


@pytest.mark.slow
def test_show_and_rerun_a_finished_run(sweep_file, sqlite_url):
    grid = sweep_file(TINY)
    code, out = sweep(sqlite_url, "launch", str(grid), "--cluster", "local", "--wait")
    assert code == 0, out
    store = Store(sqlite_url)
    (run,) = store.runs("prov")

    code, out = sweep(sqlite_url, "show", run.id[:6], "--json")
    assert code == 0, out
    shown = json.loads(out)
    assert shown["run"] == run.id and shown["state"] == "completed" and shown["config"] == run.config
    (attempt,) = shown["attempts"]
    assert attempt["state"] == "completed" and attempt["provenance"] == shown["provenance"]
    prov = shown["provenance"]
    assert prov["code"]["commit"] == code_version()["commit"]
    assert prov["sweep_file"] == str(grid.resolve()) and len(prov["sweep_file_sha256"]) == 64
    assert prov["config"] == run.config and prov["packages"]["torch"]
    assert [c["step"] for c in shown["checkpoints"]] == [4] and shown["eval_points"][-1]["step"] == 4

    code, out = sweep(sqlite_url, "show", run.id)
    assert code == 0 and f"run {run.id} of sweep prov: completed" in out and "provenance: commit" in out

    code, out = sweep(sqlite_url, "rerun", run.id)
    assert code == 0 and f"a rerun of {run.id} in sweep prov, submitted" in out, out
    code, out = sweep(sqlite_url, "rerun", run.id, "--seed", "5")
    assert code == 0, out
    runs = {r.id: r for r in store.runs("prov")}
    assert len(runs) == 3
    same, reseeded = (r for rid, r in runs.items() if rid != run.id)
    assert same.config == run.config and same.axes == run.axes
    assert reseeded.config == run.config | {"seed": 5}


def test_show_and_rerun_of_an_unknown_run_are_one_line_errors(sqlite_url):
    Store(sqlite_url).upsert_sweep("s", {}, "/nowhere", "local")
    for command in ("show", "rerun"):
        code, out = sweep(sqlite_url, command, "nope")
        assert code == 1 and out.strip().startswith("error: no run with id 'nope'") and "\n" not in out.strip()
