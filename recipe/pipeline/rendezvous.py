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

RENDEZVOUS_FILE = "rendezvous.json"


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("": every interface), for a listener that binds it soon after."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
