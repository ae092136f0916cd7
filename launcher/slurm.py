"""Slurm: submit runs as job arrays through submitit, and track them with one sacct query.

Submission: runs are split into arrays of at most MaxArraySize tasks (the limit caps the array
index, so each array is indexed from 0), and no more runs go out than the submit limit
(MaxSubmitJobs) leaves room for; the rest stay `registered` and go out at the next `sweep launch`
or `sweep status`. Everything later commands need (job id, array index -> run, log paths) is in
the store, so `sweep launch` returns as soon as sbatch has accepted the arrays.

Tracking: `reconcile` asks sacct once for every active job of a sweep (squeue when accounting
is off) and writes what it learns into the runs and attempts.
"""

from __future__ import annotations

import getpass
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launcher.grid import RunPlan, SweepSpec
from store import ACTIVE_STATES, RunRecord, RunState, Store

EXECUTOR = "slurm"
SLURM_TIMEOUT_S = 60


class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries the command, its exit code and stderr."""


# ---------------------------------------------------------------------------------------------
# Running Slurm commands


def run_slurm(args: Sequence[str], *, check: bool = True) -> str:
    """Run a Slurm client command (never through a shell) and return its stdout."""
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise SlurmError(f"{args[0]} not found: is this a Slurm login node? ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"`{' '.join(args)}` did not answer within {SLURM_TIMEOUT_S} s") from exc
    if check and proc.returncode != 0:
        raise SlurmError(f"`{' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# Limits


@dataclass(frozen=True)
class Limits:
    max_array_size: int  # array indices run 0 .. max_array_size - 1
    max_submit_jobs: int | None  # per user, from the association or QOS; None: unlimited


def read_limits() -> Limits:
    config = run_slurm(["scontrol", "show", "config"])
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", config, re.MULTILINE)
    max_array = int(match.group(1)) if match else 1001
    return Limits(max_array_size=max_array, max_submit_jobs=_max_submit_jobs())


def _max_submit_jobs() -> int | None:
    """The smallest MaxSubmitJobs on the user's associations and MaxSubmitJobsPerUser on QOSes."""
    user = getpass.getuser()
    values: list[int] = []
    try:
        assoc = run_slurm(["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}", "format=MaxSubmit"])
        qos = run_slurm(["sacctmgr", "-n", "-P", "show", "qos", "format=MaxSubmitPU"])
    except SlurmError:
        return None  # no accounting: no association limits to respect
    for line in (assoc + qos).splitlines():
        if line.strip().isdigit():
            values.append(int(line.strip()))
    return min(values) if values else None


def _submitted_job_count() -> int:
    """Jobs of this user that count against MaxSubmitJobs (pending + running, array tasks each)."""
    out = run_slurm(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i"])
    return len(out.split())


# ---------------------------------------------------------------------------------------------
# Profiles and executor parameters


def executor_parameters(params: dict[str, Any], job_name: str) -> dict[str, Any]:
    """Our profile keys -> submitit's SlurmExecutor parameters."""
    out: dict[str, Any] = {
        "job_name": job_name,
        "nodes": params["nodes"],
        "ntasks_per_node": int(params.get("tasks_per_node", 1)),  # a run's generator and trainer ranks (recipe.pipeline)
        "cpus_per_task": params["cpus_per_task"],
        "time": int(params["timeout_min"]),
        "signal_delay_s": int(params["signal_delay_s"]),
        "array_parallelism": int(params["array_parallelism"]),
        "additional_parameters": {"requeue": True},
    }
    for ours, theirs in (
        ("partition", "partition"),
        ("account", "account"),
        ("qos", "qos"),
        ("constraint", "constraint"),
    ):
        if params.get(ours):
            out[theirs] = params[ours]
    if params.get("gpus_per_node"):
        out["gpus_per_node"] = params["gpus_per_node"]
    if params.get("mem_gb"):
        out["mem"] = f"{params['mem_gb']}GB"
    if params.get("setup"):
        out["setup"] = list(params["setup"])
    return out


def _executor(folder: Path, params: dict[str, Any], job_name: str) -> Any:
    import submitit

    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=1000)
    executor.update_parameters(**executor_parameters(params, job_name))
    return executor


def dry_run_script(spec: SweepSpec, plans: Sequence[RunPlan], *, root: Path) -> str:
    """The sbatch script `sweep launch --root ROOT` would submit for this sweep's runs (as one
    array; the launch splits it where the cluster's MaxArraySize is smaller). Built by the
    executor the submission uses, so the two cannot drift: paths are quoted as submitted."""
    executor = _executor(_log_folder(root / spec.name), spec.resources, spec.name)
    if len(plans) > 1:  # one run goes out as a plain job, several as an array
        executor.parameters["map_count"] = len(plans)  # as submitit does for an array
    return executor._make_submission_file_text(executor._submitit_command_str, uid="DRYRUN")


