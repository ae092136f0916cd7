"""Bad input (issue 18, part 2): each case is one `error:` line naming the file, key or value and
what is allowed; a non-zero exit; nothing registered; never a traceback. Also what the report,
status and prune show for inputs that are valid but unusual (labels holding markup or terminal
escapes, labels named like report columns, same-seed reruns)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from launcher.cli import cli
from store import Store


def _sweep(db: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--db", db, *args], terminal_width=300)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _one_error(code: int, output: str) -> str:
    lines = output.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


def _curve_csv(path: Path, configs=("1", "2"), seeds=(0, 1), *, compute_scale=1.0, extra: str = "") -> Path:
    lines = [f"run,compute,pass_rate,lr,seed{',' + extra.split('=')[0] if extra else ''}"]
    for lr in configs:
        for seed in seeds:
            for i in range(1, 31):
                c = i * 10 * compute_scale
                r = 0.7 / (1 + (100 * compute_scale / c) ** 1.5) + 0.005 * np.sin(3 * i + seed + float(lr))
                lines.append(f"r{lr}-{seed},{c:g},{r:.5f},{lr},{seed}{',' + extra.split('=')[1] if extra else ''}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _no_sweeps(db: str) -> None:
    store = Store(db, create=False) if Path(db.removeprefix("sqlite:///")).exists() or "postgres" in db else None
    assert store is None or store.list_sweeps() == []


# ---------------------------------------------------------------------------------------------
# Import


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("big.jsonl", '{"run": "a", "compute": 1%s, "pass_rate": 0.5}\n' % ("0" * 400), "compute 100000000000... (401 digits) is too large"),
        ("step.jsonl", '{"run": "a", "compute": 1, "pass_rate": 0.5, "step": 1%s}\n' % ("0" * 400), "step 100000000000... (401 digits) is too large"),
        ("seed.csv", "run,compute,pass_rate,seed\na,1,0.5,1%s\n" % ("0" * 400), "seed '100000000000000000000000000000000000000... (403 characters) is too large"),
        ("digits.jsonl", '{"run": "a", "compute": %s, "pass_rate": 0.5}\n' % ("9" * 5000), "Exceeds the limit (4300 digits)"),
        ("inf.csv", "run,compute,pass_rate,x\na,1,0.5,1e999\n", "label 'x' is '1e999', beyond a float's range"),
        ("key.jsonl", '{"run": "a", "compute": 1, "pass_rate": 0.5, " ": 3}\n', "a key is ' ': every label needs a name"),
    ],
)  # fmt: skip
def test_an_unreadable_number_or_key_is_one_line_naming_file_and_line(sqlite_url, tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    line = _one_error(*_sweep(sqlite_url, "import", str(path), "--sweep", "s"))
    assert f"{path}:{2 if name.endswith('.csv') else 1}: " in line and expected in line and "nothing was written" in line
    _no_sweeps(sqlite_url)


def test_a_file_that_is_not_utf8_is_named_with_its_line(sqlite_url, tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("run,compute,pass_rate\nr,1,0.5\ncafé,2,0.6\n".encode("latin-1"))
    line = _one_error(*_sweep(sqlite_url, "import", str(path), "--sweep", "s"))
    assert f"{path}:3: byte 0xe9 is not UTF-8" in line
    _no_sweeps(sqlite_url)


def test_concurrent_imports_into_a_new_sweep_all_succeed_on_postgres(pg_url, tmp_path):
    files = [_curve_csv(tmp_path / f"part{i}.csv", configs=(str(i),)) for i in range(3)]
    Store(pg_url).close()  # the schema, so that the imports race on the sweep, not on migrating
    results: list[tuple[int, str]] = [(-1, "")] * 3

    def run(i: int) -> None:
        result = CliRunner().invoke(cli, ["--db", pg_url, "import", str(files[i]), "--sweep", "race"])
        results[i] = (result.exit_code, result.output)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [code for code, _ in results] == [0, 0, 0], results
    assert sum("new sweep" in out for _, out in results) == 1
    assert len(Store(pg_url).runs("race")) == 6


# ---------------------------------------------------------------------------------------------
# Report


@pytest.fixture
def imported(sqlite_url, tmp_path) -> str:
    assert _sweep(sqlite_url, "import", str(_curve_csv(tmp_path / "ok.csv")), "--sweep", "ok")[0] == 0
    return sqlite_url


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--compute", "flops"], "the compute axis 'flops' has no data in sweep 'ok' (every point's flops is 0); give --compute gpu_hours or step"),
        (["--compute", "flops", "--fit-until", "50%", "--predict", "100%"], "the compute axis 'flops' has no data"),
        (["--cutoff", "100", "--fit-until", "100", "--predict", "200"], "--cutoff (100) must lie below --fit-until (100)"),
        (["--cutoff", "250", "--fit-until", "50%", "--predict", "100%"], "--cutoff (250) lies at or beyond its --fit-until (150 = 50% of its compute)"),
        (["--fit-until", "150%", "--predict", "200%"], "--fit-until 150% must be below 100%"),
        (["--fit-until", "80%", "--predict", "50%"], "--predict (50%) must lie beyond --fit-until (80%)"),
        (["--bootstrap", "1000000000"], "1000000000 is not in the range 0<=x<=100000"),
    ],
)  # fmt: skip
def test_report_options_that_cannot_work_are_one_line(imported, args, expected):
    line = _one_error(*_sweep(imported, "report", "ok", "--bootstrap", "0", *args))
    assert expected in line


def test_an_axis_without_compute_says_so_for_an_import_of_zeros(sqlite_url, tmp_path):
    path = tmp_path / "zero.csv"
    path.write_text("run,compute,pass_rate\na,0,0.5\na,0,0.6\nb,0,0.1\n")
    assert _sweep(sqlite_url, "import", str(path), "--sweep", "z")[0] == 0
    for args in ([], ["--compute", "gpu_hours", "--predict", "100%", "--fit-until", "50%"]):
        line = _one_error(*_sweep(sqlite_url, "report", "z", *args))
        assert "has no data in sweep 'z'" in line and "give --compute step" in line
    line = _one_error(*_sweep(sqlite_url, "prune", "z", "--simulate", "--compute", "gpu_hours"))
    assert "the compute axis 'gpu_hours' has no data" in line


def test_a_sweep_without_eval_points_is_named_not_an_empty_table(sqlite_url, tmp_path):
    store = Store(sqlite_url)
    from store import NewRun

    store.register_sweep("idle", {}, str(tmp_path), "local", [NewRun("r1", 0, {}, {"lr": 1}, {"steps": 5}, str(tmp_path))])
    for verb in (["report", "idle"], ["prune", "idle", "--simulate"], ["prune", "idle", "--dry-run"]):
        line = _one_error(*_sweep(sqlite_url, *verb))
        assert "sweep 'idle' has no evaluation point yet (1 registered): nothing to fit" in line


def test_labels_render_literally_and_never_reach_the_terminal_as_escapes(sqlite_url, tmp_path):
    rows = []
    for name, value in (("a", "[red]k[/]"), ("b", "\u001b[31mred\u0007"), ("c", "[/]")):
        rows += [{"run": name, "compute": c, "pass_rate": 0.6 / (1 + (50 / c) ** 1.2), "[/]": "[/]", "lab": value}
                 for c in range(5, 200, 10)]  # fmt: skip
    path = tmp_path / "markup.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _sweep(sqlite_url, "import", str(path), "--sweep", "m")[0] == 0
    for verb in (["report", "m", "--bootstrap", "0"], ["status", "m"]):
        code, out = _sweep(sqlite_url, *verb)
        assert code == 0
        assert "[red]k[/]" in out and "\x1b" not in out and "\x07" not in out
        assert "\\x1b[31mred" in out  # shown, not interpreted (rich itself drops the BEL)


def test_labels_named_like_report_columns_get_their_own_headers(sqlite_url, tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("run,compute,pass_rate,A,flags,n\n" + "".join(
        f"{r},{c},{0.6 / (1 + (50 / c) ** 1.2):.3f},{r}x,f,{k}\n" for k, r in enumerate("ab") for c in range(5, 200, 10)
    ))  # fmt: skip
    assert _sweep(sqlite_url, "import", str(path), "--sweep", "cols")[0] == 0
    from analysis.report.build import ReportOptions, build_report
    from analysis.report.render import fit_grid

    header, _ = fit_grid(build_report(Store(sqlite_url), "cols", ReportOptions(n_boot=0)))
    assert len(header) == len(set(header)) and {"axis:A", "axis:flags", "axis:n", "A", "flags", "n"} <= set(header)


def test_a_level_of_0999_is_captioned_999_percent(imported):
    code, out = _sweep(imported, "report", "ok", "--bootstrap", "20", "--level", "0.999")
    assert code == 0 and "99.9% bootstrap intervals" in out and "100%" not in out


# ---------------------------------------------------------------------------------------------
# The store


def test_read_verbs_never_create_a_store_and_a_directory_is_named(tmp_path):
    missing = tmp_path / "typo" / "sweeps.db"
    for verb in (["status"], ["report"], ["prune", "--simulate"], ["show", "abc"], ["logs", "abc"], ["cancel", "x"]):
        line = _one_error(*_sweep(f"sqlite:///{missing}", *verb))
        assert "no store at" in line
    assert not missing.parent.exists()
    folder = tmp_path / "adir"
    folder.mkdir()
    for verb in (["status"], ["import", str(_curve_csv(tmp_path / "x.csv")), "--sweep", "x"]):
        line = _one_error(*_sweep(f"sqlite:///{folder}", *verb))
        assert f"{folder} is a directory; give an SQLite file" in line


def test_show_of_an_empty_name_asks_for_a_run(sqlite_url):
    line = _one_error(*_sweep(sqlite_url, "show", ""))
    assert "give a run id" in line and "sweep name" not in line


# ---------------------------------------------------------------------------------------------
# Launch: what the job would refuse is refused first; nothing is registered


GRID = "name: g\nbudget: {steps: 2}\n"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["recipe.model.path=builtin:nope"], "model.path: unknown built-in model 'builtin:nope'; "),
        (["recipe.model.path=builtin:sort6-tyni"], "did you mean 'builtin:sort6-tiny'?"),
        (["recipe.model.path={empty_model}"], "its config.json names no model_type"),
        (["recipe.length.control=interrupt", "recipe.length.interrupt_min=3", "recipe.length.interrupt_max=5"],
         "length.interrupt_min: 3 with length.control=interrupt on sort6, which has no thinking phase to interrupt"),
        (["prune={{every: 1.0e-12}}"], "prune.every: invalid value 1e-12; expected a number in [0.001, 1]"),
        (["prune={{level: 0.4}}"], "prune.level: invalid value 0.4; expected a number in [0.5, 0.999]"),
        (["prune={{n_boot: 2.5}}"], "prune.n_boot: invalid value 2.5; expected an integer in [10, 10000]"),
        (["prune={{first_at: 0}}"], "prune.first_at: invalid value 0; expected a number in (0, 1]"),
    ],
)  # fmt: skip
def test_launch_refuses_what_the_job_would_refuse(sqlite_url, tmp_path, sweep_file, overrides, expected):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    grid = sweep_file(GRID)
    args = [o.format(empty_model=empty) for o in overrides]
    line = _one_error(*_sweep(sqlite_url, "launch", str(grid), *args, "--cluster", "local"))
    assert line.startswith(f"error: {grid}: ") and expected in line
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


def test_a_held_out_set_that_leaves_nothing_to_train_on_is_refused_at_launch(sqlite_url, tmp_path, sweep_file):
    pytest.importorskip("math_verify")
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    grid = sweep_file(GRID)
    args = ["recipe.data.task=math-jsonl", f"recipe.data.train={data}", f"recipe.data.valid={data}",
            "recipe.data.num_valid_prompts=4", f"recipe.model.path={tmp_path}"]  # fmt: skip
    line = _one_error(*_sweep(sqlite_url, "launch", str(grid), *args, "--cluster", "local"))
    assert "data.num_valid_prompts: 4 held-out rows leave none of the 4 rows" in line
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_run_directory_that_cannot_be_made_registers_nothing(sqlite_url, tmp_path, sweep_file, where):
    grid = sweep_file(GRID)
    code, out = _sweep(sqlite_url, "launch", str(grid), "--dry-run", "--json")
    run_id = json.loads(out)["runs"][0]["id"]
    root = tmp_path / "root" if where == "file" else Path("/proc")
    if where == "file":
        (root / "g").mkdir(parents=True)
        (root / "g" / run_id).write_text("in the way")
    line = _one_error(*_sweep(sqlite_url, "launch", str(grid), "--root", str(root), "--cluster", "local"))
    assert f"cannot write run {run_id}'s directory under {root / 'g'}" in line and "give another --root" in line
    assert Store(sqlite_url).list_sweeps() == []


def test_a_run_directory_with_another_stores_checkpoints_registers_nothing(sqlite_url, tmp_path, sweep_file):
    """The same sweep launched against a second store from the same root: its runs would resume the
    first store's final checkpoints and settle as completed with nothing recorded."""
    grid = sweep_file(GRID)
    code, out = _sweep(sqlite_url, "launch", str(grid), "--dry-run", "--json")
    run_id = json.loads(out)["runs"][0]["id"]
    root, other = tmp_path / "root", f"sqlite:///{tmp_path / 'first.db'}"
    run_dir = root / "g" / run_id
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "sweep": "g", "db_url": other}))
    (run_dir / "checkpoints" / "step_00000010.pt").write_bytes(b"")
    line = _one_error(*_sweep(sqlite_url, "launch", str(grid), "--root", str(root), "--cluster", "local"))
    assert f"run directory {run_dir} holds the checkpoints of run {run_id}" in line
    assert other in line and "its own --root" in line
    assert Store(sqlite_url).list_sweeps() == []
    assert json.loads((run_dir / "run.json").read_text())["db_url"] == other  # nothing rewritten


