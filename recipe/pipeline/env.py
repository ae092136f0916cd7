"""Which task of the job this is, the device it uses, and the trainers' own process group."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist

from recipe.config import Layout, RecipeConfig, check_layout
from recipe.loop.state import uses_vllm
from recipe.pipeline.placement import JobPlacement, SlurmView, device_of, place_job, slurm_view
from recipe.pipeline.rendezvous import Rendezvous

__all__ = ["uses_vllm"]  # resolved with the loop's colocation (`recipe.loop.state`); the roles import it here

log = logging.getLogger("recipe")

TRAINER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TaskEnv:
    """This task's place in the run's job."""

    rank: int
    num_tasks: int
    num_nodes: int
    local_rank: int
    attempt_key: str
    """Names this start of the job: the rendezvous of another start is never read."""

    @property
    def tasks_per_node(self) -> int:
        return self.num_tasks // self.num_nodes


def task_env(environ: Mapping[str, str] = os.environ) -> TaskEnv:
    """From srun's variables inside a Slurm job step, from submitit's local executor's
    (SUBMITIT_LOCAL_*: the same places, one node), from SWEEP_TASK_* when a test spawns the tasks
    itself, else one task."""
    if "SLURM_STEP_NUM_TASKS" in environ and "SLURM_PROCID" in environ:  # srun sets these, sbatch alone does not
        return TaskEnv(
            rank=int(environ["SLURM_PROCID"]),
            num_tasks=int(environ["SLURM_STEP_NUM_TASKS"]),
            num_nodes=int(environ.get("SLURM_STEP_NUM_NODES", "1")),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            attempt_key=f"slurm-{environ.get('SLURM_JOB_ID', '?')}-{environ.get('SLURM_RESTART_COUNT', '0')}",
        )
    if environ.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in environ:
        return TaskEnv(
            rank=int(environ["SUBMITIT_LOCAL_GLOBALID"]),
            num_tasks=int(environ["SUBMITIT_LOCAL_NTASKS"]),
            num_nodes=int(environ.get("SUBMITIT_LOCAL_JOB_NUM_NODES", "1")),
            local_rank=int(environ.get("SUBMITIT_LOCAL_LOCALID", "0")),
            attempt_key=f"local-{environ.get('SUBMITIT_LOCAL_JOB_ID', '?')}",  # the controller's pid: one per start
        )
    if "SWEEP_NUM_TASKS" in environ:
        rank = int(environ["SWEEP_TASK_RANK"])
        return TaskEnv(rank, int(environ["SWEEP_NUM_TASKS"]), 1, rank, environ.get("SWEEP_ATTEMPT", "local"))
    return TaskEnv(rank=0, num_tasks=1, num_nodes=1, local_rank=0, attempt_key="single")


def own_log_path() -> str | None:
    """This task's stderr file where submitit started it (local or Slurm), else None."""
    try:
        import submitit

        return str(submitit.JobEnvironment().paths.stderr)
    except Exception:  # noqa: BLE001 - not started by submitit (a test, `python -m recipe`)
        return None


def layout_of(cfg: RecipeConfig, env: TaskEnv) -> Layout:
    return check_layout(cfg, num_nodes=env.num_nodes, tasks_per_node=env.tasks_per_node)


def job_placement(env: TaskEnv, layout: Layout) -> JobPlacement:
    """Every task's GPU and the groups' backends (`recipe.pipeline.placement`), from what Slurm
    shows this task: per-task binding or not; tasks beyond a node's GPUs share them round robin."""
    return place_job(_slurm_view(env), layout.num_trainers)


def device_for(env: TaskEnv) -> torch.device:
    """This task's device (the same whatever its role)."""
    return torch.device(device_of(_slurm_view(env), env.rank)[0])


def _slurm_view(env: TaskEnv) -> SlurmView:
    return slurm_view(
        os.environ, num_nodes=env.num_nodes, tasks_per_node=env.tasks_per_node, device_count=torch.cuda.device_count()
    )


def join_trainer_group(env: TaskEnv, layout: Layout, rendezvous: Rendezvous, timeout_s: float) -> None:
    """The trainers' own default group; its variables are exported for engines that read them (DeepSpeed)."""
    os.environ.update(
        WORLD_SIZE=str(layout.num_trainers),
        RANK=str(env.rank),
        LOCAL_RANK=str(job_placement(env, layout).tasks[env.rank].local_rank),  # cuda:LOCAL_RANK is its GPU
        MASTER_ADDR=rendezvous.host,
        MASTER_PORT=str(rendezvous.trainer_port),
    )
    if torch.cuda.is_available():  # the policy goes to the current device (`recipe.loop.state.policy_device`)
        torch.cuda.set_device(device_for(env))
    dist.init_process_group(rendezvous.backend, init_method="env://", timeout=timedelta(seconds=timeout_s))


def leave_trainer_env() -> None:
    """A generator is in no trainer group: engines must not find one in its environment."""
    for key in TRAINER_ENV:
        os.environ.pop(key, None)


def ignore_stop_signals() -> None:
    """Trainer rank 0 decides when the run stops; the other tasks only note Slurm's signals."""

    def note(signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: trainer rank 0 checkpoints and stops the run", signal.Signals(signum).name)

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, note)