def _log_folder(sweep_dir: Path) -> Path:
    return sweep_dir / "slurm"


# ---------------------------------------------------------------------------------------------
# Submission


def submit(store: Store, runs: Sequence[RunRecord]) -> list[str]:
    """Submit as many runs as the limits allow, in arrays; return the ids submitted. The others
    go back to `registered` with the reason, for the next launch or status."""
    if not runs:
        return []
    sweep = store.get_sweep(runs[0].sweep)
    assert sweep is not None
    limits = read_limits()
    room = len(runs)
    if limits.max_submit_jobs is not None:
        room = max(0, min(room, limits.max_submit_jobs - _submitted_job_count()))
    now, later = list(runs[:room]), list(runs[room:])
    if later:
        reason = f"waiting: MaxSubmitJobs={limits.max_submit_jobs} reached"
        held = [r.id for r in later]
        store.set_runs_state(held, RunState.REGISTERED, only_from=[RunState.SUBMITTING], reason=reason)

    params = sweep.spec["resources"]
    folder = _log_folder(Path(sweep.root_dir))
    from launcher.job import run_recipe

    for start in range(0, len(now), limits.max_array_size):
        chunk = now[start : start + limits.max_array_size]
        executor = _executor(folder, params, sweep.name)
        with executor.batch():
            jobs = [executor.submit(run_recipe, run.run_dir) for run in chunk]
        store.record_submissions(EXECUTOR, [_submission(run, job) for run, job in zip(chunk, jobs)], RunState.PENDING)
    return [r.id for r in now]


def _submission(run: RunRecord, job: Any) -> dict[str, Any]:
    array_job_id, _, task = str(job.job_id).partition("_")
    return {
        "run_id": run.id,
        "job_id": str(job.job_id),
        "array_job_id": array_job_id if task else None,
        "array_index": int(task) if task else None,
        "stdout_path": str(job.paths.stdout),
        "stderr_path": str(job.paths.stderr),
    }


def submit_waiting(store: Store, sweep: str) -> list[str]:
    """Runs left `registered` by a submit limit go out now if there is room."""
    import uuid

    waiting = [
        r for r in store.runs(sweep, states=[RunState.REGISTERED]) if (r.state_reason or "").startswith("waiting")
    ]
    if not waiting:
        return []
    token = uuid.uuid4().hex
    claimed = set(store.claim_runs([r.id for r in waiting], [RunState.REGISTERED], token))
    return submit(store, [r for r in waiting if r.id in claimed])


# ---------------------------------------------------------------------------------------------
# Tracking


# sacct/squeue state -> our run state
STATE_MAP: dict[str, RunState] = {
    "PENDING": RunState.PENDING,
    "CONFIGURING": RunState.PENDING,
    "REQUEUED": RunState.PREEMPTED,
    "REQUEUE_HOLD": RunState.PREEMPTED,
    "REQUEUE_FED": RunState.PREEMPTED,
    "RESIZING": RunState.RUNNING,
    "RUNNING": RunState.RUNNING,
    "COMPLETING": RunState.RUNNING,
    "SUSPENDED": RunState.PENDING,
    "PREEMPTED": RunState.PREEMPTED,
    "COMPLETED": RunState.COMPLETED,
    "CANCELLED": RunState.CANCELLED,
    "TIMEOUT": RunState.TIMEOUT,
    "FAILED": RunState.FAILED,
    "NODE_FAIL": RunState.PREEMPTED,  # our jobs are submitted with --requeue: Slurm starts them again
    "OUT_OF_MEMORY": RunState.FAILED,
    "BOOT_FAIL": RunState.FAILED,
    "DEADLINE": RunState.TIMEOUT,
}


@dataclass(frozen=True)
class JobInfo:
    job_id: str  # "123" or "123_4"
    state: str  # Slurm's, e.g. "CANCELLED"
    exit_code: str  # "0:9": exit status : signal
    node: str | None
    start: datetime | None
    end: datetime | None
    reason: str | None


