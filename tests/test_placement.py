"""Placement that follows Slurm (`recipe.pipeline.placement`): a table of job layouts, every task.

Each task's environment is built as Slurm gives it (`SLURM_LOCALID`, `CUDA_VISIBLE_DEVICES` with
and without per-task binding, `SLURM_GPUS_ON_NODE`, `SLURM_GPUS_PER_TASK`); every task computes
the job's placement from its own environment alone. Pure functions: no GPU needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from recipe.pipeline.placement import TaskPlacement, group_backend, place_job, slurm_view


@dataclass(frozen=True)
class Layout:
    name: str
    nodes: int
    tasks_per_node: int
    generators: int
    gpus_per_node: int
    binding: str
    """"none": every task sees the node's GPUs; "cgroup": --gpus-per-task 1 with device cgroups
    (every task sees CUDA_VISIBLE_DEVICES=0); "ids": --gpu-bind=single:1 without cgroups (each task
    sees its own physical id)."""
    node_gpu_ids: tuple[str, ...] | None = None
    """The ids an unbound task sees (default 0..n-1)."""
    expected_devices: tuple[str, ...] = ()
    expected_trainer_backend: str = "nccl"
    expected_weight_backend: str = "nccl"

    @property
    def num_tasks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def num_trainers(self) -> int:
        return self.num_tasks - self.generators


def slurm_env(layout: Layout, rank: int) -> dict[str, str]:
    """The variables srun sets in task `rank` (block distribution)."""
    node, local_id = divmod(rank, layout.tasks_per_node)
    env = {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local_id),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_TASKS": str(layout.num_tasks),
        "SLURM_STEP_NUM_NODES": str(layout.nodes),
    }
    if layout.gpus_per_node == 0:
        return env
    env["SLURM_GPUS_ON_NODE"] = str(layout.gpus_per_node)
    if layout.binding == "none":
        ids = layout.node_gpu_ids or tuple(str(i) for i in range(layout.gpus_per_node))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    elif layout.binding == "cgroup":
        env["CUDA_VISIBLE_DEVICES"] = "0"
        env["SLURM_GPUS_PER_TASK"] = "1"
    elif layout.binding == "ids":
        env["CUDA_VISIBLE_DEVICES"] = str(local_id)
    return env


def cuda(*indices: int) -> tuple[str, ...]:
    return tuple(f"cuda:{i}" for i in indices)


LAYOUTS = [
    Layout("1x8, 2 generators, unbound", 1, 8, 2, 8, "none", expected_devices=cuda(0, 1, 2, 3, 4, 5, 6, 7)),
    Layout("1x8, 2 generators, --gpus-per-task cgroups", 1, 8, 2, 8, "cgroup", expected_devices=cuda(*[0] * 8)),
    Layout("1x8, 2 generators, --gpu-bind single", 1, 8, 2, 8, "ids", expected_devices=cuda(*[0] * 8)),
    Layout("2x4, 4 generators, unbound", 2, 4, 4, 4, "none", expected_devices=cuda(0, 1, 2, 3) * 2),
    Layout("2x4, 1 generator, unbound", 2, 4, 1, 4, "none", expected_devices=cuda(0, 1, 2, 3) * 2),
    Layout("2x4, 4 generators, cgroups", 2, 4, 4, 4, "cgroup", expected_devices=cuda(*[0] * 8)),
    Layout(
        "2x4 on a node's upper GPUs, unbound", 2, 4, 4, 4, "none",
        node_gpu_ids=("4", "5", "6", "7"), expected_devices=cuda(0, 1, 2, 3) * 2,
    ),  # fmt: skip
    Layout("1 GPU, one task (colocated)", 1, 1, 0, 1, "none", expected_devices=cuda(0)),
    Layout(
        "1 GPU, trainer + generator (one-GPU check)", 1, 2, 1, 1, "none",
        expected_devices=cuda(0, 0), expected_weight_backend="gloo",
    ),  # fmt: skip
    Layout(
        "1x2 GPUs, 4 tasks, round robin", 1, 4, 2, 2, "none",
        expected_devices=cuda(0, 1, 0, 1), expected_weight_backend="gloo",
    ),  # fmt: skip
    Layout(
        "1x2 GPUs, 3 trainers share", 1, 3, 0, 2, "none",
        expected_devices=cuda(0, 1, 0), expected_trainer_backend="gloo",
    ),  # fmt: skip
    Layout(
        "CPU, 1x3", 1, 3, 1, 0, "none",
        expected_devices=("cpu",) * 3, expected_trainer_backend="gloo", expected_weight_backend="gloo",
    ),  # fmt: skip
]


def place(layout: Layout, rank: int):
    env = slurm_env(layout, rank)
    # A task's torch counts what CUDA_VISIBLE_DEVICES shows it (every GPU of the node when unset).
    shown = len(env["CUDA_VISIBLE_DEVICES"].split(",")) if "CUDA_VISIBLE_DEVICES" in env else layout.gpus_per_node
    view = slurm_view(env, num_nodes=layout.nodes, tasks_per_node=layout.tasks_per_node, device_count=shown)
    return place_job(view, layout.num_trainers)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_every_task_of_a_layout(layout: Layout) -> None:
    jobs = [place(layout, rank) for rank in range(layout.num_tasks)]
    mine: list[TaskPlacement] = [job.tasks[rank] for rank, job in enumerate(jobs)]

    # Each task's device, and LOCAL_RANK naming that device.
    assert tuple(t.device for t in mine) == layout.expected_devices
    for t in mine:
        assert t.local_rank == (int(t.device.split(":")[1]) if t.on_gpu else 0)
        assert t.role == ("trainer" if t.rank < layout.num_trainers else "generator")

    # Every task agrees on the group backends (they are decided per job, from one task's view).
    assert {(job.trainer_backend, job.weight_backend) for job in jobs} == {
        (layout.expected_trainer_backend, layout.expected_weight_backend)
    }
    job = jobs[0]
    assert job.tasks == tuple(mine)

    # No two ranks of an NCCL group share a GPU.
    for members, backend in ((job.trainers, job.trainer_backend), (job.weight_group, job.weight_backend)):
        if backend == "nccl":
            gpus = [t.gpu for t in members]
            assert None not in gpus and len(set(gpus)) == len(gpus), (layout.name, gpus)

    # With a GPU per task, each generator is on a GPU of its own, none a trainer's.
    if layout.gpus_per_node >= layout.tasks_per_node:
        generators = job.tasks[layout.num_trainers :]
        trainer_gpus = {t.gpu for t in job.trainers}
        assert len({g.gpu for g in generators}) == len(generators)
        assert not trainer_gpus & {g.gpu for g in generators}
        assert job.num_gpus == layout.num_tasks


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x.binding == "none" and x.gpus_per_node], ids=lambda x: x.name)
def test_unbound_generators_see_only_their_gpu(layout: Layout) -> None:
    """vLLM's engine core takes its cuda:0: it is given exactly the generator's GPU."""
    for rank in range(layout.num_trainers, layout.num_tasks):
        t = place(layout, rank).tasks[rank]
        visible = slurm_env(layout, rank)["CUDA_VISIBLE_DEVICES"].split(",")
        assert t.visible_devices == visible[t.local_rank] == t.gpu[1]
    for rank in range(layout.num_trainers):
        assert place(layout, rank).tasks[rank].visible_devices is None


def test_bound_tasks_keep_what_slurm_set() -> None:
    layout = LAYOUTS[1]
    for rank in range(layout.num_tasks):
        t = place(layout, rank).tasks[rank]
        assert t.visible_devices is None and t.local_rank == 0
        assert t.local_rank != int(slurm_env(layout, rank)["SLURM_LOCALID"]) or rank == 0


def test_binding_is_told_apart_from_one_shared_gpu() -> None:
    """Both show CUDA_VISIBLE_DEVICES=0 in every task: only Slurm's counts tell them apart."""
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    shared = slurm_view(env | {"SLURM_GPUS_ON_NODE": "1"}, num_nodes=1, tasks_per_node=2, device_count=1)
    bound = slurm_view(env | {"SLURM_GPUS_ON_NODE": "h200:2"}, num_nodes=1, tasks_per_node=2, device_count=1)
    assert not shared.bound and bound.bound
    assert place_job(shared, 1).weight_backend == "gloo"
    assert place_job(bound, 1).weight_backend == "nccl"