# ---------------------------------------------------------------------------------------------
# Reruns


def test_a_same_seed_rerun_is_a_reproduction_kept_out_of_the_fit(sqlite_url, tmp_path):
    """Bit-identical points counted twice would narrow the intervals for nothing: the rerun is
    listed as a rerun of its run, the fit and its intervals are those of the original alone."""
    from analysis.report.build import ReportOptions, build_report
    from store import NewRun, RunState

    store = Store(sqlite_url)
    compute = np.linspace(10, 300, 30)
    rng = np.random.default_rng(0)
    curves = {seed: 0.6 / (1 + (100 / compute) ** 1.5) + rng.normal(0, 0.01, compute.size) for seed in (0, 1)}
    runs = [("orig0", 0), ("orig1", 1), ("rerun0", 0)]
    store.register_sweep("s", {}, str(tmp_path), "local", [
        NewRun(rid, i, {"seed": seed, "optim": {"lr": 1}}, {"optim.lr": 1, "seed": seed}, {"steps": 30}, str(tmp_path / rid))
        for i, (rid, seed) in enumerate(runs)
    ])  # fmt: skip
    for rid, seed in runs:
        store.add_eval_points(rid, [
            dict(step=i, pass_rate=float(r), flops=0.0, tokens=0, device_seconds=0.0, gpu_hours=float(c), num_samples=16)
            for i, (c, r) in enumerate(zip(compute, curves[seed]))
        ])  # fmt: skip
        store.set_run_state(rid, RunState.COMPLETED)
    report = build_report(store, "s", ReportOptions(n_boot=50))
    (config,) = report.configs
    assert report.reruns == {"rerun0": "orig0"}
    assert [c.run for c in config.curves] == ["orig0", "orig1"] and config.seeds == [0, 1]
    assert config.fit.n_points == 60

    code, out = _sweep(sqlite_url, "show", "rerun0")
    assert code == 0 and "seed 0; a same-seed rerun of orig0 (kept out of the fits)" in out
    code, out = _sweep(sqlite_url, "report", "s", "--bootstrap", "0")
    assert code == 0 and "Same-seed reruns, reproductions kept out of the fits: rerun0 (a rerun of orig0)." in out


