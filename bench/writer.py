"""One concurrent writer: write N eval points of one run into the store, one transaction each,
as a training job does. Used by tests/test_slurm.py and bench/bench_slurm.py as a Slurm array:

    sbatch --array=0-31 --wrap "python bench/writer.py --points 500"   (with SWEEP_DB set)

Each array task writes to run `writer-<task>`; the points' steps are 0..N-1.
"""

from __future__ import annotations

import argparse
import os
import time

from store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", type=int, default=500)
    parser.add_argument("--index", type=int, default=int(os.environ.get("SLURM_ARRAY_TASK_ID", "0")))
    args = parser.parse_args()
    store = Store()  # $SWEEP_DB
    run_id = f"writer-{args.index}"
    start = time.perf_counter()
    for step in range(args.points):
        point = dict(
            step=step,
            pass_rate=step / args.points,
            flops=1e9 * step,
            tokens=step,
            device_seconds=0.0,
            gpu_hours=0.0,
            num_samples=1,
        )
        store.add_eval_points(run_id, [point])
    print(f"{run_id}: {args.points} points in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