def query_jobs(job_ids: Sequence[str]) -> tuple[dict[str, JobInfo], str]:
    """One query for many jobs: sacct, or squeue when accounting is off. Returns the info by job
    id (array tasks as "ARRAY_INDEX") and the command used."""
    ids = sorted({j.split("_")[0] for j in job_ids})
    if not ids:
        return {}, ""
    fields = "JobID,State,ExitCode,NodeList,Start,End,Reason"
    args = ["sacct", "-X", "-n", "-P", f"--format={fields}", "-j", ",".join(ids)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    if proc.returncode == 0:
        return _parse_sacct(proc.stdout), "sacct"
    if (
        "accounting storage is disabled" not in proc.stderr
        and "Slurm accounting storage is disabled" not in proc.stderr
    ):
        raise SlurmError(f"`sacct` exited {proc.returncode}: {proc.stderr.strip()}")
    out = run_slurm(["squeue", "-h", "-r", "-o", "%i|%T|%N|%r", "-j", ",".join(ids)], check=False)
    return _parse_squeue(out), "squeue"


def _parse_sacct(text: str) -> dict[str, JobInfo]:
    out = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 7:
            continue
        job_id, state, exit_code, node, start, end, reason = parts[:7]
        for one in _array_tasks(job_id):
            out[one] = JobInfo(
                one,
                state.split()[0],
                exit_code,
                _none(node, "None assigned"),
                _time(start),
                _time(end),
                _none(reason, "None"),
            )
    return out


def _array_tasks(job_id: str) -> list[str]:
    """sacct shows the not-yet-started tasks of an array as one row, "12_[2-4,7%8]": expand it."""
    match = re.fullmatch(r"(\d+)_\[([0-9,\-]+)(?:%\d+)?\]", job_id)
    if match is None:
        return [job_id]
    base, spec = match.groups()
    tasks = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        tasks += [f"{base}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return tasks


def _parse_squeue(text: str) -> dict[str, JobInfo]:
    out = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) == 4:
            job_id, state, node, reason = parts
            out[job_id] = JobInfo(job_id, state, "0:0", _none(node, ""), None, None, _none(reason, "None"))
    return out


def _none(value: str, empty: str) -> str | None:
    value = value.strip()
    return None if not value or value == empty else value


def _time(value: str) -> datetime | None:
    value = value.strip()
    if not value or value in ("Unknown", "None"):
        return None
    return datetime.fromisoformat(value).astimezone(UTC)


def reconcile(store: Store, sweep: str) -> str:
    """Refresh the sweep's Slurm runs from one sacct (or squeue) query; return the command used.
    Whatever changed is written in one transaction per kind of change."""
    active = store.tracked_attempts(sweep, EXECUTOR)  # newest attempts with a job id, runs active
    infos, command = query_jobs([a.job_id for a in active]) if active else ({}, "")
    moves: dict[str, list[str]] = {}
    outcomes: list[tuple[int, str, str | None, dict[str, Any]]] = []
    for attempt in active:
        info = infos.get(attempt.job_id)
        if info is None:
            if command == "squeue":  # left the queue, and no accounting to say how
                reason = (
                    f"Slurm job {attempt.job_id} left the queue without reporting an end (accounting is off, so "
                    f"the cause is unknown) (log: {attempt.stderr_path})"
                )
                outcomes.append((attempt.id, RunState.FAILED, reason, {}))
            continue
        state = STATE_MAP.get(info.state, RunState.FAILED)
        if info.state == "NODE_FAIL" and attempt.run_state == RunState.RUNNING:
            # A node of the job died with the attempt's processes on it: that attempt is over,
            # and Slurm requeues the job, whose next start resumes from the newest checkpoint.
            reason = f"Slurm job {attempt.job_id}: {_describe(info)}; Slurm requeues it (log: {attempt.stderr_path})"
            outcomes.append((attempt.id, RunState.PREEMPTED, reason, {"node": info.node}))
        elif state in (RunState.PENDING, RunState.RUNNING, RunState.PREEMPTED):
            if attempt.run_state != state:
                moves.setdefault(state, []).append(attempt.run_id)
        elif attempt.run_state != RunState.COMPLETED:  # the recipe records its own completion; the rest is Slurm's word
            outcomes.append(
                (attempt.id, *_ended(info, attempt.stderr_path, state), {"ended_at": info.end, "node": info.node})
            )
    for moved_to, run_ids in moves.items():
        store.set_runs_state(run_ids, moved_to, only_from=ACTIVE_STATES)
    if outcomes:
        store.settle_attempts(outcomes)
    submit_waiting(store, sweep)
    return command


def _ended(info: JobInfo, log_path: str | None, state: str) -> tuple[str, str]:
    """(run state, reason) of a job that has ended without the run completing."""
    if state == RunState.COMPLETED:  # the job exited cleanly without finishing the run
        return RunState.FAILED, f"Slurm job {info.job_id} ended without completing the run (log: {log_path})"
    return state, f"Slurm job {info.job_id}: {_describe(info)} (log: {log_path})"


def _describe(info: JobInfo) -> str:
    status, _, sig = info.exit_code.partition(":")
    text = info.state
    if sig and sig != "0":
        text += f", killed by signal {sig} ({_signal_name(int(sig))})"
    elif status and status != "0":
        text += f", exit code {status}"
    if info.reason:
        text += f", reason {info.reason}"
    return text


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def cancel_jobs(job_ids: Sequence[str]) -> None:
    run_slurm(["scancel", *job_ids])