def test_a_rerun_of_an_imported_run_in_a_native_sweep_says_it_was_imported(sqlite_url, tmp_path):
    store = Store(sqlite_url)
    store.upsert_sweep("native", {}, str(tmp_path / "runs"), "local")
    assert _sweep(sqlite_url, "import", str(_curve_csv(tmp_path / "c.csv", configs=("1",), seeds=(0,))), "--sweep", "native")[0] == 0
    (run,) = store.runs("native")
    line = _one_error(*_sweep(sqlite_url, "rerun", run.id))
    assert f"run {run.id} of sweep native was imported from c.csv, not run" in line


def test_logs_follow_ends_when_the_run_has_ended(sqlite_url, tmp_path):
    from store import NewRun, RunState

    store = Store(sqlite_url)
    store.register_sweep("s", {}, str(tmp_path), "local", [NewRun("r1", 0, {}, {}, {"steps": 1}, str(tmp_path))])
    log = tmp_path / "err.log"
    log.write_text("step 1\n")
    store.add_attempt("r1", "local", stderr_path=str(log), stdout_path=str(log))
    store.set_run_state("r1", RunState.RUNNING)
    timer = threading.Timer(1.0, lambda: (log.write_text("step 1\ndone\n"), store.set_run_state("r1", RunState.COMPLETED)))
    timer.start()
    code, out = _sweep(sqlite_url, "logs", "r1", "--follow")
    timer.join()
    assert code == 0 and out == "step 1\ndone\n"


