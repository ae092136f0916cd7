"""Control-plane benchmarks on the dev Slurm cluster and the local PostgreSQL server.

    bash slurm/dev-cluster.sh up && python bench/bench_slurm.py [--runs 2000] [--writers 32 --points 500]
        [--profile DIR]   # cProfile stats of the submit and the status: DIR/submit.prof, DIR/status.prof

1. Expand + validate a grid of `--runs` runs (target: reported, no target in the issue).
2. Submit those runs to the dev cluster with MaxArraySize=1001: sbatch calls (target
   ceil(runs / 1001)) and wall time (target < 10 s up to 2,000 runs, < 30 s beyond). The jobs are held (`--hold` is not available
   through submitit, so they are cancelled right after the status measurement).
3. `sweep status` on them: Slurm queries (target 1) and time (target < 1 s).
4. `--writers` concurrent writer processes (one Slurm array) x `--points` eval points each, into
   SQLite and into PostgreSQL: points/s, lost, duplicated (targets: 0 and 0; PostgreSQL >= 5,000
   points/s).

Prints a table with each figure, its target and the ratio; the peer of the writers benchmark is
SQLite measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import launcher.slurm as slurm
from launcher.grid import expand, load_sweep
from launcher.launch import launch
from launcher.status import collect
from store import NewRun, Store

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def grid_yaml(name: str, runs: int) -> str:
    """A grid of exactly `runs` runs: 40 learning rates x (runs / 40) seeds, tiny budgets."""
    lrs = ", ".join(f"{1e-5 * (i + 1):.6g}" for i in range(40))
    seeds = list(range(math.ceil(runs / 40)))
    return (
        f"name: {name}\nrecipe:\n  batch: {{prompts: 4, generations: 4}}\n  eval: {{every: 5, samples: 1}}\n"
        f"grid:\n  optim.lr: [{lrs}]\nseeds: {seeds}\nbudget: {{steps: 5}}\n"
        f"resources: {{profile: {ROOT / 'slurm/profiles/dev.yaml'}}}\n"
    )


class Counter:
    """Counts the Slurm commands the launcher starts (sbatch through submitit, sacct/squeue):
    every one goes through subprocess.Popen (subprocess.run included)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._popen = subprocess.Popen

    def __enter__(self) -> Counter:
        counter = self

        class Popen(self._popen):  # type: ignore[misc, valid-type]
            def __init__(self, args, *a, **kw):  # type: ignore[no-untyped-def]
                counter.calls.append(Path(str(args[0] if isinstance(args, list) else args)).name)
                super().__init__(args, *a, **kw)

        subprocess.Popen = Popen  # type: ignore[misc]
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.Popen = self._popen  # type: ignore[misc]

    def count(self, name: str) -> int:
        return sum(c == name for c in self.calls)


class Profile:
    """cProfile around a measured step when `folder` is given (stats in folder/<name>.prof)."""

    def __init__(self, folder: Path | None, name: str) -> None:
        self.folder, self.name = folder, name

    def __enter__(self) -> Profile:
        if self.folder is not None:
            import cProfile

            self.profile = cProfile.Profile()
            self.profile.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.folder is not None:
            self.profile.disable()
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profile.dump_stats(str(self.folder / f"{self.name}.prof"))


def bench_launch(runs: int, rows: list[tuple[str, str, str, str]], profile: Path | None = None) -> None:
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        grid = Path(tmp) / "grid.yaml"
        name = f"bench{uuid.uuid4().hex[:6]}"
        grid.write_text(grid_yaml(name, runs))
        t0 = time.perf_counter()
        spec = load_sweep(grid)
        plans = expand(spec)[:runs]
        t_expand = time.perf_counter() - t0
        rows.append((f"expand + validate {len(plans)} runs", f"{t_expand:.2f} s", "-", "-"))

        store = Store(f"sqlite:///{tmp}/bench.db")
        # Held jobs: submission and tracking are measured, not 2,000 trainings on 2 cores.
        slurm.executor_parameters = _held(slurm.executor_parameters)
        with Counter() as counter, Profile(profile, "submit"):
            t0 = time.perf_counter()
            result = launch(store, spec, plans, executor="slurm", root=Path(tmp) / "runs")
            t_submit = time.perf_counter() - t0
        arrays = math.ceil(len(plans) / slurm.read_limits().max_array_size)
        sbatch = counter.count("sbatch")
        rows.append(
            (f"submit {len(result.submitted)} runs: sbatch calls", str(sbatch), f"{arrays}", f"{sbatch / arrays:.2f}")
        )
        limit = 10 if runs <= 2000 else 30  # the issues' targets: 2,000 runs < 10 s, 10,000 runs < 30 s
        label = f"submit {len(result.submitted)} runs: wall time"
        rows.append((label, f"{t_submit:.2f} s", f"< {limit} s", f"{t_submit / limit:.2f}"))

        with Counter() as counter, Profile(profile, "status"):
            t0 = time.perf_counter()
            status = collect(store, name)
            t_status = time.perf_counter() - t0
        queries = counter.count("sacct") + counter.count("squeue")
        rows.append((f"status of {len(status)} runs: Slurm queries", str(queries), "1", f"{queries / 1:.2f}"))
        rows.append((f"status of {len(status)} runs: time", f"{t_status:.2f} s", "< 1 s", f"{t_status:.2f}"))
        job_ids = [j for j in sorted({a.array_job_id or a.job_id for a in store.latest_attempts(name).values()}) if j]
        subprocess.run(["scancel", *job_ids], check=False)
        deadline = time.monotonic() + 120
        while subprocess.run(["squeue", "-h", "-j", ",".join(job_ids)], capture_output=True, text=True).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(1)


