"""Bad input at `sweep launch`: one line naming the file, the key, the bad value and what is
allowed; exit code 2; nothing registered (the store is not even created).

Each case is a real launch (local executor), so a check that only runs on `--dry-run`, or after
registering, would fail here.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import require_module

from launcher.cli import cli
from launcher.yamlfile import MAX_NODES

BOMB = (
    "name: a\nx: &a [1,1,1,1,1,1,1,1,1,1]\ny: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
    "z: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nw: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    "v: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nu: [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
)

# (case, sweep file, overrides, fragments the one-line message must contain)
CASES = [
    # YAML that does not parse: file, line and column
    ("unclosed bracket", "name: a\ngrid: {loss.type: [cispo\n", [], ["grid.yaml", "line 3", "column 1", "']'"]),
    ("tab indentation", "name: a\ngrid:\n\tloss.type: [cispo]\n", [], ["grid.yaml", "line 3", "tab"]),
    ("bad indentation", "name: a\ngrid:\n  loss.type: [cispo]\n loss.aggregation: [token]\n", [], ["grid.yaml", "line 4"]),
    ("duplicate key", "name: a\nseeds: [0]\nname: b\n", [], ["grid.yaml", "line 3", "duplicate key 'name'", "line 1"]),
    ("duplicate nested key", "name: a\ngrid: {loss.type: [cispo], loss.type: [dapo]}\n", [], ["duplicate key 'loss.type'"]),
    ("unsafe tag", "name: !!python/object/apply:os.system ['true']\n", [], ["grid.yaml", "line 1", "tag not allowed"]),
    ("alias bomb", BOMB, [], ["grid.yaml", "alias", f"{MAX_NODES:,}"]),
    # values
    ("nan float", "name: a\nbudget: {flops: .nan}\n", [], ["budget.flops", "nan", "finite"]),
    ("inf float", "name: a\nrecipe: {optim: {lr: .inf}}\n", [], ["recipe.optim.lr", "inf", "finite"]),
    ("nan in an axis", "name: a\ngrid: {loss.eps_max: [2.0, .nan]}\n", [], ["grid.loss.eps_max", "nan"]),
    ("huge seed", "name: a\nseeds: [100000000000000000000000]\n", [], ["seeds", "100000000000000000000000", "4294967295"]),
    ("huge step budget", "name: a\nbudget: {steps: 100000000000000000000}\n", [], ["budget.steps", "100000000000000000000"]),
    ("literal typo", "name: a\nrecipe: {loss: {type: cispoo}}\n", [], ["recipe.loss.type", "cispoo", "did you mean 'cispo'"]),
    ("kernels typo", "name: a\ngrid: {engine.kernels: [reference, fats]}\n", [], ["engine.kernels", "fats", "did you mean 'fast'"]),
    # keys that used to be ignored or rewritten
    ("recipe seed", "name: a\nrecipe: {seed: 7}\n", [], ["recipe.seed", "7", "seeds"]),
    ("seed axis", "name: a\ngrid: {seed: [1, 2]}\n", [], ["grid.seed", "seeds"]),
    ("budget axis", "name: a\ngrid: {budget.steps: [10, 20]}\n", [], ["grid.budget.steps", "budget"]),
    ("budget in zip", "name: a\nzip: [{budget.steps: [1, 2], optim.lr: [1.0e-4, 2.0e-4]}]\n", [], ["zip[0].budget.steps"]),
    ("name with newline", "name: |\n  abc\n", [], ["name", "'abc\\n'"]),
    # resources
    ("negative nodes", "name: a\nresources: {nodes: -3}\n", [], ["resources.nodes", "-3", ">= 1"]),
    ("memory as a word", "name: a\nresources: {mem_gb: lots}\n", [], ["resources.mem_gb", "'lots'", "number"]),
    ("zero timeout", "name: a\nresources: {timeout_min: 0}\n", [], ["resources.timeout_min", "0", ">= 1"]),
    ("fractional gpus", "name: a\nresources: {gpus_per_node: 1.5}\n", [], ["resources.gpus_per_node", "1.5", "integer"]),
    ("setup as a string", "name: a\nresources: {setup: 'module load x'}\n", [], ["resources.setup", "list of shell lines"]),
    ("resource typo", "name: a\nresources: {gpu_per_node: 1}\n", [], ["resources.gpu_per_node", "gpus_per_node"]),
    # interpolation: refused, never resolved
    ("env resolver", "name: a\nrecipe: {model: {path: '${oc.env:SECRET_TOKEN}'}}\n", [], ["recipe.model.path", "interpolation"]),
    # overrides
    ("override without =", "name: a\n", ["budget.steps"], ["override 'budget.steps'", "KEY=VALUE"]),
    ("override with empty key", "name: a\n", ["=5"], ["override '=5'", "invalid key"]),
    ("override bad yaml", "name: a\n", ["grid.optim.lr=[1e-4"], ["override 'grid.optim.lr=[1e-4'", "']'"]),
    ("override unknown section", "name: a\n", ["gird.optim.lr=[1]"], ["'gird'", "did you mean 'grid'"]),
    ("override nan", "name: a\n", ["budget.flops=.nan"], ["budget.flops", "finite"]),
    # what the job needs
    ("missing model dir", "name: a\nrecipe: {model: {path: /nonexistent/model}}\n", [], ["model.path", "/nonexistent/model", "no such directory"]),
    ("excluding everything", "name: a\ngrid: {loss.type: [cispo, dapo]}\nexclude: [{loss.type: cispo}, {loss.type: dapo}]\n", [], ["exclude", "every run"]),
    ("too many runs", "name: a\ngrid: {optim.lr: [1.0e-4, 2.0e-4, 3.0e-4], batch.prompts: [1, 2, 3]}\n", ["--max-runs", "4"], ["9 runs", "4"]),
]  # fmt: skip


def _launch(tmp_path: Path, text: str, args: list[str], **env: str):
    grid = tmp_path / "grid.yaml"
    grid.write_text(text)
    db = tmp_path / "store" / "sweeps.db"
    overrides = [a for a in args if not a.startswith("--") and not a.isdigit()]
    options = [a for a in args if a not in overrides]
    result = CliRunner().invoke(
        cli,
        ["--db", f"sqlite:///{db}", "launch", str(grid), *overrides, "--cluster", "local", *options],
        env=env or None,
    )
    return result, db


@pytest.mark.parametrize(("case", "text", "args", "fragments"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_registered(tmp_path, case, text, args, fragments):
    result, db = _launch(tmp_path, text, args)
    assert result.exit_code == 2, (case, result.output)
    message = result.stderr.strip()
    assert message.startswith("error: "), message
    assert "\n" not in message, message
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not db.exists(), "nothing is registered: the store is not even created"


def test_a_resolved_secret_never_appears(tmp_path):
    result, _ = _launch(
        tmp_path, "name: a\nrecipe: {model: {path: '${oc.env:SECRET_TOKEN}'}}\n", [], SECRET_TOKEN="hunter2-s3cr3t"
    )
    assert result.exit_code == 2
    assert "hunter2-s3cr3t" not in result.output + result.stderr


def test_bad_cluster_profile_names_the_profile_file(tmp_path):
    profile = tmp_path / "prof.yaml"
    for text, fragments in [
        ("partition: gpu\npartition: cpu\n", ["prof.yaml", "line 2", "duplicate key 'partition'"]),
        ("nodes: [1\n", ["prof.yaml", "line 2"]),
        ("mem_gb: -1\n", ["prof.yaml", "mem_gb", "-1"]),
        ("setup: echo\n", ["prof.yaml", "setup", "list of shell lines"]),
    ]:
        profile.write_text(text)
        result, db = _launch(tmp_path, f"name: a\nresources: {{profile: {profile}}}\n", [])
        assert result.exit_code == 2, result.output
        message = result.stderr.strip()
        assert "\n" not in message and all(f in message for f in fragments), message
        assert not db.exists()


def test_root_that_is_a_file_is_refused_and_nothing_registered(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result, db = _launch(tmp_path, "name: a\nbudget: {steps: 1}\n", [], SWEEP_ROOT=str(not_a_dir))
    assert result.exit_code == 2, result.output
    assert "not a directory" in result.stderr and "\n" not in result.stderr.strip()
    assert not db.exists() or "a" not in _sweeps(db)


def _sweeps(db: Path) -> list[str]:
    from store import Store

    return [s.name for s in Store(f"sqlite:///{db}").list_sweeps()]


def test_large_honest_file_is_not_called_an_alias_bomb(tmp_path):
    items = "".join(f"  - item {i}\n" for i in range(20_000))
    result, _ = _launch(tmp_path, f"name: a\ndescription:\n{items}recipe: {{seed: 1}}\n", [])
    assert result.exit_code == 2
    assert "alias" not in result.stderr and "recipe.seed" in result.stderr  # parsed fine; the next check speaks


def test_unmatched_exclude_warns_and_launch_goes_on(tmp_path):
    result, _ = _launch(
        tmp_path, "name: a\ngrid: {loss.type: [cispo, dapo]}\nexclude: [{loss.type: gspo}]\n", ["--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "exclude[0]: loss.type=gspo matches no run" in result.stderr


def test_dotted_axis_can_be_overridden(tmp_path):
    result, _ = _launch(tmp_path, "name: a\ngrid: {optim.lr: [1.0e-4]}\n", ["grid.optim.lr=[1e-4,2e-4,3e-4]", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "3 runs" in result.output


def test_million_run_grid_is_refused_fast(tmp_path):
    axes = ", ".join(f"{k}: [{', '.join(str(v) for v in range(lo, lo + 10))}]" for k, lo in [
        ("batch.prompts", 1), ("batch.generations", 2), ("eval.every", 1), ("checkpoint.every", 1),
        ("optim.warmup_steps", 0), ("checkpoint.keep", 1),
    ])  # fmt: skip
    started = time.perf_counter()
    result, db = _launch(tmp_path, f"name: a\ngrid: {{{axes}}}\n", [])
    elapsed = time.perf_counter() - started
    assert result.exit_code == 2 and "1,000,000 runs" in result.stderr, result.output
    assert elapsed < 5, elapsed  # measured ~0.1 s; a generous bound, the point is "before expanding"
    assert not db.exists()


def test_dry_run_script_quotes_the_root_and_honours_root(tmp_path):
    root = tmp_path / "odd $(touch pwned) root"
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: a\ngrid: {loss.type: [cispo, dapo]}\n")
    result = CliRunner().invoke(
        cli, ["launch", str(grid), "--dry-run", "--cluster", "slurm", "--root", str(root)], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    script = result.output[result.output.index("#!/bin/bash") :]
    quoted = "'" + str(root / "a" / "slurm") + "'"
    assert f"submitit.core._submit {quoted}" in script
    assert str(root / "a" / "slurm") in script
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("name: a\nrecipe: {engine: {generator_ranks: 1}}\n", ["engine.generator_ranks", "1", "no trainer rank"]),
        ("name: a\nresources: {tasks_per_node: 3}\n", ["engine.generator_ranks", "0", "3 task(s)"]),
        # refused whether or not the package is installed: "cannot import" or no generator ranks
        ("name: a\nrecipe: {engine: {generator: vllm}}\n", ["engine.generator", "'vllm'"]),
        ("name: a\nrecipe: {engine: {generator_ranks: -1}}\n", ["recipe.engine.generator_ranks", "-1"]),
        # ZeRO-3 shards the weights rank 0 samples with: refused before anything is registered
        ("name: a\ngrid: {engine.zero_stage: [2, 3]}\n", ["engine.zero_stage", "3", "not available yet", "allowed: 0, 1, 2"]),
    ],
)
def test_layouts_this_version_cannot_run_are_refused_at_launch(tmp_path, text, fragments):
    result, db = _launch(tmp_path, text, [])
    assert result.exit_code == 2, result.output
    assert all(f in result.stderr for f in fragments), result.stderr
    assert not db.exists()


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "not-importable"])
def test_the_deepspeed_trainer_is_refused_at_launch_only_where_it_cannot_be_imported(tmp_path, monkeypatch, installed):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    if installed:
        require_module("deepspeed")
    if not installed:
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a)
        )
    result, db = _launch(tmp_path, "name: a\nrecipe: {engine: {trainer: deepspeed}}\n", ["--dry-run"])
    if installed:
        assert result.exit_code == 0, result.output
    else:
        assert result.exit_code == 2, result.output
        assert all(f in result.stderr for f in ["engine.trainer", "'deepspeed'", "cannot import"]), result.stderr
    assert not db.exists()
