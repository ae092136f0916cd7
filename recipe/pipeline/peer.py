"""The run's other tasks: trainer ranks 1..T-1 follow trainer rank 0's steps; generators stream
the groups it admits and take every weight push, until it says stop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipe.config import Layout, RecipeConfig
from recipe.engines.base import Group, Trainer
from recipe.engines.weights import WeightGroupSpec
from recipe.loop import checkpoint
from recipe.loop.state import build_optimizer, build_trainer
from recipe.model.policy import load_policy
from recipe.pipeline.env import (
    TaskEnv,
    device_for,
    ignore_stop_signals,
    job_placement,
    join_trainer_group,
    layout_of,
    leave_trainer_env,
    own_log_path,
    uses_vllm,
)
from recipe.pipeline.rendezvous import Rendezvous, announce, wait_for_rendezvous
from recipe.pipeline.transport import ControlClient, PeerLost, group_to_wire, interrupt_from_wire, meta_from_wire
from recipe.tasks.builtin import resolve_model_dir


def run_peer(cfg: RecipeConfig, run_dir: Path, env: TaskEnv, log: Callable[[str], None]) -> str:
    """Task `env.rank` > 0 of a multi-task run: a trainer follower or a generator."""
    ignore_stop_signals()
    layout = layout_of(cfg, env)
    rendezvous = wait_for_rendezvous(run_dir, env.attempt_key, cfg.engine.peer_timeout_s)
    torch.set_num_threads(cfg.engine.threads)
    if layout.is_trainer(env.rank):
        announce(run_dir, env.attempt_key, env.rank, "trainer", env.rank)
        run_trainer_follower(cfg, env, layout, rendezvous, log)
        return f"trainer rank {env.rank} done"
    announce(run_dir, env.attempt_key, env.rank, "generator", layout.generator_index(env.rank))
    run_generator(cfg, layout, rendezvous, env, log)
    return f"generator {layout.generator_index(env.rank)} done"


def run_trainer_follower(
    cfg: RecipeConfig, env: TaskEnv, layout: Layout, rendezvous: Rendezvous, log: Callable[[str], None]
) -> None:
    join_trainer_group(env, layout, rendezvous, cfg.engine.peer_timeout_s)
    try:
        torch.manual_seed(cfg.seed)
        model, _ = load_policy(
            resolve_model_dir(cfg.model.path, log), dtype=cfg.model.dtype, lm_head_fp32=cfg.precision.lm_head_fp32
        )
        trainer = build_trainer(cfg, model, build_optimizer(cfg, model))
        log(f"trainer rank {env.rank} of {layout.num_trainers}: following trainer rank 0")
        follow(trainer)
    finally:
        dist.destroy_process_group()


def follow(trainer: Trainer) -> None:
    """Trainer ranks 1..T-1: take every collective call trainer rank 0 sends, until it says stop."""
    while True:
        command: list[Any] = [None]
        dist.broadcast_object_list(command, src=0)
        name, *args = command[0]
        if name == "stop":
            return
        if name == "step":
            trainer.step(args[0], lr=args[1])
        elif name == "state_dict":
            trainer.state_dict()
        elif name == "load_checkpoint":
            path = Path(args[0])
            trainer.load_state_dict(checkpoint.read_trainer_state(path), path=path)
        else:
            raise RuntimeError(f"unknown command {name!r} from trainer rank 0")


def build_generator(
    cfg: RecipeConfig, env: TaskEnv, log: Callable[[str], None], layout: Layout | None = None
) -> Any:
    """`engine.generator`'s streaming engine, holding the model directory's weights, on this
    task's GPU (`job_placement`; `layout` None: a layout of one trainer and generators after it)."""
    model_dir = resolve_model_dir(cfg.model.path, log)
    if uses_vllm(cfg):
        from recipe.engines.vllm_engine import VllmGenerator, settings_from_config

        placement = job_placement(env, layout or Layout(env.num_nodes, env.tasks_per_node, env.num_tasks - 1))
        me = placement.tasks[env.rank]
        if me.visible_devices is not None:  # vLLM's engine core starts in a child and takes its cuda:0
            os.environ["CUDA_VISIBLE_DEVICES"] = me.visible_devices
        shares_gpu = me.gpu is not None and sum(t.gpu == me.gpu for t in placement.tasks) > 1
        settings = settings_from_config(
            cfg, str(model_dir), weight_backend=placement.weight_backend, shares_gpu=shares_gpu
        )
        return VllmGenerator(settings)
    from recipe.engines.torch_generator import TorchGenerator

    model, tokenizer = load_policy(model_dir, dtype=cfg.model.dtype, lm_head_fp32=cfg.precision.lm_head_fp32)
    return TorchGenerator(model.to(device_for(env)), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)


