"""A run's processes: which task of the job does what, how they meet, and each role's loop.

One run is one Slurm job of `resources.nodes` x `resources.tasks_per_node` tasks (one per GPU on
a GPU node, one process each on CPU), every task running `recipe.job.main`. The layout
(`recipe.config.check_layout`): tasks 0..T-1 train, the last `engine.generator_ranks` generate.

- **Trainer rank 0** (task 0) is the run: it talks to the store, owns the prompt order, the
  admission counter and the drop rule (`recipe.lag`), scores rollouts, trains, evaluates,
  checkpoints, and pushes the weights to the generators after every optimizer step. It runs
  `recipe.train.train` with a `LeadTeam`.
- **Trainer ranks 1..T-1** (`run_trainer_follower`) join the trainers' own torch.distributed
  group (gloo on CPU, NCCL on GPU; WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT re-exported for it)
  and take every step with rank 0 on their share of the batch, which rank 0 broadcasts to them.
- **Generators** (`run_generator`) never join that group. Each runs one streaming engine
  (torch or vLLM), takes prompt groups from rank 0 over the control channel
  (`recipe.transport`, ZeroMQ), streams finished groups back, and joins every weight push over
  the weight group (`recipe.engines.weights`, trainer rank 0 + generators).

How they meet: task 0 binds the control socket, picks the ports of the trainers' group and of
the weight group, and writes them to RUN_DIR/rendezvous.json under the attempt's key (Slurm job
id and restart count), which every other task waits for. A requeued job is a new attempt with a
new key, so nobody reads a stale file.

Preemption, requeue, time limits: only trainer rank 0 acts on a stop signal (`recipe.job`): it
checkpoints at the next step boundary and tells the others to stop; the other tasks log the
signal and carry on until then. Generators drop what is in flight; the next attempt resumes from
the checkpoint, pushes its weights, and admits new groups from scratch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from recipe import train as train_mod
from recipe.builtin import resolve_model_dir
from recipe.config import Layout, RecipeConfig, check_layout
from recipe.engines.base import Group, TrainBatch, Trainer
from recipe.engines.weights import TorchWeightSender, WeightGroupSpec, weight_meta
from recipe.lag import Admission, Span, is_stale
from recipe.model import load_policy
from recipe.sampler import Completions
from recipe.transport import (
    ControlClient,
    ControlServer,
    group_from_wire,
    group_to_wire,
    interrupt_from_wire,
    interrupt_to_wire,
    meta_from_wire,
    meta_to_wire,
)

log = logging.getLogger("recipe")

RENDEZVOUS_FILE = "rendezvous.json"
TRAINER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def peer_timeout_s() -> float:
    """How long a task waits for another before it gives up ($SWEEP_PEER_TIMEOUT_S, default 1800):
    long enough for trainer rank 0's evaluation and checkpoints, during which the others wait."""
    return float(os.environ.get("SWEEP_PEER_TIMEOUT_S", "1800"))


# ---------------------------------------------------------------------------------------------
# Which task this is


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


def device_for(env: TaskEnv) -> torch.device:
    """One task per GPU; tasks beyond the GPUs a node shows share them round robin (a one-GPU check)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank % torch.cuda.device_count())


# ---------------------------------------------------------------------------------------------
# How the tasks meet


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join_trainer_group(env: TaskEnv, layout: Layout, rendezvous: Rendezvous) -> None:
    """The trainers' own default group; its variables are exported for engines that read them (DeepSpeed)."""
    os.environ.update(
        WORLD_SIZE=str(layout.num_trainers),
        RANK=str(env.rank),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=rendezvous.host,
        MASTER_PORT=str(rendezvous.trainer_port),
    )
    if rendezvous.backend == "nccl":
        torch.cuda.set_device(device_for(env))
    dist.init_process_group(rendezvous.backend, init_method="env://", timeout=timedelta(seconds=peer_timeout_s()))


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


# ---------------------------------------------------------------------------------------------
# Trainer rank 0


