"""How the tasks meet: trainer rank 0 picks the ports and writes them to RUN_DIR/rendezvous.json
under the attempt's key (Slurm job id and restart count); every other task waits for that file.
A requeued job is a new attempt with a new key, so nobody reads a stale file. Stdlib only."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RENDEZVOUS_FILE = "rendezvous.json"
TASKS_DIR = "tasks"


@dataclass(frozen=True)
class Rendezvous:
    attempt_key: str
    host: str
    control_port: int
    trainer_port: int
    weight_port: int
    backend: str
    """The trainers' own group: NCCL with one GPU per task, else gloo."""
    weight_backend: str
    """The weight group's: NCCL unless its ranks share a GPU (NCCL refuses two ranks on one
    device), then gloo, which broadcasts CUDA tensors through host memory."""

    @property
    def control_address(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"


def withdraw(run_dir: Path, attempt_key: str) -> None:
    """Remove this attempt's rendezvous (at the end of the run): nobody joins a run that is over."""
    path = run_dir / RENDEZVOUS_FILE
    try:
        if json.loads(path.read_text()).get("attempt_key") == attempt_key:
            path.unlink()
    except (OSError, ValueError):
        pass


def publish(run_dir: Path, rendezvous: Rendezvous) -> None:
    path = run_dir / RENDEZVOUS_FILE
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(asdict(rendezvous)))
    os.replace(staging, path)


def wait_for_rendezvous(run_dir: Path, attempt_key: str, timeout_s: float) -> Rendezvous:
    """Trainer rank 0's rendezvous for this attempt, once it has written it."""
    path = run_dir / RENDEZVOUS_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if data.get("attempt_key") == attempt_key:
            return Rendezvous(**data)
        time.sleep(0.2)
    raise TimeoutError(
        f"trainer rank 0 wrote no rendezvous for attempt {attempt_key} in {path} within {timeout_s:.0f} s"
    )


def rendezvous_host(num_nodes: int) -> str:
    """Trainer rank 0's address for the others: the name Slurm gives its node (the first of the
    job's node list), else the machine's name. In a job that spans nodes a name that resolves to a
    loopback address could never be reached from another node: refused here, saying so."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if num_nodes > 1:
        try:
            address = socket.gethostbyname(host)
        except OSError as exc:
            raise RuntimeError(f"trainer rank 0's node name {host!r} does not resolve ({exc}); no other node could reach it") from exc
        if address.startswith("127."):
            raise RuntimeError(
                f"trainer rank 0's node name {host!r} resolves to the loopback address {address}: the other nodes of "
                "this job could never reach it; make Slurm's node names resolve to the nodes' cluster addresses"
            )
    return host


def announce(run_dir: Path, attempt_key: str, task: int, role: str, rank: int) -> None:
    """Record where this task runs (RUN_DIR/tasks/ATTEMPT/TASK.json), for trainer rank 0's provenance."""
    folder = run_dir / TASKS_DIR / attempt_key
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"task": task, "role": role, "rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
    staging = folder / f".{task}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(entry))
    os.replace(staging, folder / f"{task}.json")


def task_hosts(run_dir: Path, attempt_key: str) -> list[dict[str, Any]]:
    """Every task that announced itself in this attempt, in task order."""
    entries = []
    for path in (run_dir / TASKS_DIR / attempt_key).glob("*.json"):
        try:
            entries.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(entries, key=lambda e: e["task"])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("": every interface), for a listener that binds it soon after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
