"""`sweep status`: where every run of a sweep stands.

Before reading, the store is reconciled with the executors: local attempts whose process is gone
without a word become failed; Slurm attempts are refreshed with one sacct query for the whole
sweep (launcher.slurm). Queued local work without a scheduler gets one. Then, if the caller hands
one in, the sweep's live prune policy is applied (the CLI hands in analysis' pruner: this module
knows nothing of fits).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from launcher import local
from store import TERMINAL_STATES, AttemptRecord, AttemptState, EvalRecord, RunRecord, RunState, Store


Pruner = Callable[[Store, str], object]
"""Applies a sweep's live prune policy (analysis.report.prune.apply_live_policy, which the CLI hands in)."""

SYNCHRONOUS_PIPELINE = "async.mode=pipeline with engine.generator_ranks=0: synchronous (lag 0)"


NOTE_KEYS = ("async.mode", "engine.generator_ranks")
"""The config keys `notes` depends on (read with the database's JSON paths, not decoded)."""


def synchronous_pipeline(mode: Any, generator_ranks: Any) -> bool:
    """A pipeline run without generator ranks alternates generation and training in one process."""
    return mode == "pipeline" and not generator_ranks


@dataclass(frozen=True)
class StatusRow:
    run: RunRecord
    num_attempts: int
    attempt: AttemptRecord | None
    last: EvalRecord | None
    notes: tuple[str, ...] = ()
    """What a user should know about how the run executes."""
    seed: int | None = None
    """The run's seed: its `seed` axis, else its config's (an imported run without one: None)."""

    @property
    def budget_steps(self) -> int | None:
        return self.run.budget.get("steps")

    def to_json(self) -> dict[str, Any]:
        a, last = self.attempt, self.last
        return {
            "run": self.run.id,
            "axes": self.run.axes,
            "seed": self.seed,
            "state": self.run.state,
            "reason": self.run.state_reason,
            "prune": self.run.prune,
            "attempts": self.num_attempts,
            "step": self.run.step,
            "budget": self.run.budget,
            "pass_rate": last.pass_rate if last else None,
            "flops": last.flops if last else None,
            "gpu_hours": last.gpu_hours if last else None,
            "job_id": a.job_id if a else None,
            "executor": a.executor if a else None,
            "node": a.node if a else None,
            "notes": list(self.notes),
            "stdout": a.stdout_path if a else None,
            "stderr": a.stderr_path if a else None,
            "run_dir": self.run.run_dir,
        }


def collect(store: Store, sweep: str, *, reconcile: bool = True, prune: Pruner | None = None) -> list[StatusRow]:
    """The sweep's rows, after the sync step (`sync`, with `prune`) unless `reconcile` is False."""
    if reconcile:
        sync(store, sweep, prune=prune)
    runs = store.runs(sweep)
    attempts = store.latest_attempts(sweep)
    counts = store.attempt_counts(sweep)
    last = store.last_eval_points(sweep)
    values = store.config_values(sweep, (*NOTE_KEYS, "seed"))
    return [
        StatusRow(
            r, counts.get(r.id, 0), attempts.get(r.id), last.get(r.id), _notes(values.get(r.id, ())[:-1]),
            r.axes.get("seed", values.get(r.id, (None,))[-1]),
        )
        for r in runs
    ]  # fmt: skip


def _notes(values: tuple[Any, ...]) -> tuple[str, ...]:
    mode, generator_ranks = values or (None, None)
    return (SYNCHRONOUS_PIPELINE,) if synchronous_pipeline(mode, generator_ranks) else ()


def sync(store: Store, sweep: str, *, prune: Pruner | None = None) -> None:
    """The sync step of `sweep status`, its only writes: bring the store in line with what the
    executors know (local processes gone, Slurm's verdicts), start a local scheduler for queued
    work that has none, and submit runs a Slurm submit limit held back if there is room now;
    then `prune` applies the sweep's prune policy (it stops the runs it prunes)."""
    reconcile_local(store, sweep)
    if "slurm" in store.latest_executors(sweep):
        from launcher import slurm

        slurm.reconcile(store, sweep)
    if prune is not None:
        prune(store, sweep)


def reconcile_local(store: Store, sweep: str) -> None:
    """Fail running local attempts whose process died unseen (e.g. the scheduler was killed too)."""
    host = socket.gethostname()
    for attempt in store.active_attempts(local.EXECUTOR, sweep):
        if attempt.state != AttemptState.RUNNING or attempt.node != host or attempt.pid is None:
            continue
        if local.is_alive(attempt.pid):
            continue
        reason = f"process {attempt.pid} is gone without reporting an end (killed?) (log: {attempt.stderr_path})"
        store.settle_attempt(attempt.id, RunState.FAILED, reason)
    local.ensure_scheduler(store)


def pruned_lines(rows: list[StatusRow]) -> list[str]:
    """One line per pruned run: why, the fit that decided it, and where its job stopped (plain text)."""
    lines = []
    for row in rows:
        if row.run.state != RunState.PRUNED:
            continue
        record = row.run.prune or {}
        fit = ""
        if record.get("A") and record.get("best_A"):
            (lo, hi), (best_lo, best_hi) = record["A"], record["best_A"]
            fit = (
                f" [fit on {record.get('compute_axis')} up to {record.get('compute', 0):.3g}: A in {lo:.3f}-{hi:.3f}, "
                f"best {record.get('best')} A in {best_lo:.3f}-{best_hi:.3f}, margin {record.get('margin')}, "
                f"level {record.get('level')}]"
            )
        a = row.attempt
        end = (
            a.exit_reason
            if a is not None and a.state == AttemptState.PRUNED and a.exit_reason
            else "stopping after a checkpoint at the next step boundary"
        )
        lines.append(f"{row.run.id}: {row.run.state_reason or 'pruned'}{fit}; {end}")
    return lines


def summary(rows: list[StatusRow]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        out[row.run.state] = out.get(row.run.state, 0) + 1
    return out


def all_ended(rows: list[StatusRow]) -> bool:
    return all(r.run.state in TERMINAL_STATES or r.run.state == RunState.REGISTERED for r in rows)


def watch(store: Store, sweep: str, *, prune: Pruner | None = None, interval_s: float = 2.0) -> Iterator[list[StatusRow]]:
    """The sweep's rows (synced, with the live prune step), again every `interval_s` until every
    run has ended; the last rows yielded are the final ones."""
    while True:
        rows = collect(store, sweep, prune=prune)
        yield rows
        if all_ended(rows):
            return
        time.sleep(interval_s)