def run_generator(
    cfg: RecipeConfig, layout: Layout, rendezvous: Rendezvous, env: TaskEnv, log: Callable[[str], None]
) -> None:
    """A generator: stream the groups trainer rank 0 admits, take every push, until it says stop."""
    leave_trainer_env()
    index = layout.generator_index(env.rank)
    client = ControlClient(rendezvous.control_address, index)
    try:
        engine = build_generator(cfg, env, log, layout)
        client.send({"type": "hello", "index": index})
        spec = WeightGroupSpec(
            rendezvous.host, rendezvous.weight_port, layout.num_generators, rendezvous.weight_backend,
            cfg.engine.peer_timeout_s,
        )  # fmt: skip
        engine.join_weight_group(spec, index)
        log(f"generator {index}: joined the weight group ({rendezvous.weight_backend})")
        _generate_until_stopped(engine, client, index, log, cfg.engine.peer_timeout_s)
    except Exception as exc:
        client.send({"type": "error", "message": f"{type(exc).__name__}: {exc}", "log": own_log_path()})
        raise
    finally:
        client.close()


def _generate_until_stopped(
    engine: Any, client: ControlClient, index: int, log: Callable[[str], None], timeout_s: float
) -> None:
    """Each "groups" message also carries `busy_seconds`: the wall time since the previous one
    during which groups were in flight, pushes excluded (the engine's generation time)."""
    running = 0  # groups submitted and not yet sent back
    last_heard = time.monotonic()
    busy_seconds, busy_since = 0.0, None  # generation time not yet reported; start of the current stretch
    while True:
        message = client.recv(timeout_s=0.0 if running else 0.5)
        while message is not None:
            last_heard = time.monotonic()
            kind = message["type"]
            if kind == "stop":
                engine.drop_in_flight()
                engine.close()
                log(f"generator {index}: stopped by trainer rank 0 ({running} groups in flight dropped)")
                return
            if kind == "work":
                for item in message["items"]:
                    engine.submit(
                        item["group_id"], item["prompt"], num_samples=item["num_samples"],
                        max_new_tokens=item["max_new_tokens"], seed=item["seed"],
                        interrupt=interrupt_from_wire(item.get("interrupt")),
                    )  # fmt: skip
                    running += 1
            elif kind == "weights":
                if busy_since is not None:  # a push pauses generation: not generation time
                    busy_seconds += time.monotonic() - busy_since
                engine.receive_weights(int(message["version"]), meta_from_wire(message["meta"]))
                busy_since = time.monotonic() if running else None
            message = client.recv(timeout_s=0.0)
        if running:
            busy_since = time.monotonic() if busy_since is None else busy_since
            groups = engine.poll(timeout_s=engine.poll_timeout_s)
            if groups:
                running -= len(groups)
                now = time.monotonic()
                busy_seconds, busy_since = busy_seconds + now - busy_since, (now if running else None)
                client.send(_groups_message(groups) | {"busy_seconds": busy_seconds})
                busy_seconds = 0.0
        elif time.monotonic() - last_heard > timeout_s:
            raise PeerLost(f"nothing from trainer rank 0 for engine.peer_timeout_s={timeout_s:.0f} s")


def _groups_message(groups: list[Group]) -> dict[str, Any]:
    """Finished groups, with the generator's own count of what it computed for them."""
    samples = [(len(g.prompt_ids), len(s.token_ids)) for g in groups for s in g.samples]
    return {
        "type": "groups",
        "groups": [group_to_wire(g) for g in groups],
        "num_tokens": sum(n for _, n in samples),
        "num_positions": sum(p + n for p, n in samples),
    }
