"""What crossing a machine boundary costs: the weight push and a training step within one host vs
across hosts, on the multi-node dev cluster (network namespaces on one machine).

    python bench/bench_multinode.py [--steps 300] [--db URL]

Brings up a 3-node cluster of its own beside the default one (as tests/test_multinode.py does),
runs the same tiny PipelineRL run in pairs of layouts that differ only in where the tasks are, and
prints one table: median weight push (trainer rank 0 -> generator) and median step time per
layout, with the ratio across hosts / within one host. On CPU and gloo over veth pairs this is the
software path's overhead (more sockets, no loopback shortcuts), not a cluster network's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CLUSTER_ENV = {
    "DEV_CLUSTER_NAME": "devbench",
    "DEV_CLUSTER_HOME": "/var/lib/scalesweep-devbench",
    "DEV_CLUSTER_NODES": "3",
    "DEV_CLUSTER_NODE_PREFIX": "bnode",
    "DEV_CLUSTER_NODE_BASE": "230",
    "DEV_CLUSTER_CTLD_PORT": "6847",
    "DEV_CLUSTER_CPUS": "8",
}

# (label, nodes, tasks_per_node, generator_ranks): pairs with the same tasks, on one host or across.
LAYOUTS = [
    ("push, 1 trainer + 1 generator, one host", 1, 2, 1),
    ("push, 1 trainer + 1 generator, two hosts", 2, 1, 1),
    ("step, 3 trainers + 1 generator, one host", 1, 4, 1),
    ("step, 3 trainers + 1 generator, two hosts", 2, 2, 1),
]

GRID = """\
name: {name}
recipe:
  batch: {{prompts: 4, generations: 4}}
  optim: {{lr: 3.0e-4, warmup_steps: 0}}
  eval: {{every: 1000, samples: 2}}
  data: {{num_valid_prompts: 32}}
  checkpoint: {{every: 1000}}
  engine: {{generator_ranks: {generators}}}
resources: {{nodes: {nodes}, tasks_per_node: {tasks}}}
budget: {{steps: {steps}}}
"""


def cluster(*args: str) -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "dev-cluster.sh"), *args],
        env={**os.environ, **CLUSTER_ENV}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode:
        sys.exit(f"slurm/dev-cluster.sh {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def sweep(db: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "--db", db, *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"sweep {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def measure(db: str, root: Path, label: str, nodes: int, tasks: int, generators: int, steps: int) -> dict:
    from store import Store

    name = f"bench-{uuid.uuid4().hex[:6]}"
    path = root / f"{name}.yaml"
    path.write_text(GRID.format(name=name, nodes=nodes, tasks=tasks, generators=generators, steps=steps))
    sweep(db, "launch", str(path), "--cluster", "slurm", "--root", str(root))
    store = Store(db)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        (run,) = store.runs(name)
        if run.state in ("completed", "failed", "cancelled", "timeout"):
            break
        time.sleep(2)
    if run.state != "completed":
        sys.exit(f"{label}: run {run.id} ended {run.state}: {run.state_reason}")
    metrics = [m for step, m in store.train_metrics(run.id) if step > steps // 5]  # past the warm-up
    push = [m["weight_push_seconds"] for m in metrics if m.get("weight_push_seconds") is not None]
    step_s = [m["step_seconds"] for m in metrics if m.get("step_seconds") is not None]
    hosts = sorted({t["host"] for t in json.loads(sweep(db, "show", run.id, "--json")).get("hosts", [])})
    return {
        "label": label,
        "hosts": hosts,
        "push_ms": 1000 * statistics.median(push),
        "step_ms": 1000 * statistics.median(step_s),
        "steps": len(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--db", default=None, help="PostgreSQL admin URL (default: postgres on the head address)")
    args = parser.parse_args()

    cluster("up")
    head = cluster("address").strip()
    os.environ["SLURM_CONF"] = f"{CLUSTER_ENV['DEV_CLUSTER_HOME']}/etc/slurm.conf"
    from sqlalchemy import create_engine, text

    dbname = f"bench_multinode_{uuid.uuid4().hex[:6]}"
    admin_url = args.db or f"postgresql+psycopg://postgres@{head}:5432/postgres"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{dbname}"'))
    db = admin_url.rsplit("/", 1)[0] + f"/{dbname}"
    try:
        with tempfile.TemporaryDirectory(prefix="bench-multinode-", dir="/var/tmp") as tmp:
            rows = [measure(db, Path(tmp), *layout, args.steps) for layout in LAYOUTS]
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)'))
        cluster("down")

    print(f"| layout | hosts | median push (ms) | median step (ms) | steps | ratio (two hosts / one) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for i, row in enumerate(rows):
        metric = "push_ms" if row["label"].startswith("push") else "step_ms"
        ratio = f"{row[metric] / rows[i - 1][metric]:.2f}x" if i % 2 else ""
        print(
            f"| {row['label']} | {', '.join(row['hosts'])} | {row['push_ms']:.2f} | {row['step_ms']:.1f} "
            f"| {row['steps']} | {ratio} |"
        )


if __name__ == "__main__":
    main()
