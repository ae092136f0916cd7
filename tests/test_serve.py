"""`sweep serve`'s data (analysis.serve.snapshot) without a browser: what the page gets after
points arrive, after a resume drops points, and how a big sweep is aggregated."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.serve.snapshot import ServeOptions, SweepView, _round_up
from analysis.synthetic import PAPER_TABLE1, noisy_curve
from launcher.cli import cli
from store import Store

COMPUTE = np.linspace(0, 12000, 25)


@pytest.fixture
def store(tmp_path, sqlite_url) -> Store:
    rng = np.random.default_rng(5)
    lines = ["run,compute,pass_rate,variant,seed"]
    for name in ("scalerl", "scout", "bs2048", "gen32k"):
        A, B, Cmid = PAPER_TABLE1[name]
        for seed in (0, 1):
            rates = noisy_curve(COMPUTE, A, B, Cmid, 0.3, rng=rng)
            lines += [f"{name}-{seed},{c:g},{r:.6f},{name},{seed}" for c, r in zip(COMPUTE, rates)]
    (tmp_path / "c.csv").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["--db", sqlite_url, "import", str(tmp_path / "c.csv"), "--sweep", "s"])
    assert result.exit_code == 0, result.output
    return Store(sqlite_url)


def _point(step: int, x: float, rate: float) -> dict:
    return {"step": step, "pass_rate": rate, "flops": 0.0, "tokens": 0, "device_seconds": 0.0, "gpu_hours": x, "num_samples": 1}


def _xs(data: dict, run_id: str) -> list[float]:
    return next(s["x"] for c in data["configs"] for s in c["seeds"] if s["run"] == run_id)


def test_new_and_dropped_points_reach_the_page_data(store):
    view = SweepView(store, "s", ServeOptions(n_boot=20))
    first = view.build()
    assert len(first["runs"]) == 8 and len(first["configs"]) == 4 and first["cloud"] is None
    assert first["predict_at"] == 20000  # the furthest compute reached (12,000), rounded up to 2 x 10^4
    run = store.runs("s")[3]
    store.add_eval_points(run.id, [_point(25, 13000.0, 0.61)])
    second = view.build()
    assert _xs(second, run.id)[-1] == 13000.0
    assert next(r for r in second["runs"] if r["id"] == run.id)["pass_rate"] == 0.61
    store.delete_eval_points_after(run.id, 10)  # a resume from step 10 drops what came after
    third = view.build()
    assert _xs(third, run.id) == pytest.approx(list(COMPUTE[:11]))
    others = [r.id for r in store.runs("s") if r.id != run.id]
    assert all(_xs(third, r) == _xs(first, r) for r in others)


def test_a_big_sweep_draws_the_best_curves_and_a_cloud_of_the_rest(store):
    run = store.runs("s")[0]
    store.add_eval_points(run.id, [_point(25, 12345.0, 0.5)])
    data = SweepView(store, "s", ServeOptions(n_boot=20, detail=2)).build()
    assert data["n_configs"] == 4 and len(data["configs"]) == 2
    assert [c["rank"] for c in data["configs"]] == [1, 2]
    assert all(c["band"] and c["extrapolation"] and c["p_best"] is not None for c in data["configs"])
    assert sum(c["p_best"] for c in data["configs"]) == pytest.approx(1.0)
    drawn = {s["run"] for c in data["configs"] for s in c["seeds"]}
    in_cloud = 8 - len(drawn)
    assert len(data["cloud"]["x"]) == in_cloud * len(COMPUTE) + (run.id not in drawn)
    if run.id not in drawn:
        assert 12345.0 in data["cloud"]["x"]


def test_the_target_rounds_up_to_1_2_5():
    assert [_round_up(v) for v in (0.7, 1.0, 1.2, 3.0, 12000.0, 50001.0)] == [1.0, 1.0, 2.0, 5.0, 20000.0, 100000.0]
