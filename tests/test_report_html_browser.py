"""The HTML report in a real headless browser (Debian's chromium, driven by Playwright): it loads
with no console error and no failed or outside request, its table and every plot are visible and
decoded, and its screenshot is not blank.

Playwright drives the system's /usr/bin/chromium (`apt-get install chromium`); its own browser
download (`playwright install`) is never used. Without chromium or Playwright the test skips,
unless SWEEP_REQUIRE_SERVICES=1 (CI), where it fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from analysis.synthetic import PAPER_TABLE1, noisy_curve
from launcher.cli import cli

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync",
]  # fmt: skip
COMPUTE = np.linspace(0, 16000, 41)


@pytest.fixture
def browser():
    from conftest import _unavailable

    if not CHROMIUM.exists():
        _unavailable("chromium", f"{CHROMIUM} not found (apt-get install -y --no-install-recommends chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _unavailable("Playwright for Python", f"{exc} (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def report_page(tmp_path: Path, sqlite_url: str) -> Path:
    """`sweep import` of three configurations (one with two seeds), then `report --format html --out`."""
    rng = np.random.default_rng(11)
    lines = ["run,compute,pass_rate,variant,seed"]
    for name, seeds in (("scalerl", (0, 1)), ("scout", (0,)), ("bs2048", (0,))):
        A, B, Cmid = PAPER_TABLE1[name]
        for seed in seeds:
            rates = noisy_curve(COMPUTE, A, B, Cmid, 0.3, rng=rng)
            lines += [f"{name}-{seed},{c:g},{r:.6f},{name},{seed}" for c, r in zip(COMPUTE, rates)]
    (tmp_path / "curves.csv").write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    result = runner.invoke(cli, ["--db", sqlite_url, "import", str(tmp_path / "curves.csv"), "--sweep", "paper"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    args = ["--format", "html", "--out", str(out), "--bootstrap", "30", "--fit-until", "8000", "--predict", "16000"]
    result = runner.invoke(cli, ["--db", sqlite_url, "report", "paper", *args])
    assert result.exit_code == 0, result.output
    return out / "report.html"


def test_the_html_report_renders_in_chromium(browser, report_page, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url[:80]} ({r.failure})"))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(report_page.as_uri(), wait_until="load")

    table = page.locator("table#fits")
    assert table.is_visible() and table.locator("tr").count() == 1 + 3  # header + three configurations
    images = page.locator("img")
    assert images.count() == 3 + 1  # one plot per configuration, one for the axis `variant`
    for i in range(images.count()):
        image = images.nth(i)
        image.scroll_into_view_if_needed()
        assert image.is_visible()
        assert image.evaluate("img => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0")
        assert image.evaluate("img => img.decode().then(() => true)")
    assert problems == []
    assert all(url.startswith(("file:", "data:")) for url in requests), requests

    shot = tmp_path / "report-screenshot.png"
    page.screenshot(path=str(shot), full_page=True)
    pixels = imread(shot)[..., :3]
    height, width = pixels.shape[:2]
    assert width == 1400 and height > 900, "the page is longer than one screen: table and plots"
    not_white = (pixels < 0.95).any(axis=-1).mean()
    assert not_white > 0.05 and pixels.std() > 0.1, f"blank screenshot? {not_white:.1%} non-white"
    images.first.screenshot(path=str(tmp_path / "plot.png"))
    assert imread(tmp_path / "plot.png")[..., :3].std() > 0.1, "the first plot renders as an image"
