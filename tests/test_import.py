"""`sweep import`: CSV and JSONL curves into the store, fitted and ranked like native runs; bad rows
are named by line and write nothing; importing again changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.synthetic import PAPER_TABLE1, noisy_curve
from launcher.cli import cli
from launcher.importer import run_id
from store import NewRun, Store

COMPUTE = np.linspace(0, 16000, 41)


def _sweep(db: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--db", db, *args], terminal_width=300)
    return result.exit_code, result.output


def _curve(name: str, seed: int) -> np.ndarray:
    A, B, Cmid = PAPER_TABLE1[name]
    return noisy_curve(COMPUTE, A, B, Cmid, 0.3, rng=np.random.default_rng(100 + seed))


def _csv(path: Path, variants=("scalerl", "scout"), seeds=(0, 1)) -> Path:
    """A W&B-style export: no step column, labels `variant` and `seed`."""
    lines = ["run,compute,pass_rate,variant,seed"]
    for name in variants:
        for seed in seeds:
            lines += [f"{name}-s{seed},{c:g},{r:.6f},{name},{seed}" for c, r in zip(COMPUTE, _curve(name, seed))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _snapshot(db: str) -> dict:
    """Everything an import writes: sweeps, runs, their points and attempts."""
    store = Store(db)
    try:
        sweeps = {s.name: (s.spec, s.executor) for s in store.list_sweeps()}
        runs = {
            r.id: (r.axes, r.state, store.eval_points(r.id), [(a.executor, a.state) for a in store.attempts(r.id)])
            for name in sweeps
            for r in store.runs(name)
        }
        return {"sweeps": sweeps, "runs": runs}
    finally:
        store.close()


def _report(db: str, *args: str) -> dict:
    code, out = _sweep(db, "report", "imported", "--format", "json", "--bootstrap", "0", *args)
    assert code == 0, out
    return json.loads(out)


# ---------------------------------------------------------------------------------------------
# round trips


def test_csv_round_trip_pools_seeds_into_configurations(db_url, tmp_path):
    code, out = _sweep(db_url, "import", str(_csv(tmp_path / "curves.csv")), "--sweep", "imported")
    assert code == 0, out
    assert "imported 4 runs (4 new) and 164 points into new sweep imported" in out
    report = _report(db_url)
    assert [r["label"] for r in report["runs"]] == ["variant=scout", "variant=scalerl"]
    for run in report["runs"]:
        name = run["axes"]["variant"]
        assert run["axes"] == {"variant": name} and run["seeds"] == [0, 1]
        assert run["run_ids"] == [run_id("imported", f"{name}-s{seed}") for seed in (0, 1)]
        assert run["states"] == ["completed", "completed"] and run["n_points"] == 82
        assert run["A"] == pytest.approx(PAPER_TABLE1[name][0], abs=0.02)
    store = Store(db_url)
    points = store.eval_points(run_id("imported", "scout-s1"))
    assert [p.step for p in points] == list(range(41))  # no step column: the row's order in its run
    assert [p.gpu_hours for p in points] == pytest.approx(COMPUTE)
    assert {(p.flops, p.tokens, p.device_seconds) for p in points} == {(0.0, 0, 0.0)}
    (attempt,) = store.attempts(run_id("imported", "scout-s1"))
    assert (attempt.executor, attempt.state) == ("import", "completed")
    assert store.get_sweep("imported").executor == "import"


def test_jsonl_round_trip_without_labels_names_each_run(sqlite_url, tmp_path):
    rows = []
    for name in ("scalerl", "bs2048"):
        for step, (c, r) in enumerate(zip(COMPUTE * 1e15, _curve(name, 0))):
            rows.append({"run": name, "step": step * 10, "compute": c, "pass_rate": float(r)})
    rows[3]["pass_rate"] = str(rows[3]["pass_rate"])  # exports sometimes quote numbers
    path = tmp_path / "curves.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in reversed(rows)) + "\n\n")
    code, out = _sweep(sqlite_url, "import", str(path), "--sweep", "imported", "--compute-axis", "flops")
    assert code == 0, out
    assert "imported 2 runs (2 new) and 82 points" in out and "sweep report imported --compute flops" in out
    report = _report(sqlite_url, "--compute", "flops")
    assert report["compute_axis"] == "flops"
    assert {r["label"]: r["axes"] for r in report["runs"]} == {
        "run=scalerl": {"run": "scalerl"}, "run=bs2048": {"run": "bs2048"}
    }  # fmt: skip
    points = Store(sqlite_url).eval_points(run_id("imported", "scalerl"))
    assert [p.step for p in points] == list(range(0, 410, 10))
    assert [p.flops for p in points] == pytest.approx(COMPUTE * 1e15) and {p.gpu_hours for p in points} == {0.0}


def test_imported_runs_rank_beside_native_runs_without_touching_the_sweep(sqlite_url, tmp_path):
    store = Store(sqlite_url)
    store.upsert_sweep("imported", {"name": "native"}, "/runs", "local")
    store.register_runs("imported", [NewRun("native-1", 0, {}, {"variant": "native"}, {}, "/runs/native-1")])
    store.add_eval_points("native-1", [
        dict(step=i, pass_rate=float(r), flops=0.0, tokens=0, device_seconds=0.0, gpu_hours=float(c), num_samples=16)
        for i, (c, r) in enumerate(zip(COMPUTE, _curve("bs2048", 0)))
    ])  # fmt: skip
    code, out = _sweep(sqlite_url, "import", str(_csv(tmp_path / "c.csv", seeds=(0,))), "--sweep", "imported")
    assert code == 0 and "into sweep imported" in out, out
    assert _snapshot(sqlite_url)["sweeps"] == {"imported": ({"name": "native"}, "local")}
    ranks = {r["axes"]["variant"]: r["rank"] for r in _report(sqlite_url)["runs"]}
    assert set(ranks) == {"native", "scout", "scalerl"} and sorted(ranks.values()) == [1, 2, 3]


def test_importing_again_changes_nothing(db_url, tmp_path):
    path = _csv(tmp_path / "curves.csv")
    assert _sweep(db_url, "import", str(path), "--sweep", "imported")[0] == 0
    before = _snapshot(db_url)
    code, out = _sweep(db_url, "import", str(path), "--sweep", "imported")
    assert code == 0 and "imported 4 runs (0 new) and 164 points into sweep imported" in out, out
    assert _snapshot(db_url) == before


def test_a_run_imported_before_cannot_change_its_labels(sqlite_url, tmp_path):
    path = _csv(tmp_path / "curves.csv")
    assert _sweep(sqlite_url, "import", str(path), "--sweep", "imported")[0] == 0
    before = _snapshot(sqlite_url)
    path.write_text(path.read_text().replace(",scout,", ",scout-v2,"))
    code, out = _sweep(sqlite_url, "import", str(path), "--sweep", "imported")
    assert code == 1
    assert (
        f"{path}:84: run 'scout-s0' was imported into 'imported' before with labels {{'variant': 'scout', "
        "'seed': 0}, now {'variant': 'scout-v2', 'seed': 0}; import it into a new sweep or under a new name"
    ) in out
    assert _snapshot(sqlite_url) == before


# ---------------------------------------------------------------------------------------------
# bad rows: named by line, nothing written

GOOD_CSV = "run,compute,pass_rate,step,lr\na,0,0.3,0,0.001\na,100,0.4,1,0.001\nb,0,0.3,0,0.002\nb,100,0.5,1,0.002\n"


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("missing column", "run,compute,step\na,0,0\n", "1: missing column 'pass_rate' (the header has: run, compute, step)"),
        ("missing value", GOOD_CSV + "c,,0.3,0,0.1\n", "6: missing 'compute'"),
        ("field count", GOOD_CSV + "c,5,0.3\n", "6: 3 fields, but the header has 5"),
        ("non-numeric", GOOD_CSV.replace("a,100,0.4", "a,100,high"), "3: pass_rate 'high' is not a number"),
        ("not finite", GOOD_CSV.replace("a,100,0.4", "a,inf,0.4"), "3: compute 'inf' is not a finite number"),
        ("pass rate > 1", GOOD_CSV.replace("b,100,0.5", "b,100,1.5"), "5: pass_rate '1.5' is outside [0, 1]"),
        ("negative compute", GOOD_CSV.replace("b,0,0.3", "b,-3,0.3"), "4: compute '-3' is negative"),
        ("bad step", GOOD_CSV.replace("b,100,0.5,1", "b,100,0.5,1.5"), "5: step '1.5' is not an integer in [0, 2147483647]"),
        ("huge step", GOOD_CSV.replace("b,100,0.5,1", "b,100,0.5,1e30"), "5: step '1e30' is not an integer in [0, 2147483647]"),
        ("nan label", GOOD_CSV.replace("b,100,0.5,1,0.002", "b,100,0.5,1,nan").replace("b,0,0.3,0,0.002", "b,0,0.3,0,nan"),
         "4: label 'lr' is 'nan', not a finite number\n{path}:5: label 'lr' is 'nan', not a finite number"),
        ("huge seed", "run,compute,pass_rate,seed\na,0,0.3,1e23\n", "2: seed '1e23' is not an integer in [0, 4294967295]"),
        ("duplicate step", GOOD_CSV.replace("b,100,0.5,1", "b,100,0.5,0"), "5: run 'b' has step 0 twice (also on line 4)"),
        (
            "label varies",
            GOOD_CSV.replace("a,100,0.4,1,0.001", "a,100,0.4,1,0.01"),
            "3: label 'lr' of run 'a' is 0.01 here but 0.001 on line 2; labels must be constant within a run "
            "(drop a column that is a metric)",
        ),
        (
            "steps on some rows",
            GOOD_CSV.replace("b,100,0.5,1", "b,100,0.5,"),
            "5: no step, but run 'b' gives steps on other rows (line 4); give steps on all of a run's rows or on none",
        ),
        ("seed not an integer", "run,compute,pass_rate,seed\na,0,0.3,x\n", "2: seed 'x' is not a number"),
    ],
)  # fmt: skip
def test_a_bad_csv_row_is_named_by_line_and_nothing_is_written(sqlite_url, tmp_path, name, text, error):
    assert _sweep(sqlite_url, "import", str(_csv(tmp_path / "good.csv")), "--sweep", "imported")[0] == 0
    before = _snapshot(sqlite_url)
    path = tmp_path / "bad.csv"
    path.write_text(text)
    for sweep in ("imported", "fresh"):
        code, out = _sweep(sqlite_url, "import", str(path), "--sweep", sweep)
        assert code == 1, out
        errors = f"{path}:{error}".format(path=path).splitlines()
        one = [f"error: {errors[0]} (nothing was written)"]  # one bad row: one line
        assert out.splitlines() == (one if len(errors) == 1 else [f"error: cannot import {path}; nothing was written:", *errors])
        assert _snapshot(sqlite_url) == before


@pytest.mark.parametrize(
    "bad",
    [
        GOOD_CSV.replace("b,100,0.5,1", "b,100,0.5,1e30"),
        GOOD_CSV.replace("b,100,0.5,1,0.002", "b,100,0.5,1,nan").replace("b,0,0.3,0,0.002", "b,0,0.3,0,nan"),
        "run,compute,pass_rate,lr\na,0,0.3,inf\n",
    ],
)
def test_a_refused_import_leaves_no_sweep_on_either_database(db_url, tmp_path, bad):
    path = tmp_path / "bad.csv"
    path.write_text(bad)
    code, out = _sweep(db_url, "import", str(path), "--sweep", "fresh")
    assert code == 1 and "nothing was written" in out and "Traceback" not in out, out
    from store import Store

    assert [s.name for s in Store(db_url).list_sweeps()] == []


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"run": "a", "compute": 5}', "missing 'pass_rate'"),
        ('{"run": "a", "compute": true, "pass_rate": 0.5}', "compute True is not a number"),
        ('{"run": "a", "compute": 5, "pass_rate": 0.5', "not valid JSON (Expecting ',' delimiter, column 44)"),
        ('[1, 2]', "expected a JSON object, got list"),
        ('{"run": "a", "compute": 5, "pass_rate": 0.5, "tags": ["x"]}', "label 'tags' is a list; labels are single values"),
    ],
)  # fmt: skip
def test_a_bad_jsonl_row_is_named_by_line(sqlite_url, tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"run": "a", "compute": 0, "pass_rate": 0.3}\n\n' + line + "\n")
    code, out = _sweep(sqlite_url, "import", str(path), "--sweep", "fresh")
    assert code == 1 and f"{path}:3: {error}" in out, out
    assert _snapshot(sqlite_url)["sweeps"] == {}


def test_every_bad_row_is_listed_in_file_order_up_to_twenty(sqlite_url, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("run,compute,pass_rate\n" + "".join(f"a,{i},{2 + i}\n" for i in range(25)))
    code, out = _sweep(sqlite_url, "import", str(path), "--sweep", "fresh")
    lines = out.splitlines()
    assert code == 1 and len(lines) == 22 and lines[-1] == "... and 5 more"
    assert lines[1] == f"{path}:2: pass_rate '2' is outside [0, 1]" and lines[20].startswith(f"{path}:21: ")


def test_the_format_comes_from_the_extension_or_the_option(sqlite_url, tmp_path):
    path = tmp_path / "curves.txt"
    path.write_text(_csv(tmp_path / "c.csv").read_text())
    code, out = _sweep(sqlite_url, "import", str(path), "--sweep", "imported")
    assert code == 1 and "cannot tell the format of" in out and "give --format csv|jsonl" in out
    code, out = _sweep(sqlite_url, "import", str(path), "--sweep", "imported", "--format", "csv")
    assert code == 0 and "imported 4 runs" in out


def test_a_bad_sweep_name_is_refused(sqlite_url, tmp_path):
    code, out = _sweep(sqlite_url, "import", str(_csv(tmp_path / "c.csv")), "--sweep", "-x")
    assert code == 1 and "invalid sweep name '-x'" in out
