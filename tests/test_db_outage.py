"""The database goes away while a job trains: the job buffers its reports in the run directory,
keeps training, and replays them when the database is back. Nothing lost, nothing duplicated.

The outage is real: the job reaches PostgreSQL through a TCP relay that the test cuts (open
connections dropped, new ones refused) and restores."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import make_url

from launcher.cli import cli
from recipe.config import RecipeConfig
from recipe.pipeline.rendezvous import free_port
from store import Store

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


class Relay:
    """Forwards 127.0.0.1:<port> to the PostgreSQL server until cut."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        self._listener.close()
        self._listener = None
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
            self._conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


def test_job_survives_a_database_outage(pg_url, sweep_file, monkeypatch):
    relay = Relay(make_url(pg_url).port or 5432)
    relayed = make_url(pg_url).set(port=relay.port).render_as_string(hide_password=False)
    grid = sweep_file(
        "name: outage\nrecipe:\n  batch: {prompts: 4, generations: 4}\n  optim: {lr: 3.0e-4, warmup_steps: 0}\n"
        "  eval: {every: 20, samples: 2}\n  data: {num_valid_prompts: 32}\n  checkpoint: {every: 50}\nbudget: {steps: 900}\n"
    )
    result = CliRunner().invoke(cli, ["--db", relayed, "launch", str(grid), "--cluster", "local"])
    assert result.exit_code == 0, result.output
    direct = Store(pg_url)  # the test itself reads around the relay
    (run,) = direct.runs("outage")

    deadline = time.monotonic() + 120
    while direct.get_run(run.id).step < 60:
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.5)
    relay.cut()
    spool = Path(run.run_dir) / "spool.jsonl"
    deadline = time.monotonic() + 120
    while not spool.exists() or spool.read_text().count('"eval_point"') < 3:
        assert time.monotonic() < deadline, "the job did not buffer its eval points"
        time.sleep(0.5)
    step_during_outage = direct.get_run(run.id).step
    relay.restore()

    deadline = time.monotonic() + 240
    while direct.get_run(run.id).state != "completed":
        assert direct.get_run(run.id).state in ("queued", "running"), direct.get_run(run.id)
        assert time.monotonic() < deadline, "the run did not complete after the database came back"
        time.sleep(1)
    assert not spool.exists()
    cfg = RecipeConfig.from_dict(run.config)
    from recipe.loop.train import is_eval_step

    expected = [s for s in range(cfg.budget.steps + 1) if is_eval_step(s, cfg)]
    assert [p.step for p in direct.eval_points(run.id)] == expected
    assert direct.attempts(run.id)[-1].state == "completed" and len(direct.attempts(run.id)) == 1
    assert step_during_outage < cfg.budget.steps
    log = Path(direct.attempts(run.id)[-1].stdout_path).read_text()
    assert "database unreachable" in log and "replayed" in log
