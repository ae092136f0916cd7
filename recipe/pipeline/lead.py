"""Trainer rank 0 of a multi-task run: it leads the other trainer ranks' steps (`LeadTrainer`),
meets the other tasks (`LeadTeam`) and streams its batches from the generators under PipelineRL-k
(`PipelineRollouts`), pushing the weights after every optimizer step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from recipe.config import Layout, RecipeConfig
from recipe.engines.base import Group, TrainBatch, Trainer
from recipe.engines.weights import TorchWeightSender, WeightGroupSpec, weight_meta
from recipe.loop.lag import Admission, Span, is_stale
from recipe.loop.rollout import StopBeforeStep, shaped_rewards
from recipe.loop.state import Rollout, RunState
from recipe.model.sampler import Completions
from recipe.pipeline.env import TaskEnv, job_placement, join_trainer_group, uses_vllm
from recipe.pipeline.rendezvous import (
    Rendezvous,
    announce,
    free_port,
    publish,
    rendezvous_host,
    task_hosts,
    withdraw,
)
from recipe.pipeline.transport import ControlServer, PeerLost, group_from_wire, interrupt_to_wire, meta_to_wire


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

    def state_dict(self) -> dict[str, Any] | None:
        self._tell("state_dict")  # collective for engines whose state is sharded
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, path: Path | None = None) -> None:
        """The other ranks are sent the checkpoint's path, never the state (a checkpoint-sized
        pickle through a broadcast); they read it memory-mapped (`checkpoint.read_trainer_state`)."""
        if path is None:
            raise ValueError("LeadTrainer.load_state_dict needs the checkpoint's path for the other trainer ranks")
        self._tell("load_checkpoint", str(path))
        self.inner.load_state_dict(state, path=path)

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


class LeadTeam:
    """The run's other tasks as trainer rank 0 sees them (a `recipe.loop.state.Team`); a context
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
        placement = job_placement(env, layout)
        self.num_gpus = placement.num_gpus  # what the job's tasks occupy, not its tasks
        backend, weight_backend = placement.trainer_backend, placement.weight_backend
        self.timeout_s = cfg.engine.peer_timeout_s
        self.control = ControlServer(layout.num_generators)
        announce(run_dir, env.attempt_key, env.rank, "trainer", 0)
        self.rendezvous = Rendezvous(
            env.attempt_key, rendezvous_host(env.num_nodes), self.control.port, free_port(""), free_port(""),
            backend, weight_backend,
        )  # fmt: skip
        publish(run_dir, self.rendezvous)
        log(
            f"layout: {layout.num_trainers} trainer rank(s), {layout.num_generators} generator rank(s) "
            f"on {layout.num_nodes} node(s); control {self.rendezvous.control_address}"
        )
        try:
            join_trainer_group(env, layout, self.rendezvous, self.timeout_s)
            self._wait_for_generators()
            # Every task announced itself before it joined: the trainers' group and the generators'
            # hello are behind us.
            self.hosts = task_hosts(run_dir, env.attempt_key)
            generators = [t for t in self.hosts if t["role"] == "generator"]
            self.control.names = {
                t["rank"]: f"generator {t['rank']} (task {t['task']} on {t['host']})" for t in generators
            }
            self.control.tasks = {t["rank"]: t["task"] for t in generators}
            log("tasks: " + ", ".join(f"{t['role']} {t['rank']} on {t['host']}" for t in self.hosts))
            spec = WeightGroupSpec(
                self.rendezvous.host, self.rendezvous.weight_port, layout.num_generators, weight_backend, self.timeout_s
            )
            self.sender = weight_sender(cfg, spec)
        except BaseException:
            withdraw(run_dir, env.attempt_key)
            self.control.close()
            raise
        self.leader: LeadTrainer | None = None

    def _wait_for_generators(self) -> None:
        waiting, deadline = set(range(self.layout.num_generators)), time.monotonic() + self.timeout_s
        while waiting:
            got = self.control.recv(timeout_s=max(0.0, deadline - time.monotonic()))
            if got is None:
                raise TimeoutError(
                    f"generator ranks {sorted(waiting)} did not connect within engine.peer_timeout_s={self.timeout_s:.0f} s"
                )
            index, message = got
            _raise_if_error(index, message)
            waiting.discard(index)

    def lead(self, trainer: Trainer) -> Trainer:
        if self.layout.num_trainers == 1:
            return trainer
        self.leader = LeadTrainer(trainer)
        return self.leader

    def rollouts(self, state: RunState) -> PipelineRollouts:
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
    if uses_vllm(cfg):
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
    """PipelineRL-k (or PPO-off-policy-k) on trainer rank 0 (a `recipe.loop.rollout.RolloutSource`).

    PPO-off-policy-k (`async.mode: ppo-offpolicy`) on generator ranks: the weights are pushed once
    every k steps, and admission lets the generators start the round's k batches on that version
    and no more, so step i of a round trains on data i versions old (lags 0 .. k-1 in turn).

    Admission: a prompt group goes to the least busy generator only while `recipe.loop.lag.Admission`
    allows it for the version the generators hold. Consumption: groups are taken in the order
    they finish; one whose oldest token is more than k versions behind the step is dropped
    (all its samples counted in `num_dropped`) and its admission slot given back. After each
    step the new weights are pushed, then more groups admitted.

    Timings (train metrics of every step, from `after_step`): `weight_push_seconds` (the push
    alone, from the meta's broadcast until the last tensor has landed), `trainer_seconds` and
    `trainer_flops` (from handing out the batch until the push: the trainer's step, FLOPs as
    `recipe.loop.train` counts them), `trainer_tokens` (the positions trained: prompt + completion),
    `generated_tokens` and `generator_busy_seconds` (completion tokens that arrived since the
    previous step, and the generators' own time with groups in flight, pushes excluded).
    """

    def __init__(
        self,
        state: RunState,
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

    def next_rollout(self, state: RunState) -> Rollout:
        timeout_s = state.cfg.engine.peer_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            taken = self.take_batch(state.step)
            if taken is not None:
                rollout = self.rollout(state, taken)
                self.handed_out_at, self.flops_at_handout = time.perf_counter(), state.compute.flops
                return rollout
            if self.should_stop():
                # Slurm signals every task at once (a requeue, a preemption): the generators stop
                # too, so the batch will not fill. The last step's checkpoint is what resumes.
                raise StopBeforeStep("a stop signal arrived while waiting for rollouts")
            self.dispatch(state)
            if self.receive(state, timeout_s=1.0):
                deadline = time.monotonic() + timeout_s
            elif time.monotonic() > deadline:
                waited_on = sorted({index for _, index in self.in_flight.values()})
                raise PeerLost(
                    f"no rollouts for engine.peer_timeout_s={timeout_s:.0f} s from "
                    f"{', '.join(self.control.name(i) for i in waited_on) or 'the generator ranks'} "
                    f"({len(self.in_flight)} groups in flight, {len(self.arrived)} waiting): "
                    "the process died, or its node or the network between is down",
                    tuple(self.control.tasks[i] for i in waited_on if i in self.control.tasks),
                )

    def after_step(self, state: RunState) -> dict[str, float]:
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

    def dispatch(self, state: RunState) -> None:
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

    def receive(self, state: RunState, timeout_s: float) -> bool:
        """Take what the generators sent (waiting at most `timeout_s` for the first message)."""
        got = self.control.recv(timeout_s)
        if got is None:
            return False
        while got is not None:
            index, message = got
            if message["type"] == "error" and self.should_stop():
                raise StopBeforeStep(f"generator {index} stopped on the signal: {message.get('message')}")
            _raise_if_error(index, message)
            if message["type"] == "groups":
                self._arrive(state, [group_from_wire(g) for g in message["groups"]])
                state.compute.tokens += int(message["num_tokens"])
                self.generated_tokens += int(message["num_tokens"])
                self.generator_busy_seconds += float(message.get("busy_seconds", 0.0))
                state.compute.flops += 2 * state.num_matmul_params * int(message["num_positions"])
            got = self.control.recv(0.0)
        return True

    def _arrive(self, state: RunState, groups: list[Group]) -> None:
        cfg = state.cfg
        for group in groups:
            if group.group_id not in self.in_flight:
                continue  # admitted before a resume: not ours any more
            row, _ = self.in_flight.pop(group.group_id)
            texts = state.tokenizer.batch_decode([list(s.token_ids) for s in group.samples], skip_special_tokens=False)
            passes_G = torch.tensor(state.task.score([state.task.train_prompts[row]] * len(texts), texts))
            lengths_G = torch.tensor([len(s.token_ids) for s in group.samples])
            rewards_G = shaped_rewards(passes_G, lengths_G, cfg)
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

    def rollout(self, state: RunState, taken: list[_Arrived]) -> Rollout:
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
        return Rollout(
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

    def push(self, state: RunState) -> None:
        """Version `state.step` to every generator: its meta over the control channel, then the tensors."""
        weights = list(state.trainer.named_weights())
        self.control.broadcast({"type": "weights", "version": state.step, "meta": meta_to_wire(weight_meta(weights))})
        try:
            self.sender.push(weights, version=state.step)
        except RuntimeError as exc:  # the collective's own timeout (engine.peer_timeout_s) or a closed peer
            everyone = ", ".join(self.control.name(i) for i in range(self.control.num_generators))
            raise PeerLost(
                f"the weight push of version {state.step} to {everyone} failed: {exc}", tuple(self.control.tasks.values())
            ) from exc
        self.generator_version = state.step


def _budget_groups(cfg: RecipeConfig) -> int | None:
    """No group is admitted that a step budget could never train."""
    return None if cfg.budget.steps is None else cfg.budget.steps * cfg.batch.prompts


def _prompt_tokens(state: RunState, row: int) -> list[int]:
    ids = state.train_prompt_ids[row]
    if state.train_prompt_mask is not None:
        ids = ids[state.train_prompt_mask[row]]
    return [int(t) for t in ids]
