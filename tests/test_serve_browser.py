"""`sweep serve` in a real headless browser (Debian's chromium, driven by Playwright; see
tests/test_report_html_browser.py): the real CLI serves a sweep imported into SQLite, the page
loads with no console error and no outside request, shows every run and each configuration's
fitted sigmoid, a point written to the store reaches the chart without a reload, a run's page
shows its train metrics, and off the loopback address the token is checked on every request.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from analysis.synthetic import PAPER_TABLE1, noisy_curve
from launcher.cli import cli
from store import Store
from test_report_html_browser import browser  # noqa: F401  (the chromium fixture)

ROOT = Path(__file__).resolve().parents[1]
COMPUTE = np.linspace(0, 16000, 41)
CONFIGS = (("scalerl", (0, 1)), ("scout", (0,)), ("bs2048", (0,)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`sweep serve` as a user starts it, in a subprocess; `url` is what it printed."""

    def __init__(self, db: str, *args: str, env: dict[str, str] | None = None):
        self.port = _free_port()
        command = [sys.executable, "-m", "launcher.cli", "--db", db, "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"at (http://\S+)", line)
        assert found, f"unexpected start line: {line!r}"
        self.url = found.group(1)
        self.base = f"http://127.0.0.1:{self.port}"
        self.origin = "/".join(self.url.split("/")[:3])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"sweep serve did not listen on {self.port}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture
def imported(tmp_path: Path, sqlite_url: str) -> str:
    """Three configurations, one with two seeds (four runs), imported into a fresh SQLite store."""
    rng = np.random.default_rng(11)
    lines = ["run,compute,pass_rate,variant,seed"]
    for name, seeds in CONFIGS:
        A, B, Cmid = PAPER_TABLE1[name]
        for seed in seeds:
            rates = noisy_curve(COMPUTE, A, B, Cmid, 0.3, rng=rng)
            lines += [f"{name}-{seed},{c:g},{r:.6f},{name},{seed}" for c, r in zip(COMPUTE, rates)]
    (tmp_path / "curves.csv").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["--db", sqlite_url, "import", str(tmp_path / "curves.csv"), "--sweep", "paper"])
    assert result.exit_code == 0, result.output
    return sqlite_url


@pytest.fixture
def server(imported: str) -> Iterator[Server]:
    srv = Server(imported, "paper", "--predict", "20000")
    yield srv
    srv.close()


def _watch(page) -> tuple[list[str], list[str]]:  # type: ignore[no-untyped-def]
    problems: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url[:80]} ({r.failure})"))
    page.on("request", lambda r: requests.append(r.url))
    return problems, requests


FIT_TRACES = "() => document.getElementById('curves').data.filter(t => t.meta === 'fit').map(t => t.name)"


def test_the_page_shows_every_run_and_each_fit(browser, server, imported):  # noqa: F811
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems, requests = _watch(page)
    page.goto(server.url, wait_until="load")
    page.wait_for_selector("#runs tbody tr")
    runs = Store(imported).runs("paper")
    rows = page.locator("#runs tbody tr")
    assert rows.count() == len(runs) == 4
    assert {rows.nth(i).get_attribute("data-run") for i in range(4)} == {r.id for r in runs}
    page.wait_for_function("() => document.getElementById('curves').data !== undefined")
    fits = page.evaluate(FIT_TRACES)
    assert sorted(name.split(":")[0] for name in fits) == sorted(f"variant={n}" for n, _ in CONFIGS)
    extrapolated = page.evaluate("() => document.getElementById('curves').data.filter(t => t.meta === 'extrapolation').length")
    assert extrapolated == 3, "each configuration is extrapolated to --predict 20000"
    assert page.locator("#curves .main-svg").first.is_visible()
    # sorting by pass rate puts the highest last pass rate first on the second click
    page.locator("th[data-key=pass_rate]").click()
    page.locator("th[data-key=pass_rate]").click()
    first = page.locator("#runs tbody tr").first.get_attribute("data-run")
    last = Store(imported).last_eval_points("paper")
    assert first == max(last, key=lambda run_id: last[run_id].pass_rate)
    page.locator("#apart").check()
    assert page.evaluate("() => document.getElementById('curves').data.filter(t => t.type === 'scattergl').length") == 4
    assert problems == []
    assert all(url.startswith(server.origin) or url.startswith(("data:", "blob:")) for url in requests), requests


