"""One run up close: `sweep show` (everything the store knows of it) and `sweep rerun` (the same
config again, in the same sweep, optionally with another seed)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.launch import LaunchError, _submit
from recipe.config import ConfigError, RecipeConfig, canonical_json, read_run_files, write_run_files
from recipe.telemetry.provenance import code_version
from store import NewRun, NotFoundError, RunRecord, RunState, Store

LAST_EVAL_POINTS = 5


def show(store: Store, ref: str) -> dict[str, Any]:
    """The run's resolved config, axis values, attempts (states, exit reasons, provenance),
    checkpoints, last eval points and the newest attempt's tasks (`hosts`: role, rank and host of
    each), as plain JSON-able data."""
    run = store.get_run(ref)
    attempts = store.attempts(run.id)
    latest = next((a.provenance for a in reversed(attempts) if a.provenance), None)
    return {
        "run": run.id,
        "sweep": run.sweep,
        "state": run.state,
        "reason": run.state_reason,
        "step": run.step,
        "budget": run.budget,
        "run_dir": run.run_dir,
        "axes": run.axes,
        "config": run.config,
        "attempts": [
            {
                "number": a.number, "executor": a.executor, "state": a.state, "exit_reason": a.exit_reason,
                "job_id": a.job_id, "node": a.node, "resumed_from_step": a.resumed_from_step,
                "submitted_at": a.submitted_at, "started_at": a.started_at, "ended_at": a.ended_at,
                "stdout": a.stdout_path, "stderr": a.stderr_path, "provenance": a.provenance,
            }
            for a in attempts
        ],  # fmt: skip
        "checkpoints": [{"step": c.step, "path": c.path} for c in store.checkpoints(run.id)],
        "eval_points": [dataclasses.asdict(p) for p in store.eval_points(run.id)[-LAST_EVAL_POINTS:]],
        "provenance": latest,
        "hosts": (latest or {}).get("hosts") or [],
    }


@dataclass(frozen=True)
class RerunResult:
    run: str
    original: str
    sweep: str
    submitted: bool
    code_note: str | None
    """Set when the original's code commit differs from the code here."""


def rerun(store: Store, ref: str, *, seed: int | None = None) -> RerunResult:
    """Register a new run of `ref`'s sweep with its resolved config (seed replaced if given) and
    submit it with the sweep's executor."""
    original = store.get_run(ref)
    sweep = store.get_sweep(original.sweep)
    if sweep is None or not sweep.root_dir or sweep.executor == "import":
        raise NotFoundError(f"run {original.id} was imported, not run: there is no recipe config to rerun")
    config = _config(original, seed)
    run_id = _new_id(store, original, config)
    axes = dict(original.axes) | ({"seed": seed} if seed is not None and "seed" in original.axes else {})
    run_dir = Path(sweep.root_dir) / run_id
    info = _run_info(original)
    write_run_files(
        run_dir, run_id=run_id, sweep=sweep.name, db_url=store.url, config=config,
        sweep_file=info.get("sweep_file"), sweep_file_sha256=info.get("sweep_file_sha256"),
    )  # fmt: skip
    position = max((r.position for r in store.runs(sweep.name)), default=-1) + 1
    store.register_runs(sweep.name, [NewRun(run_id, position, config.to_dict(), axes, original.budget, str(run_dir))])
    claimed = store.claim_runs([run_id], [RunState.REGISTERED], uuid.uuid4().hex)
    runs = [r for r in store.runs(sweep.name, states=[RunState.SUBMITTING]) if r.id in claimed]
    submitted = bool(runs) and bool(_submit(store, runs, sweep.executor, max_parallel=None))
    return RerunResult(run_id, original.id, sweep.name, submitted, _code_note(store, original))


def _config(run: RunRecord, seed: int | None) -> RecipeConfig:
    try:
        config = RecipeConfig.from_dict(run.config)
        if seed is not None:
            config = RecipeConfig.from_dict(run.config | {"seed": seed})
    except ConfigError as exc:
        raise LaunchError(f"run {run.id}'s stored config no longer validates ({exc}); it cannot be rerun") from None
    return config


def _new_id(store: Store, original: RunRecord, config: RecipeConfig) -> str:
    """Reruns get ids of their own (the same config would hash to the original's id)."""
    for number in range(1, 10_000):
        body = f"{original.sweep}\n{canonical_json(config.to_dict())}\nrerun {number} of {original.id}"
        run_id = hashlib.sha256(body.encode()).hexdigest()[:12]
        try:
            store.get_run(run_id)
        except NotFoundError:
            return run_id
    raise LaunchError(f"run {original.id} has been rerun 9,999 times")  # pragma: no cover


def _run_info(run: RunRecord) -> dict[str, Any]:
    try:
        info, _ = read_run_files(run.run_dir)
    except (OSError, ValueError, json.JSONDecodeError):
        return {}
    return info


def _code_note(store: Store, original: RunRecord) -> str | None:
    recorded = next((a.provenance for a in reversed(store.attempts(original.id)) if a.provenance), None)
    then = (recorded or {}).get("code", {}).get("commit")
    now = code_version()["commit"]
    if then and now and then != now:
        return f"run {original.id} ran code commit {then[:12]}; this rerun runs {now[:12]}"
    return None


def task_log_path(path: str | None, task: int) -> str | None:
    """Task `task`'s log beside task 0's: each task of a Slurm job writes its own
    (submitit's `<job>_<task>_log.err`, `<array>_<index>_<task>_log.err`)."""
    if path is None or task == 0:
        return path
    match = re.search(r"_(\d+)_log\.(out|err)$", path)
    if match is None:
        raise NotFoundError(f"{path}: one log for the whole run (not a Slurm job's per-task log); --task {task} has none")
    return f"{path[: match.start(1)]}{task}{path[match.end(1):]}"