def test_a_stored_prune_policy_beyond_the_bounds_is_one_line_not_a_memory_error(sqlite_url, tmp_path):
    """A sweep registered before `prune.every` was bounded: status and prune name the block."""
    store = Store(sqlite_url)
    store.upsert_sweep("old", {"grid": {"prune": {"every": 1e-12}}}, str(tmp_path), "local")
    for verb in (["status", "old"], ["prune", "old", "--simulate"]):
        line = _one_error(*_sweep(sqlite_url, *verb))
        assert "prune: block {'every': 1e-12} is not a valid policy (prune.every must lie in [0.001, 1]" in line


def test_the_prediction_summary_says_when_every_configuration_reached_the_target_unpredicted():
    """All configurations reached --predict, none with a prediction to check (all withheld):
    not "no configuration has reached it yet"."""
    from types import SimpleNamespace

    from analysis.report.build import ReportOptions
    from analysis.report.render import prediction_summary

    withheld = SimpleNamespace(error=None, observed=0.5, withheld="unstable", task_ceiling=None)
    report = SimpleNamespace(
        configs=[SimpleNamespace(extrapolation=withheld)] * 3, compute="gpu_hours",
        options=ReportOptions(fit_until=0.5, predict_at=1.0, relative=True, n_boot=0),
    )  # fmt: skip
    text = prediction_summary(report)
    assert "3 of 3 configurations reached it, none with a prediction to check" in text and "yet" not in text
    assert "3 withheld" in text
