"""Benchmark of `sweep import` + `sweep report` over 1,000 imported curves.

Run from the repository root:

    python bench/bench_report.py              # 250 configurations x 4 seeds, ~100 evals each
    python bench/bench_report.py --quick      # 25 x 4: a smoke test in ~10 s
    python bench/bench_report.py --html       # also time `--format html --out DIR` (252 PNGs)

Synthetic curves with Table-1-like parameters (A 0.55-0.75, B 1.5-2.1, Cmid 10-70% of a
16k GPU-hour budget; the first four configurations are Table 1's own) and the binomial + drift
noise of analysis.synthetic are written as one CSV (labels: loss, variant, seed), imported with
`sweep import` into a fresh SQLite store, then reported with
`sweep report --format json --bootstrap 200`, both as the real CLI in a subprocess. The report
uses every core it is given (a process pool over configurations); the issue's target is < 60 s on
2 cores (the import's 30 s is ours: well under a minute for a 100k-point file). Prints a
Markdown table: stage, time, target, ratio to target.
"""

from __future__ import annotations

import argparse
import json
import os
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
LOSSES = ("cispo", "dapo", "gspo", "grpo", "ppo")
TARGETS_S = {"import": 30.0, "report": 60.0}


def write_curves(path: Path, num_configs: int, num_seeds: int) -> int:
    """The benchmark's CSV; returns the number of rows. Deterministic."""
    rng = np.random.default_rng(2510)
    table1 = list(PAPER_TABLE1.values())
    lines = ["run,compute,pass_rate,loss,variant,seed"]
    for i in range(num_configs):
        if i < len(table1):
            A, B, cmid = table1[i]
        else:
            A, B, cmid = rng.uniform(0.55, 0.75), rng.uniform(1.5, 2.1), BUDGET * rng.uniform(0.1, 0.7)
        r0 = rng.uniform(0.2, 0.35)
        compute = np.linspace(0.0, BUDGET, int(rng.integers(81, 122)))
        loss, variant = LOSSES[i % len(LOSSES)], f"v{i // len(LOSSES):03d}"
        for seed in range(num_seeds):
            rates = noisy_curve(compute, A, B, cmid, r0, rng=rng)
            name = f"{loss}-{variant}-s{seed}"
            lines += [f"{name},{c:.6g},{r:.6f},{loss},{variant},{seed}" for c, r in zip(compute, rates)]
    path.write_text("\n".join(lines) + "\n")
    return len(lines) - 1


def sweep(db: str, *args: str) -> tuple[float, str]:
    """Run the real `sweep` CLI; (wall seconds, stdout). Fails loudly with stderr."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--db", db, *args], cwd=ROOT, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"sweep {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return wall, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=int, default=250)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="25 configurations")
    parser.add_argument("--html", action="store_true", help="also time the html report with its plots (--out)")
    args = parser.parse_args()
    num_configs = 25 if args.quick else args.configs
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        csv_path, db = Path(tmp) / "curves.csv", f"sqlite:///{tmp}/bench.db"
        start = time.perf_counter()
        num_rows = write_curves(csv_path, num_configs, args.seeds)
        t_write = time.perf_counter() - start
        t_import, out = sweep(db, "import", str(csv_path), "--sweep", "bench")
        print(out.strip())
        t_report, out = sweep(db, "report", "bench", "--format", "json", "--bootstrap", str(args.bootstrap))
        html_args = ("report", "bench", "--format", "html", "--out", f"{tmp}/out", "--bootstrap", str(args.bootstrap))
        t_html = sweep(db, *html_args)[0] if args.html else None
    report = json.loads(out)
    runs = report["runs"]
    curves = sum(len(r["run_ids"]) for r in runs)
    print(
        f"\n{curves} curves ({num_configs} configurations x {args.seeds} seeds, {num_rows} points), "
        f"--bootstrap {args.bootstrap}, {cores} cores; python {sys.version.split()[0]}, numpy {np.__version__}\n"
        f"{sum(r['rank'] is not None for r in runs)} ranked, {sum(bool(r['flags']) for r in runs)} flagged, "
        f"{len(report['comparisons'])} comparisons, {len(report['effects'])} effects\n"
    )
    print("| stage | time | target | ratio to target |")
    print("| --- | --- | --- | --- |")
    print(f"| write the CSV ({num_rows} rows) | {t_write:.1f} s | - | - |")
    for stage, wall in (("import", t_import), ("report", t_report)):
        label = "sweep import" if stage == "import" else f"sweep report --format json --bootstrap {args.bootstrap}"
        target = TARGETS_S[stage]
        print(f"| {label} | {wall:.1f} s | < {target:.0f} s | {wall / target:.2f} |")
    if t_html is not None:
        print(f"| sweep report --format html --out DIR --bootstrap {args.bootstrap} | {t_html:.1f} s | - | - |")


if __name__ == "__main__":
    main()
