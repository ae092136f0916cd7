"""Which GPU each task of a run's job uses, read from what Slurm gives it (torch-free, pure).

A run is one job of `nodes` x `tasks_per_node` tasks: trainer ranks 0..T-1, then the generators
(`recipe.config.Layout`), placed by Slurm's block distribution (task r on node r // tasks_per_node,
`SLURM_LOCALID` = r % tasks_per_node). Slurm shows a task its GPUs in one of two ways:

- **Unbound** (`--gpus-per-node N`, `--gres=gpu:N`, what the launcher asks for): every task of a
  node sees all N GPUs (`CUDA_VISIBLE_DEVICES=0,..,N-1`, or the node's own ids). Task l uses the
  l-th of them (round robin when a node runs more tasks than it has GPUs: a one-GPU check).
- **Bound** (`--gpus-per-task 1`, `--gpu-bind=single:1`): every task sees only its own GPU; with
  Slurm's device cgroups that GPU is renumbered, so every task sees `CUDA_VISIBLE_DEVICES=0`.
  A task is bound when Slurm says so (`SLURM_GPUS_PER_TASK`) or when it sees fewer GPUs than
  its node holds (`SLURM_GPUS_ON_NODE`).

From that, per task (`TaskPlacement`): its device (the index among the GPUs its process sees),
`LOCAL_RANK` equal to that index (DeepSpeed and vLLM pick `cuda:LOCAL_RANK`, so under binding it
is 0, never `SLURM_LOCALID`), the GPU it really occupies (node and physical id, to tell sharing
apart), and the `CUDA_VISIBLE_DEVICES` to give an engine that starts processes of its own: a vLLM
generator sees exactly its GPU, so each generator runs on its own GPU and never on the trainer's.

Per job (`JobPlacement`): the backend of each process group. NCCL refuses two ranks of one group
on one GPU, so a group is NCCL only when its ranks occupy distinct GPUs, else gloo (which moves
CUDA tensors through host memory): the trainers' group (ranks 0..T-1) and the weight group
(trainer rank 0 + every generator). Every task computes the same job placement from its own
environment (Slurm allocates nodes alike), so no task needs to ask another.

No torch here: the caller passes the number of GPUs its process sees when `CUDA_VISIBLE_DEVICES`
is unset (`torch.cuda.device_count()`), and the table test (tests/test_placement.py) runs every
layout without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SlurmView:
    """What one task is told about GPUs: the facts placement is computed from."""

    num_nodes: int
    tasks_per_node: int
    visible: tuple[str, ...]
    """The GPU ids this task's process sees (`CUDA_VISIBLE_DEVICES`, or 0..n-1 when unset); () on CPU."""
    gpus_on_node: int | None
    """GPUs the job holds on each node (`SLURM_GPUS_ON_NODE`); None when Slurm does not say."""
    gpus_per_task: int | None
    """`SLURM_GPUS_PER_TASK` (`--gpus-per-task`); None when not bound that way."""

    @property
    def bound(self) -> bool:
        """Each task sees only its own GPU(s), not the node's."""
        if not self.visible:
            return False
        if self.gpus_per_task is not None:
            return True
        return self.gpus_on_node is not None and len(self.visible) < self.gpus_on_node


@dataclass(frozen=True)
class TaskPlacement:
    """Where one task runs."""

    rank: int
    node: int
    local_id: int
    """`SLURM_LOCALID`: the task's index on its node."""
    role: str
    """"trainer" or "generator"."""
    device: str
    """"cpu", or "cuda:I" with I an index among the GPUs this task's process sees."""
    gpu: tuple[int, str] | None
    """The GPU the task occupies, as (node, id) unique per physical GPU; None on CPU."""
    visible_devices: str | None
    """`CUDA_VISIBLE_DEVICES` for the processes a generator's engine starts (vLLM's engine core,
    which takes its cuda:0): just the task's GPU. None: leave the variable as it is (trainers, CPU,
    or Slurm already bound the task). The task's own process keeps `device` (its CUDA may be up)."""

    @property
    def local_rank(self) -> int:
        """`LOCAL_RANK`: the device index, so that `cuda:LOCAL_RANK` is the task's GPU."""
        return int(self.device.split(":")[1]) if self.device.startswith("cuda:") else 0

    @property
    def on_gpu(self) -> bool:
        return self.gpu is not None


