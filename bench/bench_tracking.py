"""Training overhead of the `tracking:` mirrors: the same run (config and seed) with no tracker,
with TensorBoard, with W&B (offline) and with both, in one process.

    python bench/bench_tracking.py [--rounds 3] [--steps 60]

Each round trains the tiny built-in sort6 model (4 prompts x 4 generations a step, an eval every
20 steps, one CPU thread) from scratch in a fresh run directory, once per variant, in turn, into
an in-memory sink (recipe.sink.MemorySink) wrapped by recipe.telemetry.trackers.mirrored as a job
wraps its store sink. Timed: the whole `train` call after the mirror is built (every step, eval
and checkpoint, the trackers' writes included), and apart from it the time the training thread
spends handing values to the trackers (they run in a thread of their own; a precise figure where
the steps/s of a shared machine are noisy); W&B's start
(its service process) is timed apart. Prints a Markdown table of medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "none": None,
    "tensorboard": {"tensorboard": True},
    "wandb offline": {"wandb": {"mode": "offline", "project": "bench"}},
    "both": {"wandb": {"mode": "offline", "project": "bench"}, "tensorboard": True},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    import torch

    from recipe.config import RecipeConfig
    from recipe.telemetry.sinks import MemorySink
    from recipe.telemetry.trackers import mirrored
    from recipe.loop.train import train

    torch.set_num_threads(1)
    cfg = RecipeConfig.from_dict({
        "batch": {"prompts": 4, "generations": 4}, "optim": {"lr": 3.0e-4, "warmup_steps": 0},
        "eval": {"every": 20, "samples": 2}, "data": {"num_valid_prompts": 32},
        "checkpoint": {"every": 1000}, "budget": {"steps": args.steps},
    })  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    inside: dict[str, list[float]] = {name: [] for name in VARIANTS}
    first: dict[str, list[float]] = {name: [] for name in VARIANTS}
    starts: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, block in VARIANTS.items():
                run_dir = Path(tmp) / f"{r}-{name.replace(' ', '-')}"
                run_dir.mkdir()
                t0 = time.perf_counter()
                sink = mirrored(MemorySink(), block, sweep="bench", run_id=f"bench{r}{len(rates[name])}{name[:2]}".replace(" ", ""),
                                run_dir=run_dir, config=cfg.to_dict(), axes={})  # fmt: skip
                if block and "wandb" in block:
                    starts.append(time.perf_counter() - t0)
                spent = [0.0, -1.0]  # [all calls after the first, the first (a lazy import and open)]
                if hasattr(sink, "_each"):  # time inside the trackers' calls, apart from the noise of the whole step
                    each = sink._each

                    def timed(*a, each=each, spent=spent):  # type: ignore[no-untyped-def]
                        t = time.perf_counter()
                        each(*a)
                        if spent[1] < 0:
                            spent[1] = time.perf_counter() - t
                        else:
                            spent[0] += time.perf_counter() - t

                    sink._each = timed
                t0 = time.perf_counter()
                outcome = train(cfg, run_dir, sink, log=lambda _msg: None)
                if hasattr(sink, "flush"):
                    sink.flush()
                elapsed = time.perf_counter() - t0
                if hasattr(sink, "close"):
                    sink.close()
                assert outcome.final_step == args.steps
                rates[name].append(args.steps / elapsed)
                inside[name].append(spent[0] / args.steps)
                first[name].append(max(spent[1], 0.0))
    base = statistics.median(rates["none"])
    print(f"machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores; {time.strftime('%Y-%m-%d')}; "
          f"{args.rounds} rounds of {args.steps} steps")  # fmt: skip
    print("\n| trackers | steps/s (median) | ratio to none | time in the trackers per step | share of a step | first call (once) |")
    print("|---|---|---|---|---|---|")
    for name, values in rates.items():
        rate, cost = statistics.median(values), statistics.median(inside[name])
        print(f"| {name} | {rate:.2f} | {rate / base:.3f} | {cost * 1e3:.2f} ms | {cost * base:.1%} | {statistics.median(first[name]):.2f} s |")
    print(f"\nW&B start (wandb.init, offline): median {statistics.median(starts):.1f} s, once per attempt, not in the steps/s")
    print("all rounds (steps/s): " + "; ".join(f"{n}: {', '.join(f'{v:.2f}' for v in vs)}" for n, vs in rates.items()))


if __name__ == "__main__":
    main()
