"""`sweep launch`: register a sweep's runs and submit the ones that are not done.

Idempotent: run ids are hashes of resolved configs, so launching the same grid again registers
nothing and submits nothing; runs are claimed atomically before submission, so two launches of one
grid at once submit each run once.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launcher import local
from launcher.grid import RunPlan, SweepSpec
from launcher.preflight import check_root
from recipe.config import RUN_FILE, write_run_files
from recipe.telemetry.provenance import file_sha256
from store import RETRYABLE_STATES, AttemptState, NewRun, RunRecord, RunState, Store
from store.urls import mask_url

EXECUTORS = ("slurm", "local", "debug")


class LaunchError(RuntimeError):
    """Submission failed; nothing was left half-submitted."""


@dataclass(frozen=True)
class LaunchResult:
    sweep: str
    sweep_dir: str
    executor: str
    num_runs: int
    new: list[str]
    submitted: list[str]
    extended: list[str] = field(default_factory=list)  # completed runs whose budget was raised
    waiting: int = 0  # held back by a submit limit; they go out at the next launch or status
    resumed: list[tuple[str, int | None]] = field(default_factory=list)
    """Pruned runs resubmitted by --resume-pruned, with the checkpoint step they resume from."""


def default_executor() -> str:
    return "slurm" if shutil.which("sbatch") else "local"


def default_root() -> Path:
    return Path(os.environ.get("SWEEP_ROOT", "runs")).resolve()


def launch(
    store: Store,
    spec: SweepSpec,
    plans: Sequence[RunPlan],
    *,
    executor: str,
    root: Path | None = None,
    retry_failed: bool = False,
    resume_pruned: bool = False,
    max_parallel: int | None = None,
) -> LaunchResult:
    """Register the plans' new runs and submit those not done. `retry_failed` also resubmits
    failed, timed-out and cancelled runs; `resume_pruned` the runs the sweep's prune policy
    stopped, which are exempt from it from then on. Resubmitted runs resume from their newest
    checkpoint."""
    if executor not in EXECUTORS:
        raise LaunchError(f"unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}")
    existing_sweep = store.get_sweep(spec.name)
    sweep_dir = (
        Path(existing_sweep.root_dir) if existing_sweep and root is None else (root or default_root()) / spec.name
    )
    check_root(sweep_dir)  # before the sweep is registered with it for good

    known = {r.id: r for r in store.runs(spec.name)} if existing_sweep else {}
    fresh = [p for p in plans if p.id not in known]
    sweep_file = str(Path(spec.path).resolve())
    sweep_sha = file_sha256(spec.path)
    for plan in fresh:
        check_not_another_stores(sweep_dir / plan.id, store)
    resolved = [plan.config.to_dict() for plan in fresh]
    for plan, config in zip(fresh, resolved, strict=True):  # files first: a job must never start without them
        try:
            write_run_files(
                sweep_dir / plan.id, run_id=plan.id, sweep=spec.name, db_url=store.url, config=config,
                sweep_file=sweep_file, sweep_file_sha256=sweep_sha,
            )  # fmt: skip
        except OSError as exc:  # a file where the run directory goes, a root like /proc: nothing registered
            where = f": {exc.filename}" if exc.filename else ""
            raise LaunchError(
                f"cannot write run {plan.id}'s directory under {sweep_dir} ({exc.strerror or exc}{where}); "
                "give another --root"
            ) from None
    # the sweep and its new runs in one transaction: a failure leaves no sweep without its runs
    new = store.register_sweep(
        spec.name, {"file": spec.path, "grid": spec.raw, "resources": spec.resources}, str(sweep_dir), executor,
        [NewRun(p.id, p.position, c, p.axes, p.budget, str(sweep_dir / p.id)) for p, c in zip(fresh, resolved, strict=True)],
    )  # fmt: skip
    extended = _update_budgets(store, spec.name, plans, known)

    from_states = [RunState.REGISTERED, *(RETRYABLE_STATES if retry_failed else ())]
    wanted = [p.id for p in plans if p.id not in known or known[p.id].state in from_states]
    token = uuid.uuid4().hex
    claimed = store.claim_runs(wanted, from_states, token) + store.claim_runs(extended, [RunState.COMPLETED], token)
    resumed: list[tuple[str, int | None]] = []
    if resume_pruned:
        pruned = [p.id for p in plans if p.id in known and known[p.id].state == RunState.PRUNED]
        won = store.claim_pruned_runs(pruned, token)
        claimed += list(won)
        resumed = [(run_id, _newest_checkpoint(store, run_id)) for run_id in won]
    submitted: list[str] = []
    if claimed:
        mine = set(claimed)
        runs = [r for r in store.runs(spec.name, states=[RunState.SUBMITTING]) if r.id in mine]
        submitted = _submit(store, runs, executor, max_parallel=max_parallel)
    elif executor == "local":
        local.ensure_scheduler(store, max_parallel=max_parallel)
    waiting = len(claimed) - len(submitted)
    return LaunchResult(spec.name, str(sweep_dir), executor, len(plans), new, submitted, extended, waiting, resumed)


def check_not_another_stores(run_dir: Path, store: Store) -> None:
    """A run new to this store must not take over a directory that holds another store's
    checkpoints: its job would resume them (at the end of the budget, say), record nothing here,
    and settle as completed. The same sweep launched against two stores needs two roots."""
    try:
        info = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return
    other = info.get("db_url") if isinstance(info, dict) else None
    if other in (None, store.url) or not any((run_dir / "checkpoints").glob("*.pt")):
        return
    raise LaunchError(
        f"run directory {run_dir} holds the checkpoints of run {info.get('run_id')} recorded in another store "
        f"({mask_url(str(other))}); a run new to {store.display_url} would resume them and record nothing: "
        "give this store its own --root (or SWEEP_ROOT), or remove that directory"
    )


def _newest_checkpoint(store: Store, run_id: str) -> int | None:
    checkpoints = store.checkpoints(run_id)
    return checkpoints[-1].step if checkpoints else None


def _update_budgets(store: Store, sweep: str, plans: Sequence[RunPlan], known: dict[str, RunRecord]) -> list[str]:
    """A changed budget is written to the run (and its config.yaml); completed runs whose budget
    changed are returned, to be submitted again: they resume from their last checkpoint."""
    extended = []
    for plan in plans:
        run = known.get(plan.id)
        if run is None or run.budget == plan.budget:
            continue
        store.set_run_budget(run.id, plan.budget, plan.config.to_dict())
        write_run_files(run.run_dir, run_id=run.id, sweep=sweep, db_url=store.url, config=plan.config)
        if run.state == RunState.COMPLETED:
            extended.append(run.id)
    return extended


def _submit(store: Store, runs: list[RunRecord], executor: str, *, max_parallel: int | None) -> list[str]:
    """Submit; return the ids that went out (a Slurm submit limit may hold some back)."""
    try:
        if executor == "local":
            local.submit(store, runs, max_parallel=max_parallel)
        elif executor == "debug":
            _run_in_process(store, runs)
        else:
            from launcher import slurm

            return slurm.submit(store, runs)
    except Exception as exc:  # nothing stays claimed by a launch that failed
        ids = [r.id for r in runs]
        reason = f"submission failed: {exc}"
        store.set_runs_state(ids, RunState.REGISTERED, only_from=[RunState.SUBMITTING], reason=reason)
        raise LaunchError(f"submitting {len(runs)} runs with the {executor} executor failed: {exc}") from exc
    return [r.id for r in runs]


def _run_in_process(store: Store, runs: list[RunRecord]) -> None:
    """`--cluster debug`: run each job here, one after the other (for pdb and quick checks)."""
    from launcher.job import run_recipe

    for run in runs:
        store.add_attempt(run.id, "debug", state=AttemptState.QUEUED)
        store.set_run_state(run.id, RunState.QUEUED)
        run_recipe(run.run_dir)
