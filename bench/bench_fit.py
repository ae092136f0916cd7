"""Benchmark of the curve fits: the paper's reference grid vs the fast method, and a report-sized
bootstrap run.

Run from the repository root:

    python bench/bench_fit.py                 # 20 reference curves, 1,000 bootstrapped curves, 2 workers
    python bench/bench_fit.py --quick         # 5 and 100: a smoke test in ~20 s

Part 1: per-curve time of method="reference" (grid over A x 100 Cmid values, B by curve_fit at
each point) and method="fast" on noisy synthetic curves of ~120 evals, and their squared errors
(targets: >= 100x speed-up; fast SSE <= reference SSE on every curve).
Part 2: fit + 200-replicate bootstrap of 1,000 synthetic curves with a process pool (target:
< 60 s on 2 cores), and how often the 95% interval covered the true A.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis import FitOptions, FitResult, bootstrap, fit_curves  # noqa: E402
from analysis.synthetic import PAPER_TABLE1, noisy_curve  # noqa: E402

BUDGETS = (16_000.0, 50_000.0, 100_000.0)
NUM_EVALS = 121


def synthetic_run(i: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Curve i of the benchmark set: (compute, pass_rate, true A, cutoff). Deterministic in i."""
    rng = np.random.default_rng(20_000 + i)
    budget = BUDGETS[i % len(BUDGETS)]
    if i < 4 * len(PAPER_TABLE1):  # the first curves are the paper's Table 1 runs
        A, B, cmid = PAPER_TABLE1[sorted(PAPER_TABLE1)[i % len(PAPER_TABLE1)]]
        cmid *= budget / 16_000.0
    else:
        A, B, cmid = rng.uniform(0.45, 0.85), rng.uniform(1.0, 2.6), budget * 10 ** rng.uniform(-1.0, -0.3)
    r0 = rng.uniform(0.15, min(0.4, A - 0.1))
    compute = np.linspace(0.0, budget, NUM_EVALS)
    rate = noisy_curve(compute, A, B, cmid, r0, rng=rng)
    return compute, rate, A, budget * 1500 / 16_000


def time_call(fn: Callable[[], FitResult], repeat: int) -> tuple[float, FitResult]:
    """Mean seconds per call over `repeat` calls, and the last result."""
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - start) / repeat, out


def bench_methods(num_curves: int) -> None:
    print(f"## reference vs fast, {num_curves} noisy curves of {NUM_EVALS} evals (one core)\n")
    print("| curve | A true | ref A | fast A | ref SSE | fast SSE | ref s | fast ms | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    fit_curves([synthetic_run(0)[:2]], FitOptions(method="reference", num_cmid=2))  # import scipy.optimize outside the timings
    ref_times, fast_times, wins = [], [], 0
    for i in range(num_curves):
        compute, rate, true_a, cutoff = synthetic_run(i)
        t_ref, ref = time_call(partial(fit_curves, [(compute, rate)], FitOptions(cutoff=cutoff, method="reference")), 1)
        t_fast, fast = time_call(partial(fit_curves, [(compute, rate)], FitOptions(cutoff=cutoff)), 20)
        wins += fast.sse <= ref.sse * (1 + 1e-9)
        ref_times.append(t_ref)
        fast_times.append(t_fast)
        print(
            f"| {i} | {true_a:.3f} | {ref.A:.3f} | {fast.A:.3f} | {ref.sse:.3e} | {fast.sse:.3e} | "
            f"{t_ref:.2f} | {t_fast * 1e3:.1f} | {t_ref / t_fast:.0f}x |"
        )
    ref_med, fast_med = np.median(ref_times), np.median(fast_times)
    print("\n| method | median time per curve | total | fast SSE <= reference SSE |")
    print("| --- | --- | --- | --- |")
    print(f"| reference (paper's grid) | {ref_med:.2f} s | {sum(ref_times):.1f} s | |")
    print(f"| fast | {fast_med * 1e3:.1f} ms | {sum(fast_times):.2f} s | {wins}/{num_curves} curves |")
    print(f"| ratio | {ref_med / fast_med:.0f}x | | |\n")


def fit_and_bootstrap(i: int) -> tuple[bool, bool, str]:
    compute, rate, true_a, cutoff = synthetic_run(i)
    boot = bootstrap([(compute, rate)], n_boot=200, seed=i, options=FitOptions(cutoff=cutoff))
    return boot.fit.ok, boot.A.contains(true_a), boot.fit.method


def bench_report(num_curves: int, workers: int) -> None:
    print(f"## fit + 200-replicate bootstrap of {num_curves} curves, {workers} worker processes\n")
    start = time.perf_counter()
    with mp.get_context("fork").Pool(workers) as pool:
        results = pool.map(fit_and_bootstrap, range(num_curves), chunksize=max(1, num_curves // (8 * workers)))
    wall = time.perf_counter() - start
    ok = sum(r[0] for r in results)
    covered = sum(r[1] for r in results)
    fallbacks = sum(r[2] != "fast" for r in results)
    print(
        "| curves | workers | wall time | per curve (per worker) | fits ok | fallbacks | 95% interval covers true A |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {num_curves} | {workers} | {wall:.1f} s | {wall * workers / num_curves * 1e3:.0f} ms | "
        f"{ok}/{num_curves} | {fallbacks} | {covered / num_curves:.1%} |\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-curves", type=int, default=20)
    parser.add_argument("--report-curves", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="5 reference curves, 100 report curves")
    args = parser.parse_args()
    if args.quick:
        args.reference_curves, args.report_curves = 5, 100
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs\n")
    bench_methods(args.reference_curves)
    bench_report(args.report_curves, args.workers)


if __name__ == "__main__":
    main()