def test_a_new_point_reaches_the_chart_without_a_reload(browser, server, imported):  # noqa: F811
    page = browser.new_page()
    problems, _ = _watch(page)
    page.goto(server.url, wait_until="load")
    page.wait_for_function("() => document.getElementById('curves').data !== undefined")
    page.evaluate("() => { window.notReloaded = true; }")
    store = Store(imported)
    run = next(r for r in store.runs("paper") if r.axes["variant"] == "scout")
    new_x = 17123.0
    point = {"step": 41, "pass_rate": 0.5, "flops": 0.0, "tokens": 0, "device_seconds": 0.0, "gpu_hours": new_x, "num_samples": 1}
    store.add_eval_points(run.id, [point])
    page.wait_for_function(
        f"() => document.getElementById('curves').data.some(t => t.type === 'scattergl' && t.x.includes({new_x}))", timeout=15000
    )
    assert page.evaluate("() => window.notReloaded === true")
    row = page.locator(f"#runs tbody tr[data-run='{run.id}']")
    assert "0.5" in row.inner_text()
    assert problems == []


def test_a_runs_page_shows_its_train_metrics(browser, server, imported):  # noqa: F811
    store = Store(imported)
    run = store.runs("paper")[0]
    store.add_train_metrics(run.id, [(s, {"entropy": 1.0 / (s + 1), "clip_fraction": 0.01 * s}) for s in range(1, 30)])
    page = browser.new_page()
    problems, _ = _watch(page)
    page.goto(f"{server.base}/run/{run.id}", wait_until="load")
    page.wait_for_selector("#metrics .metric .main-svg")
    assert page.locator("#metrics .metric").count() == 2
    assert page.evaluate("() => document.getElementById('m-entropy').data[0].x.length") == 29
    assert page.locator("#attempts tr").count() == 2  # header + the import's attempt
    assert problems == []


def test_off_loopback_the_token_is_required(browser, imported):  # noqa: F811
    srv = Server(imported, "paper", "--host", "0.0.0.0")
    try:
        token = re.search(r"token=([\w-]+)", srv.url)
        assert token, f"no token printed: {srv.url}"
        for path in ("/", "/api/sweep", "/static/plotly.min.js", "/api/version?token=wrong" + token.group(1)[:4]):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(srv.base + path, timeout=10)
            assert refused.value.code == 403, path
        page = browser.new_page()
        problems, _ = _watch(page)
        page.goto(f"{srv.base}/?token={token.group(1)}", wait_until="load")
        page.wait_for_selector("#runs tbody tr")  # the data calls carry the cookie the first request set
        assert page.locator("#runs tbody tr").count() == 4
        assert problems == []
    finally:
        srv.close()


def test_serve_on_loopback_needs_no_token(imported):
    srv = Server(imported, "paper")
    try:
        assert "token" not in srv.url
        with urllib.request.urlopen(srv.base + "/api/version", timeout=10) as response:
            assert response.status == 200
    finally:
        srv.close()


def test_serve_names_a_missing_sweep(imported):
    result = CliRunner().invoke(cli, ["--db", imported, "serve", "nosuch"])
    assert result.exit_code == 1
    assert "no sweep named 'nosuch'" in result.output and "paper" in result.output


