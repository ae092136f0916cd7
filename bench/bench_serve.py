"""Benchmark of `sweep serve` on a 10,000-run imported sweep: start-up, page load in chromium,
and the latency from a point written to the store to that point on the chart.

Run from the repository root (needs chromium and Playwright, as the browser tests):

    python bench/bench_serve.py            # 1,000 configurations x 10 seeds = 10,000 runs, 21 evals each
    python bench/bench_serve.py --quick    # 50 x 4: a smoke test

The curves (Table-1-like sigmoids with analysis.synthetic's noise) are imported with `sweep import`
into a fresh SQLite store; `sweep serve` runs as the real CLI in a subprocess. Measured:

- start-up: from `sweep serve` to its first page data (every configuration's point fit, the 20
  best with a 100-replicate bootstrap and an extrapolation), as it prints it;
- page load: from navigation to the table and the chart drawn (median of 3 fresh pages);
- update: from `Store.add_eval_points` of a new point to that point on the chart, the page open
  (median of 5 points, each on another configuration).

The peer, measured in the same run on the same store: what a user does today to see new points,
`sweep report SWEEP --format json --bootstrap 0` (point fits only, no plots). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.synthetic import PAPER_TABLE1, noisy_curve  # noqa: E402

BUDGET = 16_000.0
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def write_curves(path: Path, num_configs: int, num_seeds: int, num_evals: int) -> None:
    rng = np.random.default_rng(2510)
    table1 = list(PAPER_TABLE1.values())
    lines = ["run,compute,pass_rate,variant,seed"]
    compute = np.linspace(0.0, BUDGET * 0.8, num_evals)
    for i in range(num_configs):
        A, B, cmid = table1[i] if i < len(table1) else (rng.uniform(0.55, 0.75), rng.uniform(1.5, 2.1), BUDGET * rng.uniform(0.1, 0.7))
        for seed in range(num_seeds):
            rates = noisy_curve(compute, A, B, cmid, 0.25, rng=rng)
            lines += [f"v{i:04d}-s{seed},{c:.6g},{r:.6f},v{i:04d},{seed}" for c, r in zip(compute, rates)]
    path.write_text("\n".join(lines) + "\n")


def cli(db: str, *args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "launcher.cli", "--db", db, *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    configs, seeds, evals = (50, 4, 21) if args.quick else (1000, 10, 21)
    from playwright.sync_api import sync_playwright

    from store import Store

    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/bench.db"
        write_curves(Path(tmp) / "curves.csv", configs, seeds, evals)
        import_s = cli(db, "import", f"{tmp}/curves.csv", "--sweep", "big")
        report_s = cli(db, "report", "big", "--format", "json", "--bootstrap", "0")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "--db", db, "serve", "big", "--port", str(port)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline()
        startup_s = time.perf_counter() - started
        url = re.search(r"at (http://\S+)", line).group(1)  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        store = Store(db)
        runs = store.runs("big")
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                loads = []
                for _ in range(3):
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    t0 = time.perf_counter()
                    page.goto(url)
                    page.wait_for_selector("#runs tbody tr", timeout=120_000)
                    page.wait_for_function("() => document.querySelector('#curves .main-svg') !== null", timeout=120_000)
                    loads.append(time.perf_counter() - t0)
                    rows = page.locator("#runs tbody tr").count()
                    size = page.evaluate("() => JSON.stringify(window.performance.getEntriesByType('resource').map(e => [e.name, e.transferSize]))")
                    page.close()
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url)
                page.wait_for_function("() => document.querySelector('#curves .main-svg') !== null", timeout=120_000)
                updates = []
                for k in range(5):
                    run = runs[(k * 997) % len(runs)]
                    x = BUDGET * 0.85 + k
                    point = {"step": 1000 + k, "pass_rate": 0.5, "flops": 0.0, "tokens": 0, "device_seconds": 0.0, "gpu_hours": x, "num_samples": 1}
                    t0 = time.perf_counter()
                    store.add_eval_points(run.id, [point])
                    page.wait_for_function(
                        f"() => document.getElementById('curves').data.some(t => t.type === 'scattergl' && t.x.includes({x}))", timeout=120_000
                    )
                    updates.append(time.perf_counter() - t0)
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    data_bytes = max((n for name, n in __import__("json").loads(size) if "/api/sweep" in name), default=0)
    load, update = statistics.median(loads), statistics.median(updates)
    print(f"{len(runs)} runs ({configs} configurations x {seeds} seeds, {evals} evals each); import {import_s:.1f} s")
    print(f"machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores; {time.strftime('%Y-%m-%d')}")
    print(f"table rows drawn at once: {rows}; page data {data_bytes / 1e6:.1f} MB\n")
    print("| stage | sweep serve | peer: `sweep report --format json --bootstrap 0` | ratio |")
    print("|---|---|---|---|")
    print(f"| start-up (first page data) | {startup_s:.1f} s | {report_s:.1f} s | {startup_s / report_s:.2f} |")
    print(f"| page load (median of 3) | {load:.2f} s | {report_s:.1f} s | {load / report_s:.3f} |")
    print(f"| new point on the chart (median of 5) | {update:.2f} s | {report_s:.1f} s | {update / report_s:.3f} |")
    print(f"\nloads: {', '.join(f'{v:.2f}' for v in loads)} s; updates: {', '.join(f'{v:.2f}' for v in updates)} s")


if __name__ == "__main__":
    main()