class LeadTrainer:
    """Trainer rank 0's trainer: every call that the trainer ranks take together is first sent
    to ranks 1..T-1 (one broadcast), then run here."""

    def __init__(self, trainer: Trainer) -> None:
        self.inner = trainer

    def _tell(self, *command: Any) -> None:
        dist.broadcast_object_list([command], src=0)

    def step(self, batch: TrainBatch, *, lr: float) -> dict[str, float]:
        self._tell("step", batch, lr)
        return self.inner.step(batch, lr=lr)

    def state_dict(self) -> dict[str, Any]:
        self._tell("state_dict")  # collective for engines whose state is sharded
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tell("load_state_dict", state)
        self.inner.load_state_dict(state)

    def check_state(self, state: dict[str, Any]) -> None:
        self.inner.check_state(state)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.named_weights()

    def eval_model(self) -> torch.nn.Module:
        return self.inner.eval_model()

    def close(self) -> None:
        self.inner.close()

    def stop_followers(self) -> None:
        self._tell("stop")


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
        elif name == "load_state_dict":
            trainer.load_state_dict(args[0])
        else:
            raise RuntimeError(f"unknown command {name!r} from trainer rank 0")


class LeadTeam:
    """The run's other tasks as trainer rank 0 sees them (a `recipe.train.Team`); a context
    manager: leaving it stops every other task."""

    def __init__(
        self,
        cfg: RecipeConfig,
        run_dir: Path,
        env: TaskEnv,
        layout: Layout,
        log: Callable[[str], None],
        should_stop: Callable[[], bool] = lambda: False,
    ):
        self.cfg, self.env, self.layout, self.log, self.should_stop = cfg, env, layout, log, should_stop
        self.run_dir = run_dir
        gpus_per_node = torch.cuda.device_count()
        self.num_gpus = min(env.num_tasks, gpus_per_node * env.num_nodes)  # what the job holds, not its tasks
        backend = "nccl" if gpus_per_node else "gloo"
        weight_backend = "nccl" if gpus_per_node >= env.tasks_per_node else "gloo"
        self.control = ControlServer(layout.num_generators)
        self.rendezvous = Rendezvous(
            env.attempt_key, socket.gethostname(), self.control.port, free_port(), free_port(), backend, weight_backend
        )
        publish(run_dir, self.rendezvous)
        log(
            f"layout: {layout.num_trainers} trainer rank(s), {layout.num_generators} generator rank(s) "
            f"on {layout.num_nodes} node(s); control {self.rendezvous.control_address}"
        )
        try:
            join_trainer_group(env, layout, self.rendezvous)
            self._wait_for_generators()
            spec = WeightGroupSpec(
                self.rendezvous.host, self.rendezvous.weight_port, layout.num_generators, weight_backend, peer_timeout_s()
            )
            self.sender = weight_sender(cfg, spec)
        except BaseException:
            withdraw(run_dir, env.attempt_key)
            self.control.close()
            raise
        self.leader: LeadTrainer | None = None

    def _wait_for_generators(self) -> None:
        waiting, deadline = set(range(self.layout.num_generators)), time.monotonic() + peer_timeout_s()
        while waiting:
            got = self.control.recv(timeout_s=max(0.0, deadline - time.monotonic()))
            if got is None:
                raise TimeoutError(f"generator ranks {sorted(waiting)} did not connect within {peer_timeout_s():.0f} s")
            index, message = got
            _raise_if_error(index, message)
            waiting.discard(index)

    def lead(self, trainer: Trainer) -> Trainer:
        if self.layout.num_trainers == 1:
            return trainer
        self.leader = LeadTrainer(trainer)
        return self.leader

    def rollouts(self, state: train_mod.RunState) -> PipelineRollouts:
        return PipelineRollouts(state, self.control, self.sender, self.log, self.should_stop)

    def __enter__(self) -> LeadTeam:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.leader is not None:
                self.leader.stop_followers()
            self.control.broadcast({"type": "stop"})
        except Exception as error:  # noqa: BLE001 - a peer already gone needs no stop; the cause is reported above
            self.log(f"could not tell every task to stop: {type(error).__name__}: {error}")
        finally:
            withdraw(self.run_dir, self.env.attempt_key)
            self.control.close()
            self.sender.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def weight_sender(cfg: RecipeConfig, spec: WeightGroupSpec) -> Any:
    """Trainer rank 0's end of the weight group, for the generators' engine (collective: blocks
    until every generator has joined)."""
    if cfg.engine.generator == "vllm" or (cfg.engine.generator == "auto" and torch.cuda.is_available()):
        from recipe.engines.vllm_engine import vllm_weight_sender

        return vllm_weight_sender(spec)
    return TorchWeightSender(spec, device="cuda" if spec.backend == "nccl" else "cpu")