@dataclass(frozen=True)
class JobPlacement:
    """Every task's placement, and the backend of each process group."""

    tasks: tuple[TaskPlacement, ...]
    num_trainers: int

    @property
    def trainers(self) -> tuple[TaskPlacement, ...]:
        return self.tasks[: self.num_trainers]

    @property
    def weight_group(self) -> tuple[TaskPlacement, ...]:
        """Trainer rank 0, then generator i as rank 1 + i (`recipe.engines.weights`)."""
        return (self.tasks[0], *self.tasks[self.num_trainers :])

    @property
    def trainer_backend(self) -> str:
        return group_backend(self.trainers)

    @property
    def weight_backend(self) -> str:
        return group_backend(self.weight_group)

    @property
    def num_gpus(self) -> int:
        """Distinct GPUs the job's tasks occupy (what a second of a step costs in GPU-seconds)."""
        return len({t.gpu for t in self.tasks if t.gpu is not None})


def group_backend(members: tuple[TaskPlacement, ...]) -> str:
    """nccl when every member is on a GPU of its own, else gloo (CPU, or ranks sharing a GPU)."""
    gpus = [t.gpu for t in members]
    if any(g is None for g in gpus) or len(set(gpus)) < len(gpus):
        return "gloo"
    return "nccl"


def slurm_view(environ: Mapping[str, str], *, num_nodes: int, tasks_per_node: int, device_count: int) -> SlurmView:
    """The GPU facts of this task's environment. `device_count`: GPUs the process sees, used only
    when `CUDA_VISIBLE_DEVICES` is unset (0 on a machine without CUDA)."""
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        visible = tuple(str(i) for i in range(device_count))
    else:
        visible = tuple(v.strip() for v in raw.split(",") if v.strip() and v.strip() != "-1")
    if device_count == 0:
        visible = ()  # no CUDA in this Python (a CPU build of torch): whatever Slurm says
    return SlurmView(
        num_nodes=num_nodes,
        tasks_per_node=tasks_per_node,
        visible=visible,
        gpus_on_node=_count(environ.get("SLURM_GPUS_ON_NODE")),
        gpus_per_task=_count(environ.get("SLURM_GPUS_PER_TASK")),
    )


def _count(value: str | None) -> int | None:
    """'4', or Slurm's typed form 'h100:4'."""
    if not value:
        return None
    try:
        return int(value.rsplit(":", 1)[-1])
    except ValueError:
        return None


def place_job(view: SlurmView, num_trainers: int) -> JobPlacement:
    """Every task's placement in a job whose nodes all look like `view` (Slurm allocates alike)."""
    num_tasks = view.num_nodes * view.tasks_per_node
    if not 0 < num_trainers <= num_tasks:
        raise ValueError(f"num_trainers must be in [1, {num_tasks}], got {num_trainers}")
    tasks = tuple(_place_task(view, rank, num_trainers) for rank in range(num_tasks))
    return JobPlacement(tasks, num_trainers)


def _place_task(view: SlurmView, rank: int, num_trainers: int) -> TaskPlacement:
    node, local_id = divmod(rank, view.tasks_per_node)
    device, gpu = device_of(view, rank)
    if rank < num_trainers:
        return TaskPlacement(rank, node, local_id, "trainer", device, gpu, None)
    # A generator's engine processes (vLLM's engine core) see only its GPU and take their cuda:0.
    visible = gpu[1] if gpu is not None and not view.bound else None
    return TaskPlacement(rank, node, local_id, "generator", device, gpu, visible)


def device_of(view: SlurmView, rank: int) -> tuple[str, tuple[int, str] | None]:
    """Task `rank`'s device in its own process and the GPU it occupies (whatever its role)."""
    node, local_id = divmod(rank, view.tasks_per_node)
    if not view.visible:
        return "cpu", None
    if view.bound:
        # Slurm gave this task GPU(s) of its own: its first, whatever it is numbered inside the task.
        return "cuda:0", (node, f"task{local_id}")
    index = local_id % len(view.visible)
    return f"cuda:{index}", (node, view.visible[index])