def test_unset_visible_devices_counts_what_the_process_sees() -> None:
    view = slurm_view({}, num_nodes=1, tasks_per_node=2, device_count=2)
    assert view.visible == ("0", "1")
    assert [t.device for t in place_job(view, 1).tasks] == ["cuda:0", "cuda:1"]
    cpu = slurm_view({"CUDA_VISIBLE_DEVICES": "0,1"}, num_nodes=1, tasks_per_node=2, device_count=0)
    assert [t.device for t in place_job(cpu, 1).tasks] == ["cpu", "cpu"]


def test_group_backend_of_no_gpu_or_shared_gpu_is_gloo() -> None:
    a = TaskPlacement(0, 0, 0, "trainer", "cuda:0", (0, "0"), None)
    b = TaskPlacement(1, 0, 1, "generator", "cuda:0", (0, "0"), "0")
    c = TaskPlacement(2, 1, 0, "generator", "cuda:0", (1, "0"), "0")
    assert group_backend((a, c)) == "nccl"
    assert group_backend((a, b)) == "gloo"
    assert group_backend((a, TaskPlacement(1, 0, 1, "generator", "cpu", None, None))) == "gloo"


def test_place_job_refuses_a_layout_without_trainers() -> None:
    view = slurm_view({}, num_nodes=1, tasks_per_node=2, device_count=0)
    with pytest.raises(ValueError, match="num_trainers"):
        place_job(view, 0)


def test_the_roles_place_tasks_by_slurms_view_fake_gpu(monkeypatch):
    """`recipe.pipeline.env` reads this task's environment and torch's GPU count (faked: no GPU here)."""
    import torch

    from recipe.pipeline import env as roles
    from recipe.config import Layout as RunLayout

    layout = LAYOUTS[1]  # 1 x 8, two generators, --gpus-per-task with cgroups
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for rank in (0, 5, 7):
        for key, value in slurm_env(layout, rank).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("SLURM_JOB_ID", "42")
        env = roles.task_env()
        assert env.local_rank == rank  # SLURM_LOCALID ...
        job = roles.job_placement(env, RunLayout(1, 8, 2))
        assert str(roles.device_for(env)) == "cuda:0" == job.tasks[rank].device  # ... is not the device
        assert job.tasks[rank].local_rank == 0
        assert (job.trainer_backend, job.weight_backend, job.num_gpus) == ("nccl", "nccl", 8)
