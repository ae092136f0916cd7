"""One concurrent writer: write N eval points of one run into the store, one transaction each,
as a training job does. Used by tests/test_slurm.py and bench/bench_slurm.py as a Slurm array:

    SWEEP_DB=URL sbatch --array=0-31 --wrap "python bench/writer.py --points 500 [--batch 1] [--start-at EPOCH]"

Each array task writes to run `writer-<task>`, steps 0..N-1, `--batch` points per transaction (1:
how a job writes its eval points; more: how it sends its per-step training metrics, batched). With --start-at, every writer waits
for that wall-clock time before its first write, so all of them write at once (their start-up,
imports and connection are not what is measured). Prints `writer-<i> <first> <last>`: the epoch
times of its first write and of the end of its last one.
"""

from __future__ import annotations

import argparse
import os
import time

from store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=500)
    parser.add_argument("--index", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", "0")))
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    store = Store()  # $SWEEP_DB
    store.ping()  # connect before the start line
    run_id = f"writer-{args.index}"
    time.sleep(max(0.0, args.start_at - time.time()))
    points = [
        dict(
            step=step,
            pass_rate=step / args.points,
            flops=1e9 * step,
            tokens=step,
            device_seconds=0.0,
            gpu_hours=0.0,
            num_samples=1,
            metrics={},
        )  # fmt: skip
        for step in range(args.points)
    ]
    first = time.time()
    for start in range(0, args.points, args.batch):
        store.add_eval_points(run_id, points[start : start + args.batch])
    print(f"{run_id} {first:.6f} {time.time():.6f}")


if __name__ == "__main__":
    main()