SCREENSHOT = ROOT / "docs" / "figures" / "serve-quickstart.png"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_quickstart_page_shows_four_fitted_curves(browser, sqlite_url, tmp_path):  # noqa: F811
    """README command 1, then `sweep serve quickstart`: the four runs' curves with their fitted
    sigmoids. SWEEP_WRITE_FIGURES=1 keeps the screenshot as docs/figures/serve-quickstart.png.
    $SWEEP_QUICKSTART_DB names a store where command 1 already ran: launching again is then a
    no-op (it registers and submits nothing), and the test takes seconds instead of ~3 minutes
    (much more on a loaded machine)."""
    sqlite_url = os.environ.get("SWEEP_QUICKSTART_DB") or sqlite_url
    code = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--db", sqlite_url, "launch", "sweeps/quickstart.yaml", "--cluster", "local", "--wait"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert code.returncode == 0, code.stdout[-3000:] + code.stderr[-3000:]
    srv = Server(sqlite_url, "quickstart")
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        problems, _ = _watch(page)
        page.goto(srv.url, wait_until="load")
        page.wait_for_selector("#runs tbody tr")
        assert page.locator("#runs tbody tr").count() == 4
        page.wait_for_function("() => document.getElementById('curves').data !== undefined")
        fits = page.evaluate(FIT_TRACES)
        assert len(fits) == 4, fits
        assert {f.split(":")[0] for f in fits} == {
            f"length.max_new_tokens={n}, optim.warmup_steps={w}" for n in (9, 13) for w in (20, 80)
        }
        assert problems == []
        shot = tmp_path / "serve-quickstart.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("SWEEP_WRITE_FIGURES") == "1":
            SCREENSHOT.write_bytes(shot.read_bytes())
    finally:
        srv.close()


def test_the_backtest_section_replays_the_fits_and_shows_each_cut(browser, server, imported):  # noqa: F811
    """Opening "Backtest" fetches /api/backtest (fits replayed at every cut of the finished sweep)
    and draws it: one table row per cut whose counts are what analysis.backtest computes."""
    from analysis.backtest import DEFAULT_CUTS
    from analysis.report.backtest import sweep_backtest
    from analysis.serve.app import BACKTEST

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems, _ = _watch(page)
    page.goto(server.url, wait_until="load")
    page.wait_for_selector("#runs tbody tr")
    assert page.locator("#backtesttable tbody tr").count() == 0  # nothing is replayed until asked
    page.locator("#backtestbox summary").click()
    page.wait_for_function("() => document.body.dataset.backtest && document.body.dataset.backtest !== 'error'", timeout=60_000)
    rows = page.locator("#backtesttable tbody tr")
    assert rows.count() == len(DEFAULT_CUTS)
    _, expected = sweep_backtest(Store(imported), "paper", BACKTEST)
    for i, cut in enumerate(expected.cuts):
        cells = [rows.nth(i).locator("td").nth(k).inner_text() for k in range(3)]
        assert cells == [f"{round(100 * cut.fraction)}%", f"{cut.n_predicted}/{cut.n}",
                         f"{cut.n_within}/{cut.n} ({round(100 * cut.share_within)}%)"]  # fmt: skip
    plotted = page.evaluate("() => document.getElementById('backtest').data.map(t => t.meta)")
    assert plotted == ["share_within", "tau", "tau_separated", "coverage", "median_abs_error"]
    assert "of compute" in page.locator("#backtest-status").inner_text()
    assert problems == []


def test_the_backtest_api_says_why_when_nothing_has_finished(tmp_path, sqlite_url):
    """A sweep with no completed configuration: the endpoint answers with the reason, not a 500."""
    import json

    from analysis.serve.app import Live, create_app
    from analysis.serve.snapshot import ServeOptions
    from starlette.testclient import TestClient
    from store import NewRun

    store = Store(sqlite_url)
    store.upsert_sweep("pending", {"name": "pending"}, str(tmp_path), "local")
    store.register_runs("pending", [NewRun("pending-0", 0, {}, {"lr": 1}, {"steps": 10}, str(tmp_path / "r"))])
    live = Live(store, ["pending"], ServeOptions())
    body = json.loads(TestClient(create_app(live)).get("/api/backtest/pending").content)
    assert "no completed configuration" in body["error"]