def _held(make):  # type: ignore[no-untyped-def]
    def params(*args):  # type: ignore[no-untyped-def]
        out = make(*args)
        out["additional_parameters"] = {**out.get("additional_parameters", {}), "hold": True}
        return out

    return params


def bench_writers(writers: int, points: int, batch: int, rows: list[tuple[str, str, str, str]]) -> None:
    rates = {}
    how = "1 point per transaction" if batch == 1 else f"{batch} points per transaction"
    with tempfile.TemporaryDirectory() as tmp:
        urls = {"sqlite": f"sqlite:///{tmp}/writers{batch}.db", "postgresql": _fresh_pg_database()}
        for backend, url in urls.items():
            store = Store(url)
            store.upsert_sweep("writers", {}, tmp, "slurm")
            store.register_runs("writers", [NewRun(f"writer-{i}", i, {}, {}, {}, tmp) for i in range(writers)])
            env = {**os.environ, "SWEEP_DB": store.url, "PYTHONPATH": str(ROOT)}
            start_at = time.time() + 20  # every writer is started and connected by then
            subprocess.run(
                ["sbatch", "--wait", "--parsable", f"--array=0-{writers - 1}", f"--output={tmp}/{backend}_%a.out",
                 "--wrap", f"{sys.executable} {ROOT / 'bench' / 'writer.py'} --points {points} --batch {batch} --start-at {start_at}"],
                env=env, check=True, capture_output=True,
            )  # fmt: skip
            first, last = _writing_window(tmp, backend, writers)
            written = store.sweep_eval_points("writers")
            total = sum(len(v) for v in written.values())
            unique = sum(len({p.step for p in v}) for v in written.values())
            lost = writers * points - unique
            duplicated = total - unique
            rates[backend] = total / (last - first)
            target = "- (the peer)" if backend == "sqlite" else ">= 5,000"
            ratio = "-" if backend == "sqlite" else f"{rates[backend] / 5000:.2f}"
            label = f"{writers} writers x {points} points, {how}, {backend}"
            rows.append((f"{label}: points/s", f"{rates[backend]:,.0f}", target, ratio))
            rows.append((f"{label}: lost / duplicated", f"{lost} / {duplicated}", "0 / 0", "-"))
        _drop_pg_database(urls["postgresql"])
    rows.append((f"PostgreSQL / SQLite points/s, {how}", f"{rates['postgresql'] / rates['sqlite']:.2f}x", "-", "-"))


def _writing_window(tmp: str, backend: str, writers: int) -> tuple[float, float]:
    """(first write of any writer, end of the last write of any writer), from their reports."""
    spans = [Path(tmp, f"{backend}_{i}.out").read_text().split()[-2:] for i in range(writers)]
    return min(float(a) for a, _ in spans), max(float(b) for _, b in spans)


def _fresh_pg_database() -> str:
    from sqlalchemy import create_engine, text

    name = f"scalesweep_bench_{uuid.uuid4().hex[:8]}"
    engine = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"


def _drop_pg_database(url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--writers", type=int, default=32, help="0: no writers benchmark")
    parser.add_argument("--points", type=int, default=500)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 50], help="points per transaction, one run each")
    parser.add_argument("--profile", type=Path, help="write cProfile stats of submit and status here")
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    bench_launch(args.runs, rows, args.profile)
    for batch in args.batches if args.writers else []:
        bench_writers(args.writers, args.points, batch, rows)
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )
    width = max(len(r[0]) for r in rows)
    print(f"| {'measure':<{width}} | value | target | ratio |\n| {'-' * width} | --- | --- | --- |")
    for measure, value, target, ratio in rows:
        print(f"| {measure:<{width}} | {value} | {target} | {ratio} |")


if __name__ == "__main__":
    main()
