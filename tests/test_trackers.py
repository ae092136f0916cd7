"""The `tracking:` block: a real run (local executor, the tiny CPU model) mirrored to W&B in offline
mode and to TensorBoard, then extended by a second attempt that resumes from its checkpoint.

The W&B side is read back from the offline run files (RUN_DIR/wandb/offline-run-*/run-ID.wandb)
with wandb's own record schema (wandb.proto.wandb_internal_pb2.Record): wandb 0.31 ships no
Python reader of those files any more, so the test undoes their framing (LevelDB's log format,
the one `wandb sync` reads) and decodes every record with wandb's protobuf. TensorBoard's side is
read with TensorBoard's own EventAccumulator.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path

import pytest

from launcher.cli import cli
from recipe.telemetry.trackers import Mirror, mirrored
from recipe.telemetry.sinks import MemorySink
from store import Store
from test_cli_local import TINY, sweep

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

TRACKED = TINY.replace("loss.type: [cispo, grpo]", "loss.type: [cispo]") + "tracking: {wandb: {mode: offline, project: tiny-test}, tensorboard: true}\n"


def wandb_records(path: Path) -> list:  # type: ignore[type-arg]
    """Every record of a W&B transaction log (.wandb): a 7-byte header (':W&B', magic 0xBEE1,
    version 0), then LevelDB log framing (32 KiB blocks of chunks: crc32 4, length 2, type 1)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind in (3, 4):  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
        if kind == 0 and length == 0:
            break
    return records


def wandb_history(run_file: Path) -> tuple[str, list[dict[str, float]], dict]:  # type: ignore[type-arg]
    """(the W&B run id, every logged row, the config) of one offline attempt."""
    run_id, rows, config = "", [], {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    return run_id, rows, config


@pytest.mark.slow
def test_a_tracked_run_mirrors_to_wandb_offline_and_tensorboard_across_two_attempts(sweep_file, sqlite_url):
    grid = str(sweep_file(TRACKED))
    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--wait")
    assert code == 0, out
    code, out = sweep(sqlite_url, "launch", grid, "budget.steps=40", "--cluster", "local", "--wait")
    assert code == 0, out
    store = Store(sqlite_url)
    (run,) = store.runs("tiny")
    assert (run.state, run.step) == ("completed", 40)
    attempts = store.attempts(run.id)
    assert len(attempts) == 2 and attempts[1].resumed_from_step == 30

    # W&B: two offline attempts of one W&B run (id = the run id), grouped by sweep
    run_dir = Path(run.run_dir)
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    (first_id, first, config), (second_id, second, _) = (wandb_history(f) for f in files)
    assert first_id == second_id == run.id
    assert config["axes"] == run.axes and config["loss"]["type"] == "cispo"
    train_steps = [r["step"] for r in first + second if "train/loss" in r or "train/entropy" in r]
    assert sorted(set(train_steps)) == list(range(1, 41)), train_steps
    stored = dict(store.train_metrics(run.id))
    name = next(k for k in ("entropy", "loss") if k in stored[1])
    mirrored_values = {r["step"]: r[f"train/{name}"] for r in first + second if f"train/{name}" in r}
    assert all(mirrored_values[s] == pytest.approx(stored[s][name]) for s in (1, 30, 31, 40))
    evals = {r["step"]: r["eval/pass_rate"] for r in first + second if "eval/pass_rate" in r}
    assert evals == {p.step: pytest.approx(p.pass_rate) for p in store.eval_points(run.id)}
    assert all("eval/flops" in r for r in first + second if "eval/pass_rate" in r)
    assert min(r["step"] for r in second if "step" in r) >= 30, "the second attempt reports from its checkpoint on"

    # TensorBoard: the same metrics and eval points in the run directory's event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "eval/pass_rate" in tags and f"train/{name}" in tags
    pass_rates = {e.step: e.value for e in events.Scalars("eval/pass_rate")}
    assert pass_rates == {p.step: pytest.approx(p.pass_rate, abs=1e-6) for p in store.eval_points(run.id)}
    assert [e.step for e in events.Scalars(f"train/{name}")] == list(range(1, 41))

    # the report links the run's tracker entries
    code, out = sweep(sqlite_url, "report", "tiny", "--format", "html", "--bootstrap", "0")
    assert code == 0, out
    assert (run_dir / "tensorboard").as_uri() in out and (run_dir / "wandb").as_uri() in out


class Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, step: int, values: dict[str, float]) -> None:
        self.calls += 1
        raise OSError("no network")


def test_a_failing_tracker_is_logged_once_and_training_goes_on(caplog):
    inner, broken = MemorySink(), Broken()
    sink = Mirror(inner, [broken])  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING, logger="recipe"):
        for step in range(1, 4):
            sink.train_metrics(step, {"loss": 0.1})
        sink.eval_point({"step": 3, "pass_rate": 0.5, "metrics": {}})
        assert sink.flush()  # the trackers' thread has taken everything
    assert sorted(inner.metrics) == [1, 2, 3] and 3 in inner.eval_points  # the store side got everything
    assert broken.calls == 1
    assert [r.getMessage() for r in caplog.records] == ["broken mirror failed (OSError: no network); training goes on without it"]


def test_an_unknown_tracking_key_names_the_file_and_the_closest_key(sweep_file, sqlite_url):
    grid = str(sweep_file(TINY + "tracking: {wandb: {mode: offline}, tensorbord: true}\n"))
    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--dry-run")
    assert code == 2
    assert "grid.yaml: tracking.tensorbord: unknown key (did you mean 'tensorboard'?)" in " ".join(out.split())
    grid = str(sweep_file(TINY + "tracking: {wandb: {mode: ofline}}\n"))
    code, out = sweep(sqlite_url, "launch", grid, "--cluster", "local", "--dry-run")
    assert code == 2 and "tracking.wandb.mode: invalid value 'ofline'; allowed: online, offline" in " ".join(out.split())
    assert Store(sqlite_url).list_sweeps() == []


def test_no_tracking_block_leaves_the_sink_alone(tmp_path):
    inner = MemorySink()
    assert mirrored(inner, None, sweep="s", run_id="r", run_dir=tmp_path, config={}, axes={}) is inner


def test_online_wandb_without_a_network_falls_back_to_offline(tmp_path, monkeypatch, caplog):
    """A compute node without network: the online run cannot start, the mirror logs offline."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "20")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    inner = MemorySink()
    with caplog.at_level(logging.WARNING, logger="recipe"):
        sink = mirrored(inner, {"wandb": {"project": "p"}}, sweep="s", run_id="abc123", run_dir=tmp_path, config={}, axes={})
        assert isinstance(sink, Mirror) and len(sink.trackers) == 1
        sink.train_metrics(1, {"loss": 0.5})
        sink.close()
    assert inner.metrics == {1: {"loss": 0.5}}
    assert any("logging offline for a later `wandb sync`" in r.getMessage() for r in caplog.records)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-abc123.wandb")
    deadline = time.monotonic() + 30
    while not (rows := wandb_history(run_file)[1]) and time.monotonic() < deadline:
        time.sleep(0.5)  # W&B's service writes the file on its own after finish() returns
    run_id, rows, _ = wandb_history(run_file)
    assert run_id == "abc123" and rows[-1]["train/loss"] == 0.5