def _raise_if_error(index: int, message: dict[str, Any]) -> None:
    if message.get("type") == "error":
        where = f" (its log: {message['log']})" if message.get("log") else ""
        raise RuntimeError(f"generator rank {index} failed: {message.get('message')}{where}")


@dataclass
class _Arrived:
    """A finished group on trainer rank 0, scored."""

    row: int
    group: Group
    rewards_G: torch.Tensor
    passes_G: torch.Tensor

    @property
    def span(self) -> Span:
        samples = self.group.samples
        return Span(min(s.version_start for s in samples), max(s.version_end for s in samples))


class PipelineRollouts:
    """PipelineRL-k (or PPO-off-policy-k) on trainer rank 0 (a `recipe.train.RolloutSource`).

    PPO-off-policy-k (`async.mode: ppo-offpolicy`) on generator ranks: the weights are pushed once
    every k steps, and admission lets the generators start the round's k batches on that version
    and no more, so step i of a round trains on data i versions old (lags 0 .. k-1 in turn).

    Admission: a prompt group goes to the least busy generator only while `recipe.lag.Admission`
    allows it for the version the generators hold. Consumption: groups are taken in the order
    they finish; one whose oldest token is more than k versions behind the step is dropped
    (all its samples counted in `num_dropped`) and its admission slot given back. After each
    step the new weights are pushed, then more groups admitted.

    Timings (train metrics of every step, from `after_step`): `weight_push_seconds` (the push
    alone, from the meta's broadcast until the last tensor has landed), `trainer_seconds` and
    `trainer_flops` (from handing out the batch until the push: the trainer's step, FLOPs as
    `recipe.train` counts them), `trainer_tokens` (the positions trained: prompt + completion),
    `generated_tokens` and `generator_busy_seconds` (completion tokens that arrived since the
    previous step, and the generators' own time with groups in flight, pushes excluded).
    """

    def __init__(
        self,
        state: train_mod.RunState,
        control: ControlServer,
        sender: Any,
        log: Callable[[str], None],
        should_stop: Callable[[], bool] = lambda: False,
    ):
        cfg = state.cfg
        self.control, self.sender, self.log, self.should_stop = control, sender, log, should_stop
        self.peers_gone = False  # set once the generators went away after a stop signal
        self.max_lag, self.groups_per_step = cfg.async_.max_lag, cfg.batch.prompts
        self.rounds = cfg.async_.mode == "ppo-offpolicy"
        # PPO-off-policy-k: the k batches of a round come from the version pushed at its start, so
        # at most k - 1 versions old; pipeline: admitted up to k versions ahead, pushed every step.
        self.admission = Admission(self.max_lag - 1 if self.rounds else self.max_lag, self.groups_per_step)
        self.admission.admitted = state.step * self.groups_per_step  # a resumed run trained these; nothing in flight
        self.generator_version = -1
        self.in_flight: dict[str, tuple[int, int]] = {}  # group id -> (prompt row, generator index)
        self.arrived: deque[_Arrived] = deque()
        self.num_dropped = 0
        self.num_sent = 0
        self.handed_out_at, self.flops_at_handout = time.perf_counter(), state.compute.flops
        self.generated_tokens, self.generator_busy_seconds = 0, 0.0  # since the last step
        self.push(state)
        self.dispatch(state)

    # -- the source --------------------------------------------------------------------------

    def next_rollout(self, state: train_mod.RunState) -> train_mod.Rollout:
        deadline = time.monotonic() + peer_timeout_s()
        while True:
            taken = self.take_batch(state.step)
            if taken is not None:
                rollout = self.rollout(state, taken)
                self.handed_out_at, self.flops_at_handout = time.perf_counter(), state.compute.flops
                return rollout
            if self.should_stop():
                # Slurm signals every task at once (a requeue, a preemption): the generators stop
                # too, so the batch will not fill. The last step's checkpoint is what resumes.
                raise train_mod.StopBeforeStep("a stop signal arrived while waiting for rollouts")
            self.dispatch(state)
            if self.receive(state, timeout_s=1.0):
                deadline = time.monotonic() + peer_timeout_s()
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"no rollouts from the generator ranks for {peer_timeout_s():.0f} s "
                    f"({len(self.in_flight)} groups in flight, {len(self.arrived)} waiting)"
                )

    def after_step(self, state: train_mod.RunState) -> dict[str, float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's kernels count to the trainer, not to the push
        trained = time.perf_counter()
        try:
            if not self.peers_gone and (not self.rounds or state.step % self.max_lag == 0):
                self.push(state)  # PPO-off-policy-k: once per round of k steps
        except Exception as exc:
            if not self.should_stop():
                raise
            # The same signal reached the generators (and vLLM's engine process) first: nothing
            # is left to push to. This step is trained; the loop checkpoints it and stops.
            self.peers_gone = True
            self.log(f"step {state.step}: no weight push, the generators stopped on the signal ({type(exc).__name__})")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # an NCCL broadcast returns before it has landed
        pushed = time.perf_counter()
        if not self.peers_gone:
            self.dispatch(state)
        trainer_flops = state.compute.flops - self.flops_at_handout  # only the step counted since
        metrics = {
            "weight_push_seconds": pushed - trained,
            "trainer_seconds": trained - self.handed_out_at,
            "trainer_flops": trainer_flops,
            "trainer_tokens": float(round(trainer_flops / (6 * state.num_matmul_params))),
            "generated_tokens": float(self.generated_tokens),
            "generator_busy_seconds": self.generator_busy_seconds,
        }
        self.generated_tokens, self.generator_busy_seconds = 0, 0.0
        return metrics

    def close(self) -> None:
        """Nothing more is admitted; the generators drop what is in flight when the team stops."""
        self.in_flight.clear()

    # -- admission, arrival, consumption -----------------------------------------------------

    def dispatch(self, state: train_mod.RunState) -> None:
        """Admit every group the bound allows, each to the generator with the fewest in flight."""
        cfg, budget_groups = state.cfg, _budget_groups(state.cfg)
        work: dict[int, list[dict[str, Any]]] = {}
        load = [0] * self.control.num_generators
        for _, index in self.in_flight.values():
            load[index] += 1
        while state.drawer.num_active > 0 and (budget_groups is None or self.admission.admitted < budget_groups):
            if not self.admission.try_admit(self.generator_version):
                break
            row = int(state.drawer.draw(1)[0])
            group_id = f"{self.generator_version}-{self.num_sent}"
            index = int(np.argmin(load))
            load[index] += 1
            self.in_flight[group_id] = (row, index)
            self.num_sent += 1
            item = {
                "group_id": group_id,
                "prompt": _prompt_tokens(state, row),
                "num_samples": cfg.batch.generations,
                "max_new_tokens": state.max_new_tokens,
                "seed": int(np.random.SeedSequence([4, cfg.seed, state.step, self.num_sent]).generate_state(1)[0]),
            }
            if state.interrupt is not None:  # the thinking budgets travel with the prompt
                item["interrupt"] = interrupt_to_wire(state.interrupt.draw(cfg.batch.generations, state.generator))
            work.setdefault(index, []).append(item)
        for index, items in work.items():
            self.control.send(index, {"type": "work", "items": items})

    def receive(self, state: train_mod.RunState, timeout_s: float) -> bool:
        """Take what the generators sent (waiting at most `timeout_s` for the first message)."""
        got = self.control.recv(timeout_s)
        if got is None:
            return False
        while got is not None:
            index, message = got
            if message["type"] == "error" and self.should_stop():
                raise train_mod.StopBeforeStep(f"generator {index} stopped on the signal: {message.get('message')}")
            _raise_if_error(index, message)
            if message["type"] == "groups":
                self._arrive(state, [group_from_wire(g) for g in message["groups"]])
                state.compute.tokens += int(message["num_tokens"])
                self.generated_tokens += int(message["num_tokens"])
                self.generator_busy_seconds += float(message.get("busy_seconds", 0.0))
                state.compute.flops += 2 * state.num_matmul_params * int(message["num_positions"])
            got = self.control.recv(0.0)
        return True

    def _arrive(self, state: train_mod.RunState, groups: list[Group]) -> None:
        cfg = state.cfg
        for group in groups:
            if group.group_id not in self.in_flight:
                continue  # admitted before a resume: not ours any more
            row, _ = self.in_flight.pop(group.group_id)
            texts = state.tokenizer.batch_decode([list(s.token_ids) for s in group.samples], skip_special_tokens=False)
            passes_G = torch.tensor(state.task.score([state.task.train_prompts[row]] * len(texts), texts))
            lengths_G = torch.tensor([len(s.token_ids) for s in group.samples])
            rewards_G = train_mod.shaped_rewards(passes_G, lengths_G, cfg)
            if cfg.filter.no_positive_resampling and float(passes_G.float().mean()) >= cfg.filter.npr_threshold:
                state.drawer.retire(np.array([row]))
            self.arrived.append(_Arrived(row, group, rewards_G, passes_G))

    def take_batch(self, step: int) -> list[_Arrived] | None:
        """The drop rule, then the B oldest-finished groups, or None while fewer are waiting."""
        for item in [a for a in self.arrived if is_stale(step, a.span, self.max_lag)]:
            self.arrived.remove(item)
            self.num_dropped += len(item.group.samples)
            self.admission.give_back(1)
        if len(self.arrived) < self.groups_per_step:
            return None
        return [self.arrived.popleft() for _ in range(self.groups_per_step)]

    def rollout(self, state: train_mod.RunState, taken: list[_Arrived]) -> train_mod.Rollout:
        samples = [s for a in taken for s in a.group.samples]
        width = max(len(s.token_ids) for s in samples)
        tokens_BT = torch.full((len(samples), width), state.tokenizer.pad_token_id, dtype=torch.long)
        logp_BT = torch.zeros((len(samples), width))
        mask_BT = torch.zeros((len(samples), width), dtype=torch.bool)
        forced_BT = torch.zeros((len(samples), width), dtype=torch.bool) if state.interrupt is not None else None
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            tokens_BT[i, :n] = torch.tensor(s.token_ids)
            logp_BT[i, :n] = torch.tensor(s.logprobs)
            mask_BT[i, :n] = True
            if forced_BT is not None and s.forced:
                forced_BT[i, list(s.forced)] = True
        rows_P = torch.tensor([a.row for a in taken])
        versions_B2 = torch.tensor([[s.version_start, s.version_end] for s in samples])
        num_dropped, self.num_dropped = self.num_dropped, 0
        return train_mod.Rollout(
            prompt_rows_P=rows_P,
            prompt_ids_BP=state.train_prompt_ids[rows_P].repeat_interleave(len(taken[0].group.samples), dim=0),
            completions=Completions(tokens_BT, logp_BT, mask_BT, torch.tensor([s.finished for s in samples]), forced_BT),
            rewards_PG=torch.stack([a.rewards_G for a in taken]),
            passes_PG=torch.stack([a.passes_G for a in taken]),
            policy_version=int(versions_B2[:, 0].min()),
            versions_B2=versions_B2,
            num_dropped=num_dropped,
        )

    # -- the push ----------------------------------------------------------------------------

    def push(self, state: train_mod.RunState) -> None:
        """Version `state.step` to every generator: its meta over the control channel, then the tensors."""
        weights = list(state.trainer.named_weights())
        self.control.broadcast({"type": "weights", "version": state.step, "meta": meta_to_wire(weight_meta(weights))})
        self.sender.push(weights, version=state.step)
        self.generator_version = state.step


def _budget_groups(cfg: RecipeConfig) -> int | None:
    """No group is admitted that a step budget could never train."""
    return None if cfg.budget.steps is None else cfg.budget.steps * cfg.batch.prompts


def _prompt_tokens(state: train_mod.RunState, row: int) -> list[int]:
    ids = state.train_prompt_ids[row]
    if state.train_prompt_mask is not None:
        ids = ids[state.train_prompt_mask[row]]
    return [int(t) for t in ids]


# ---------------------------------------------------------------------------------------------
# The other tasks


def run_peer(cfg: RecipeConfig, run_dir: Path, env: TaskEnv, log: Callable[[str], None]) -> str:
    """Task `env.rank` > 0 of a multi-task run: a trainer follower or a generator."""
    ignore_stop_signals()
    layout = layout_of(cfg, env)
    rendezvous = wait_for_rendezvous(run_dir, env.attempt_key, peer_timeout_s())
    torch.set_num_threads(cfg.engine.threads)
    if layout.is_trainer(env.rank):
        run_trainer_follower(cfg, env, layout, rendezvous, log)
        return f"trainer rank {env.rank} done"
    run_generator(cfg, layout, rendezvous, env, log)
    return f"generator {layout.generator_index(env.rank)} done"


def run_trainer_follower(
    cfg: RecipeConfig, env: TaskEnv, layout: Layout, rendezvous: Rendezvous, log: Callable[[str], None]
) -> None:
    join_trainer_group(env, layout, rendezvous)
    try:
        torch.manual_seed(cfg.seed)
        model, _ = load_policy(
            resolve_model_dir(cfg.model.path, log), dtype=cfg.model.dtype, lm_head_fp32=cfg.precision.lm_head_fp32
        )
        trainer = train_mod.build_trainer(cfg, model, train_mod.build_optimizer(cfg, model))
        log(f"trainer rank {env.rank} of {layout.num_trainers}: following trainer rank 0")
        follow(trainer)
    finally:
        dist.destroy_process_group()


def build_generator(cfg: RecipeConfig, env: TaskEnv, log: Callable[[str], None]) -> Any:
    """`engine.generator`'s streaming engine, holding the model directory's weights."""
    model_dir = resolve_model_dir(cfg.model.path, log)
    if cfg.engine.generator == "vllm" or (cfg.engine.generator == "auto" and torch.cuda.is_available()):
        from recipe.engines.vllm_engine import VllmGenerator, settings_from_config

        return VllmGenerator(settings_from_config(cfg, str(model_dir)))
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
        engine = build_generator(cfg, env, log)
        client.send({"type": "hello", "index": index})
        spec = WeightGroupSpec(
            rendezvous.host, rendezvous.weight_port, layout.num_generators, rendezvous.weight_backend, peer_timeout_s()
        )
        engine.join_weight_group(spec, index)
        log(f"generator {index}: joined the weight group ({rendezvous.weight_backend})")
        _generate_until_stopped(engine, client, index, log)
    except Exception as exc:
        client.send({"type": "error", "message": f"{type(exc).__name__}: {exc}", "log": own_log_path()})
        raise
    finally:
        client.close()


def _generate_until_stopped(engine: Any, client: ControlClient, index: int, log: Callable[[str], None]) -> None:
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
            groups = engine.poll(timeout_s=0.05)
            if groups:
                running -= len(groups)
                now = time.monotonic()
                busy_seconds, busy_since = busy_seconds + now - busy_since, (now if running else None)
                client.send(_groups_message(groups) | {"busy_seconds": busy_seconds})
                busy_seconds = 0.0
        elif time.monotonic() - last_heard > peer_timeout_s():
            raise TimeoutError(f"nothing from trainer rank 0 for {peer_timeout_s():.0f} s")


def _groups_message(groups: list[Group]) -> dict[str, Any]:
    """Finished groups, with the generator's own count of what it computed for them."""
    samples = [(len(g.prompt_ids), len(s.token_ids)) for g in groups for s in g.samples]
    return {
        "type": "groups",
        "groups": [group_to_wire(g) for g in groups],
        "num_tokens": sum(n for _, n in samples),
        "num_positions": sum(p + n for p, n in samples),
    }
