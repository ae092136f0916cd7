"""RL training on the torch engine (one CPU process): the ScaleRL loop, top to bottom.

One optimizer step:

1. Prompts: `batch.prompts` training prompts, epoch by epoch without replacement. With
   `filter.no_positive_resampling`, a prompt whose group pass rate reaches `filter.npr_threshold`
   leaves the training set for good.
2. Rollouts: `batch.generations` completions per prompt, sampled at temperature 1 with no top-p or
   top-k, each token's behaviour log-prob recorded; a completion ends at EOS or at the generation
   cap (the task's own, below `length.max_new_tokens`), where it counts as truncated.
   `length.control=interrupt` (tasks with a thinking phase: sumk, math-jsonl): each completion
   gets a thinking budget drawn from [interrupt_min, interrupt_max]; one still thinking at its
   budget gets the end-of-thinking phrase appended and goes on to answer (`recipe.sampler`). The
   forced tokens are context for the policy but not its actions: they are left out of the loss.
   A task without a thinking phase (sort6) accepts interrupt only with budgets beyond its cap.
3. Rewards: the task's verifiable reward; with `length.control=penalty` plus DAPO's overlong
   penalty.
4. Advantages: A = r - mean(group r), scaled by `advantage.norm`. With `filter.zero_variance`,
   groups whose rewards are all equal leave the batch before anything is computed on it.
5. Update: `loss.type` on the importance ratio exp(logp_trainer - logp_behaviour), aggregated by
   `loss.aggregation` over whole-batch counts; one AdamW step (lr rising linearly over
   `optim.warmup_steps`, then constant), gradient norm clipped to `optim.max_grad_norm`.

Off-policy modes (`async.mode`, k = `async.max_lag`):

- ppo-offpolicy (PPO-off-policy-k): k batches are generated with one policy, then k optimizer steps
  are taken, one per batch; the i-th step of a round trains on data i policy versions old, so the
  importance ratios move away from 1.
- pipeline (PipelineRL-k): in one task generation and training alternate, so every batch comes
  from the current policy: lag 0, within PipelineRL-k's bound, ratios 1 up to numerics. With
  generator ranks (`engine.generator_ranks`, `recipe.roles.PipelineRollouts`) the generators
  stream while weights are pushed in flight after every step, up to k versions ahead.
- Both modes run on generator ranks: there ppo-offpolicy pushes once per round of k steps.

Evaluation: the held-out pass rate, mean@k (k = `eval.samples`) over every held-out prompt, sampled
at temperature 1 with a random stream of its own (seeded by run seed and step), at step 0, at steps
1, 2, 4, 8, ... below `eval.every` (`eval.log_spaced`), every `eval.every` steps, and at the last
step.

Compute, cumulative, in every eval point: `flops` = 2·N·(prompt + completion tokens) generated +
6·N·(prompt + completion tokens) trained, with N every parameter but the input embedding table
(`recipe.model.matmul_param_count`; a lookup costs no multiply-adds); attention FLOPs are left
out (tiny at these lengths), and so is evaluation. `tokens` = completion tokens generated for
training. `device_seconds` = wall time of training steps (generation + update), without evaluation
and checkpointing. `gpu_hours` = the job's GPUs x those hours (0 on a CPU); `budget.gpu_hours` stops the
run when they reach it.

Checkpoints (`recipe.checkpoint`) every `checkpoint.every` steps, at the end, and when
`should_stop()` (asked once per step) returns true. A run resumes from its newest valid checkpoint
and continues the same trajectory bit for bit: weights, AdamW state, step (the lr schedule is a
function of it), compute counters, prompt order and NPR state, batches generated but not yet
trained on (ppo-offpolicy), and the random states. The eval stream is seeded per step, so eval
points do not depend on where a run was interrupted.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from recipe import checkpoint
from recipe.advantages import group_advantages, overlong_penalty, zero_variance_groups
from recipe.builtin import resolve_model_dir
from recipe.config import ConfigError, NotAvailableError, RecipeConfig, flatten
from recipe.curriculum import PromptDrawer
from recipe.engines.base import TrainBatch, Trainer
from recipe.engines.torch_trainer import TorchTrainer
from recipe.lag import Span, lag_metrics
from recipe.model import load_policy, matmul_param_count
from recipe.sampler import Completions, Interrupt, InterruptRule, decode, sample
from recipe.sink import Sink
from recipe.tasks import Task, load_task
from recipe.waits import WaitWatch

EVAL_CHUNK = 4096
"""Held-out sequences sampled in one batch: bounds the KV cache's memory."""
_SAMPLING_STREAM, _PROMPT_STREAM, _EVAL_STREAM = 1, 2, 3


@dataclass(frozen=True)
class TrainOutcome:
    final_step: int
    state: Literal["completed", "stopped"]
    resumed_from_step: int | None


@dataclass
class Compute:
    """Cumulative compute spent on training (see the module docstring for the definitions)."""

    flops: float = 0.0
    tokens: int = 0
    device_seconds: float = 0.0
    gpu_hours: float = 0.0


@dataclass
class Rollout:
    """One generated batch, P prompts x G completions, stored group after group."""

    prompt_rows_P: torch.Tensor
    """Indices into the task's training prompts."""
    prompt_ids_BP: torch.Tensor
    completions: Completions
    rewards_PG: torch.Tensor
    passes_PG: torch.Tensor
    """The task's own reward, before length shaping: what pass rates and NPR use."""
    policy_version: int
    """The number of optimizer steps the generating policy had taken (the oldest, for a batch of
    a pipeline's generator ranks)."""
    versions_B2: torch.Tensor | None = None
    """Per sample, the policy versions of its first and last token; None: all `policy_version`."""
    num_dropped: int = 0
    """Samples the drop rule discarded while this batch was assembled (`recipe.lag`)."""

    def spans(self) -> list[Span]:
        """Each sample's version span, in row order."""
        if self.versions_B2 is None:
            return [Span(self.policy_version, self.policy_version)] * self.completions.tokens_BT.shape[0]
        return [Span(int(a), int(b)) for a, b in self.versions_B2.tolist()]

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "completions"}
        return out | {"completions": asdict(self.completions)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rollout:
        return cls(**(data | {"completions": Completions(**data["completions"])}))


@dataclass
class RunState:
    """Everything a step reads or changes; `checkpoint_state` saves the parts that change."""

    cfg: RecipeConfig
    task: Task
    model: PreTrainedModel
    """The policy trainer rank 0 samples from (generation in alternating mode, evaluation)."""
    tokenizer: PreTrainedTokenizerFast
    trainer: Trainer
    drawer: PromptDrawer
    generator: torch.Generator
    train_prompt_ids: torch.Tensor
    valid_prompt_ids: torch.Tensor
    max_new_tokens: int
    num_matmul_params: int
    step: int = 0
    compute: Compute = field(default_factory=Compute)
    pending: list[Rollout] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)
    train_prompt_mask: torch.Tensor | None = None
    """Real tokens of left-padded prompts of different lengths (math-jsonl); None for sort6."""
    valid_prompt_mask: torch.Tensor | None = None
    num_gpus: int = 0
    device_generator: torch.Generator | None = None
    """Draws the sampled tokens where the policy is on a GPU (`torch.multinomial` wants its generator
    on the logits' device); None on a CPU, where `generator` draws them. Interrupt budgets are always
    drawn from `generator`, on the CPU."""
    """GPUs the run's job holds, all tasks together: what a second of a step costs in GPU-seconds."""
    interrupt: InterruptRule | None = None
    """`length.control=interrupt` where it can fire (`interrupt_rule`); None: no completion is interrupted."""


class StopBeforeStep(Exception):
    """A rollout source gives up on the next batch because a stop signal arrived (its peers
    stop too); the loop checkpoints the last step taken and returns."""


class RolloutSource(Protocol):
    """Where trainer rank 0's batches come from: this process (`LocalRollouts`) or generator
    ranks streaming under PipelineRL-k (`recipe.roles.PipelineRollouts`)."""

    def next_rollout(self, state: RunState) -> Rollout: ...

    def after_step(self, state: RunState) -> dict[str, float]:
        """The optimizer step is taken: version `state.step` exists (pipeline: push it). Returns
        metrics of the step's own (the push's time)."""

    def close(self) -> None: ...


class Team(Protocol):
    """The run's other ranks as trainer rank 0 sees them (`recipe.roles`); `SOLO` for one task."""

    num_gpus: int

    def lead(self, trainer: Trainer) -> Trainer:
        """The trainer trainer rank 0 calls: it drives the other trainer ranks' steps too."""
        ...

    def rollouts(self, state: RunState) -> RolloutSource: ...


# ---------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: RecipeConfig,
    run_dir: Path,
    sink: Sink,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    team: Team | None = None,
) -> TrainOutcome:
    """Train until the budget, resuming from `run_dir`'s newest valid checkpoint if there is one.

    `team`: the run's other ranks when this is trainer rank 0 of a multi-task job; None for one task.
    """
    check_engine(cfg)
    check_budget(cfg, job_gpus(team))
    if cfg.async_.mode == "pipeline" and team is None:
        log(
            "async.mode=pipeline with engine.generator_ranks=0: generation and training alternate in this "
            "one process, so the run is synchronous (lag 0, within PipelineRL-k's bound)"
        )
    torch.set_num_threads(cfg.engine.threads)
    task = load_task(cfg.data)
    state = initial_state(cfg, task, generation_cap(cfg, task, log), log, team)
    state.interrupt = interrupt_rule(cfg, task, state.tokenizer, state.max_new_tokens, log)
    resumed_from = resume(state, run_dir, sink, log)
    source = team.rollouts(state) if team is not None else LocalRollouts()
    try:
        return _loop(state, source, run_dir, sink, should_stop, log, resumed_from)
    finally:
        source.close()
        state.trainer.close()


def _loop(
    state: RunState,
    source: RolloutSource,
    run_dir: Path,
    sink: Sink,
    should_stop: Callable[[], bool],
    log: Callable[[str], None],
    resumed_from: int | None,
) -> TrainOutcome:
    cfg = state.cfg
    watch = WaitWatch(log)  # a phase that waits off the CPU for long is named in the log
    if resumed_from is None:
        with watch.phase("evaluation and its report", state.step):
            report_eval(state, sink, log)
    while finish_reason(state) is None:
        try:
            with watch.phase("train step", state.step + 1):
                metrics = train_step(state, source)
        except StopBeforeStep as reason:
            save_checkpoint(state, run_dir, sink)  # at the last step taken: the curve resumes clean
            log(f"stopped at step {state.step} on request ({reason}); checkpoint saved")
            return TrainOutcome(state.step, "stopped", resumed_from)
        metrics["wait_seconds"] = watch.take()  # since the previous step's metrics
        with watch.phase("train metrics report", state.step):
            sink.train_metrics(state.step, metrics)
        final = finish_reason(state) is not None
        if final or is_eval_step(state.step, cfg):
            with watch.phase("evaluation and its report", state.step):
                report_eval(state, sink, log)
        stop = not final and should_stop()
        if final or stop or state.step % cfg.checkpoint.every == 0:
            with watch.phase("checkpoint", state.step):
                save_checkpoint(state, run_dir, sink)
        if stop:
            log(f"stopped at step {state.step} on request; checkpoint saved")
            return TrainOutcome(state.step, "stopped", resumed_from)
    log(f"completed at step {state.step}: {finish_reason(state)}")
    return TrainOutcome(state.step, "completed", resumed_from)


def train_step(state: RunState, source: RolloutSource) -> dict[str, float]:
    """The next batch (generated here, or streamed by generator ranks), then one optimizer step."""
    started = time.perf_counter()
    rollout = source.next_rollout(state)
    metrics = rollout_metrics(rollout) | policy_update(state, rollout)
    metrics["lag"] = state.step - rollout.policy_version
    metrics |= lag_metrics(state.step, rollout.spans(), rollout.num_dropped)
    state.step += 1
    metrics |= source.after_step(state)
    elapsed = time.perf_counter() - started
    state.compute.device_seconds += elapsed
    state.compute.gpu_hours += state.num_gpus * elapsed / 3600
    metrics |= {"step_seconds": elapsed, "num_active_prompts": state.drawer.num_active}
    state.last_metrics = metrics
    return metrics


def finish_reason(state: RunState) -> str | None:
    """Why the run is over, or None: a budget reached, or NPR left too few training prompts."""
    budget, compute = state.cfg.budget, state.compute
    if budget.steps is not None and state.step >= budget.steps:
        return f"budget.steps={budget.steps} reached"
    if budget.flops is not None and compute.flops >= budget.flops:
        return f"budget.flops={budget.flops:.3g} reached"
    if budget.gpu_hours is not None and compute.gpu_hours >= budget.gpu_hours:
        return f"budget.gpu_hours={budget.gpu_hours} reached"
    if not state.pending and state.drawer.num_active < state.cfg.batch.prompts:
        return f"only {state.drawer.num_active} training prompts left after No-Positive-Resampling"
    return None


def is_eval_step(step: int, cfg: RecipeConfig) -> bool:
    """Step 0, powers of two below `eval.every` (if log-spaced), then multiples of `eval.every`."""
    every = cfg.eval.every
    if step % every == 0:
        return True
    return cfg.eval.log_spaced and step < every and step & (step - 1) == 0


# ---------------------------------------------------------------------------------------------
# Checks: what this engine cannot do fails before any work


def check_engine(cfg: RecipeConfig) -> None:
    """The engines this version runs: torch everywhere, DeepSpeed (ZeRO stages 0-2) for the trainers
    where it is installed, vLLM on generator ranks (`recipe.roles`); `auto` means vLLM and DeepSpeed
    on a machine with CUDA, torch without."""
    import importlib.util
    import sys

    has_cuda = torch.cuda.is_available()
    requested = cfg.engine.generator
    resolved = ("vllm" if has_cuda else "torch") if requested == "auto" else requested
    if resolved == "vllm" and not cfg.engine.generator_ranks:
        raise NotAvailableError(
            f"engine.generator={requested!r} (the vllm engine) is not available yet in this version; "
            "set engine.generator=torch to train with plain torch on CPU"
        )
    requested = cfg.engine.trainer
    resolved = ("deepspeed" if has_cuda else "torch") if requested == "auto" else requested
    if resolved != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise NotAvailableError(
            f"engine.trainer={requested!r} (the deepspeed engine) needs the deepspeed package, which "
            f"{sys.executable} cannot import; install it (pip install -e '.[gpu]', on CPU '.[deepspeed]') "
            "or set engine.trainer=torch"
        )
    if cfg.engine.zero_stage == 3:
        raise NotAvailableError(
            "engine.zero_stage=3 (weights sharded over the trainer ranks) is not available yet in this version: "
            "trainer rank 0 samples, evaluates and pushes with the whole weights; set engine.zero_stage to 0, 1 or 2"
        )


def job_gpus(team: Team | None) -> int:
    """The GPUs the run's job holds, all tasks together (what one second of a step costs in GPU-seconds)."""
    if team is not None:
        return team.num_gpus
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_budget(cfg: RecipeConfig, num_gpus: int) -> None:
    """A budget the job can reach: GPU-hours (device seconds x the job's GPUs) only where it holds
    GPUs. `sweep launch` refuses budget.gpu_hours for a CPU target (`launcher.target`); this is
    the job's own guard for a job that got no GPU."""
    if num_gpus == 0 and cfg.budget.steps is None and cfg.budget.flops is None:
        raise ConfigError(
            "budget.gpu_hours",
            "this job holds no GPU and spends no GPU-hours, so budget.gpu_hours alone never "
            "ends a run; set budget.steps or budget.flops, or run on a GPU node",
        )


def generation_cap(cfg: RecipeConfig, task: Task, log: Callable[[str], None]) -> int:
    """The most new tokens per completion; refuses an interrupt budget that could be reached on a
    task without a thinking phase."""
    cap = min(task.max_new_tokens, cfg.length.max_new_tokens)
    length = cfg.length
    if length.control != "interrupt":
        return cap
    if length.interrupt_min >= cap:
        log(
            f"length.control=interrupt: budgets of {length.interrupt_min}-{length.interrupt_max} "
            f"tokens lie beyond the {cap}-token cap, so no completion is interrupted"
        )
    elif task.interrupt_phrase is None:
        raise NotAvailableError(
            f"length.control=interrupt with length.interrupt_min={length.interrupt_min} below the "
            f"generation cap of {cap} tokens: forced interruption is not available yet for {task.name}, which "
            f"has no thinking phase to interrupt; raise length.interrupt_min to >= {cap} or use "
            "length.control=penalty or none"
        )
    return cap


def interrupt_rule(
    cfg: RecipeConfig, task: Task, tokenizer: PreTrainedTokenizerFast, cap: int, log: Callable[[str], None]
) -> InterruptRule | None:
    """How `length.control=interrupt` forces answers on this task and tokenizer; None where no
    budget can be reached (`generation_cap` has refused the cases that cannot work)."""
    length = cfg.length
    if length.control != "interrupt" or length.interrupt_min >= cap or task.interrupt_phrase is None:
        return None
    close_ids = tokenizer(task.think_close, add_special_tokens=False).input_ids
    phrase_ids = tuple(tokenizer(task.interrupt_phrase, add_special_tokens=False).input_ids)
    if len(close_ids) != 1 or phrase_ids[-1:] != tuple(close_ids):
        raise NotAvailableError(
            f"length.control=interrupt: the model's tokenizer does not write {task.think_close!r} as one token, "
            "so the end of thinking cannot be detected; use length.control=penalty or none"
        )
    room = cap - len(phrase_ids) - task.answer_tokens
    if length.interrupt_max > room:
        raise ConfigError(
            "length.interrupt_max",
            f"{length.interrupt_max}: an interrupt at that thinking budget leaves no room for the answer under the "
            f"{cap}-token generation cap (the phrase takes {len(phrase_ids)} tokens, the answer at least "
            f"{task.answer_tokens}); lower it to <= {room} or raise length.max_new_tokens",
        )
    log(
        f"length.control=interrupt: thinking budgets drawn from {length.interrupt_min}-{length.interrupt_max} tokens, "
        f"then {task.interrupt_phrase!r} is appended ({len(phrase_ids)} tokens) and the answer follows"
    )
    return InterruptRule(close_ids[0], phrase_ids, length.interrupt_min, length.interrupt_max)


# ---------------------------------------------------------------------------------------------
# Set-up and resume


def initial_state(
    cfg: RecipeConfig, task: Task, max_new_tokens: int, log: Callable[[str], None], team: Team | None = None
) -> RunState:
    """The policy at step 0, its trainer, and seeded random streams."""
    model, tokenizer = load_policy(
        resolve_model_dir(cfg.model.path, log), dtype=cfg.model.dtype, lm_head_fp32=cfg.precision.lm_head_fp32
    )
    device = policy_device()
    model.to(device)  # before the optimizer: its state is made where the parameters are
    # Nothing here draws from the global generators; seed them for any library code that does.
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    optimizer = build_optimizer(cfg, model)
    num_matmul_params = matmul_param_count(model)
    train_prompt_ids, train_prompt_mask = task.encode(tokenizer, task.train_prompts)
    valid_prompt_ids, valid_prompt_mask = task.encode(tokenizer, task.valid_prompts)
    log(f"policy: {sum(p.numel() for p in model.parameters())} parameters ({num_matmul_params} in matmuls)")
    trainer = build_trainer(cfg, model, optimizer)
    return RunState(
        cfg=cfg,
        task=task,
        model=model,
        tokenizer=tokenizer,
        trainer=team.lead(trainer) if team is not None else trainer,
        drawer=PromptDrawer(len(task.train_prompts), seed=_seed(_PROMPT_STREAM, cfg.seed)),
        generator=torch.Generator().manual_seed(_seed(_SAMPLING_STREAM, cfg.seed)),
        train_prompt_ids=train_prompt_ids,
        valid_prompt_ids=valid_prompt_ids,
        max_new_tokens=max_new_tokens,
        num_matmul_params=num_matmul_params,
        train_prompt_mask=train_prompt_mask,
        valid_prompt_mask=valid_prompt_mask,
        num_gpus=job_gpus(team),
        device_generator=_device_generator(device, _seed(_SAMPLING_STREAM, cfg.seed)),
    )


def policy_device() -> torch.device:
    """Where this process keeps the policy: the GPU a multi-task run's role set as current
    (`recipe.roles`), GPU 0 in a one-task run, the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _device_generator(device: torch.device, seed: int) -> torch.Generator | None:
    return None if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)


def sample_on_policy(
    state: RunState,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor | None,
    generator: torch.Generator,
    interrupt: Interrupt | None,
    *,
    compiled: bool = False,
) -> Completions:
    """`sample` from trainer rank 0's policy where it lives; the completions on the CPU.
    compiled: decode through `torch.compile` (the training batches of `engine.kernels=compiled`)."""
    device = next(state.model.parameters()).device
    out = sample(
        state.model,
        prompt_ids_BP.to(device),
        max_new_tokens=state.max_new_tokens,
        eos_id=state.tokenizer.eos_token_id,
        pad_id=state.tokenizer.pad_token_id,
        generator=generator,
        prompt_mask_BP=None if prompt_mask_BP is None else prompt_mask_BP.to(device),
        interrupt=interrupt,
        compiled=compiled,
    )
    return _to_cpu(out)


def _to_cpu(completions: Completions) -> Completions:
    """Completions sampled on a GPU, brought to the CPU: scoring, rewards and the batch the trainer
    receives (it moves it to its own device) are the same for every engine."""
    if completions.tokens_BT.device.type == "cpu":
        return completions
    return Completions(
        tokens_BT=completions.tokens_BT.cpu(),
        logp_BT=completions.logp_BT.cpu(),
        mask_BT=completions.mask_BT.cpu(),
        finished_B=completions.finished_B.cpu(),
        forced_BT=None if completions.forced_BT is None else completions.forced_BT.cpu(),
    )


def build_optimizer(cfg: RecipeConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW; with `engine.kernels` fast or compiled on the torch trainer, torch's fused AdamW (one
    kernel over all parameters: the same update, rounded differently). DeepSpeed keeps the unfused one."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        fused=True if cfg.engine.kernels != "reference" and not uses_deepspeed(cfg) else None,
    )


def uses_deepspeed(cfg: RecipeConfig) -> bool:
    """`engine.trainer` resolved: DeepSpeed when asked for, or `auto` with CUDA."""
    requested = cfg.engine.trainer
    return requested == "deepspeed" or (requested == "auto" and torch.cuda.is_available())


def build_trainer(cfg: RecipeConfig, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> Trainer:
    """`engine.trainer`'s engine (auto: DeepSpeed with CUDA, torch without) on this rank's share of
    the trainers' group (if there is one; the DeepSpeed trainer makes a one-rank group if not)."""
    if uses_deepspeed(cfg):  # engine.kernels is the torch trainer's: DeepSpeed computes as reference
        from recipe.engines.deepspeed_trainer import DeepspeedTrainer  # imports deepspeed: only when asked for

        return DeepspeedTrainer(
            model, optimizer, cfg.loss, max_grad_norm=cfg.optim.max_grad_norm, zero_stage=cfg.engine.zero_stage
        )
    return TorchTrainer(model, optimizer, cfg.loss, max_grad_norm=cfg.optim.max_grad_norm, kernels=cfg.engine.kernels)


def resume(state: RunState, run_dir: Path, sink: Sink, log: Callable[[str], None]) -> int | None:
    """Restore the newest valid checkpoint into `state`; its step, or None for a fresh run."""
    saved = checkpoint.load_newest_valid(
        run_dir, log, on_discarded=sink.checkpoint_deleted, check=state.trainer.check_state
    )
    if saved is None:
        return None
    changed = _changed_keys(saved["config"], state.cfg.to_dict())
    if changed:
        log(f"config changed since the checkpoint: {', '.join(changed)}")
    state.trainer.load_state_dict({"model": saved["model"], "optimizer": saved["optimizer"]})
    state.step = saved["step"]
    state.compute = Compute(**saved["compute"])
    state.drawer.load_state_dict(saved["prompts"])
    state.pending = [Rollout.from_dict(r) for r in saved["pending"]]
    _restore_rng(state, saved["rng"])
    sink.resumed(state.step)
    log(f"resumed from step {state.step}")
    return state.step


def save_checkpoint(state: RunState, run_dir: Path, sink: Sink) -> None:
    path = checkpoint.save(run_dir, state.step, checkpoint_state(state))
    sink.checkpoint_saved(state.step, str(path))
    for step in checkpoint.prune(run_dir, state.cfg.checkpoint.keep):
        sink.checkpoint_deleted(step)


def checkpoint_state(state: RunState) -> dict[str, Any]:
    """What a checkpoint holds: everything that a resumed run needs to continue identically."""
    np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "format": checkpoint.FORMAT_VERSION,
        "step": state.step,
        **state.trainer.state_dict(),  # model, optimizer
        "compute": asdict(state.compute),
        "prompts": state.drawer.state_dict(),
        "pending": [r.to_dict() for r in state.pending],
        "rng": {
            "sampling": state.generator.get_state(),
            **({} if state.device_generator is None else {"sampling_device": state.device_generator.get_state()}),
            "torch": torch.get_rng_state(),
            "numpy": (np_name, np_key.tolist(), np_pos, np_has_gauss, np_gauss),
            "python": random.getstate(),
        },
        "config": state.cfg.to_dict(),
    }


def _restore_rng(state: RunState, rng: dict[str, Any]) -> None:
    state.generator.set_state(rng["sampling"])
    if state.device_generator is not None and "sampling_device" in rng:
        state.device_generator.set_state(rng["sampling_device"])
    torch.set_rng_state(rng["torch"])
    np_name, np_key, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    np.random.set_state((np_name, np.array(np_key, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    random.setstate(rng["python"])


def _changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    old_flat, new_flat = flatten(old), flatten(new)
    return sorted(k for k in new_flat.keys() | old_flat.keys() if old_flat.get(k) != new_flat.get(k))


def _seed(stream: int, *keys: int) -> int:
    """An independent seed per random stream (and per eval step), from the run's seed."""
    return int(np.random.SeedSequence([stream, *keys]).generate_state(1)[0])


# ---------------------------------------------------------------------------------------------
# Generation and rewards


class LocalRollouts:
    """One task: trainer rank 0 generates its own batches with the policy it trains (alternating)."""

    def next_rollout(self, state: RunState) -> Rollout:
        if not state.pending:
            state.pending = generate_round(state)
        return state.pending.pop(0)

    def after_step(self, state: RunState) -> dict[str, float]:
        return {}  # the next batch is sampled from state.model, which the step has just updated

    def close(self) -> None:
        pass


def generate_round(state: RunState) -> list[Rollout]:
    """The batches one policy generates: k under ppo-offpolicy, one under pipeline."""
    cfg = state.cfg
    num_batches = cfg.async_.max_lag if cfg.async_.mode == "ppo-offpolicy" else 1
    batches = []
    for _ in range(num_batches):
        if state.drawer.num_active < cfg.batch.prompts:
            break
        batches.append(generate_batch(state))
    return batches


def generate_batch(state: RunState) -> Rollout:
    """Draw prompts, sample their groups, score them, and retire prompts the policy has mastered."""
    cfg, task = state.cfg, state.task
    num_prompts, group_size = cfg.batch.prompts, cfg.batch.generations
    rows_P = torch.from_numpy(state.drawer.draw(num_prompts))
    prompt_ids_BP = state.train_prompt_ids[rows_P].repeat_interleave(group_size, dim=0)
    interrupt = None if state.interrupt is None else state.interrupt.draw(len(prompt_ids_BP), state.generator)
    mask_BP = _prompt_mask(state.train_prompt_mask, rows_P, group_size)
    generator = state.device_generator or state.generator
    # Evaluation samples as the other kernels do (one yardstick); DeepSpeed runs compute as reference.
    compiled = cfg.engine.kernels == "compiled" and not uses_deepspeed(cfg)
    completions = sample_on_policy(state, prompt_ids_BP, mask_BP, generator, interrupt, compiled=compiled)
    prompts = [task.train_prompts[int(r)] for r in rows_P for _ in range(group_size)]
    passes_B = torch.tensor(task.score(prompts, decode(state.tokenizer, completions)))
    rewards_B = shaped_rewards(passes_B, completions.lengths_B, cfg)
    passes_PG = passes_B.view(num_prompts, group_size)
    if cfg.filter.no_positive_resampling:
        state.drawer.retire(rows_P[passes_PG.mean(dim=1) >= cfg.filter.npr_threshold].numpy())
    positions = prompt_ids_BP.numel() + int(completions.lengths_B.sum())
    state.compute.flops += 2 * state.num_matmul_params * positions
    state.compute.tokens += int(completions.lengths_B.sum())
    return Rollout(
        prompt_rows_P=rows_P,
        prompt_ids_BP=prompt_ids_BP,
        completions=completions,
        rewards_PG=rewards_B.view(num_prompts, group_size),
        passes_PG=passes_PG,
        policy_version=state.step,
    )


def _prompt_mask(mask: torch.Tensor | None, rows: torch.Tensor, repeats: int) -> torch.Tensor | None:
    """The prompt mask of `rows`, each row repeated `repeats` times (None: prompts are unpadded)."""
    return None if mask is None else mask[rows].repeat_interleave(repeats, dim=0)


def shaped_rewards(passes_B: torch.Tensor, lengths_B: torch.Tensor, cfg: RecipeConfig) -> torch.Tensor:
    """The task reward, plus DAPO's overlong penalty under `length.control=penalty`."""
    if cfg.length.control != "penalty":
        return passes_B
    return passes_B + overlong_penalty(lengths_B, cfg.length.penalty_max, cfg.length.penalty_cache)


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    c = rollout.completions
    return {
        "reward_mean": float(rollout.rewards_PG.mean()),
        "pass_rate": float(rollout.passes_PG.mean()),
        "mean_length": float(c.lengths_B.float().mean()),
        "truncation_rate": float((~c.finished_B).float().mean()),
        "interrupted_fraction": float(c.interrupted_B.float().mean()),
        "entropy": _entropy_estimate(c),
    }


def _entropy_estimate(c: Completions) -> float:
    """-E[log pi(y_t)] over sampled tokens: an unbiased estimate of the per-token entropy, for free."""
    return float(-c.logp_BT[loss_mask(c)].mean())


# ---------------------------------------------------------------------------------------------
# The policy update


def policy_update(state: RunState, rollout: Rollout) -> dict[str, float]:
    """Advantages, the zero-variance filter, and one optimizer step when any group is left."""
    zero_variance_P = zero_variance_groups(rollout.rewards_PG)
    keep_P = ~zero_variance_P if state.cfg.filter.zero_variance else torch.ones_like(zero_variance_P)
    metrics = {
        "zero_variance_fraction": float(zero_variance_P.float().mean()),
        "num_trained_groups": int(keep_P.sum()),
        "lr": lr_at(state.step, state.cfg),
    }
    if keep_P.any():
        metrics |= gradient_step(state, rollout, keep_P)
    return metrics


def gradient_step(state: RunState, rollout: Rollout, keep_P: torch.Tensor) -> dict[str, float]:
    """One optimizer step of the trainer engine on the kept groups (loss, backward, clip, AdamW)."""
    batch = train_batch(rollout, keep_P, state.train_prompt_mask, state.cfg)
    metrics = state.trainer.step(batch, lr=lr_at(state.step, state.cfg))
    state.compute.flops += 6 * state.num_matmul_params * (batch.prompt_ids_BP.numel() + int(batch.mask_BT.sum()))
    return metrics


def train_batch(
    rollout: Rollout, keep_P: torch.Tensor, train_prompt_mask: torch.Tensor | None, cfg: RecipeConfig
) -> TrainBatch:
    """The kept groups with their advantages, as every trainer rank receives them."""
    group_size = cfg.batch.generations
    keep_B = keep_P.repeat_interleave(group_size)
    c = rollout.completions
    prompt_mask_BP = _prompt_mask(train_prompt_mask, rollout.prompt_rows_P, group_size)
    return TrainBatch(
        prompt_ids_BP=rollout.prompt_ids_BP[keep_B],
        prompt_mask_BP=None if prompt_mask_BP is None else prompt_mask_BP[keep_B],
        tokens_BT=c.tokens_BT[keep_B],
        behaviour_logp_BT=c.logp_BT[keep_B],
        mask_BT=loss_mask(c)[keep_B],
        adv_B=group_advantages(rollout.rewards_PG[keep_P], cfg.advantage.norm).flatten(),
        group_size=group_size,
    )


def loss_mask(c: Completions) -> torch.Tensor:
    """The tokens the policy chose: the completion without what an interrupt forced."""
    return c.mask_BT if c.forced_BT is None else c.mask_BT & ~c.forced_BT


def lr_at(step: int, cfg: RecipeConfig) -> float:
    """The lr of the step that follows `step`: linear warm-up over `optim.warmup_steps`, then constant."""
    warmup = cfg.optim.warmup_steps
    return cfg.optim.lr * min(1.0, (step + 1) / warmup) if warmup else cfg.optim.lr


# ---------------------------------------------------------------------------------------------
# Evaluation


def report_eval(state: RunState, sink: Sink, log: Callable[[str], None]) -> None:
    result = evaluate(state)
    compute = state.compute
    point = {
        "step": state.step,
        "pass_rate": result.pop("pass_rate"),
        "num_samples": result.pop("num_samples"),
        **asdict(compute),
        "metrics": result | {f"train_{k}": v for k, v in state.last_metrics.items()},
    }
    sink.eval_point(point)
    log(
        f"step {state.step:>6}  pass_rate {point['pass_rate']:.3f}  "
        f"train_reward {state.last_metrics.get('reward_mean', math.nan):.3f}  "
        f"flops {compute.flops:.3g}  device_s {compute.device_seconds:.1f}"
    )


def evaluate(state: RunState) -> dict[str, Any]:
    """Held-out mean@k pass rate, with mean length, truncation rate and entropy of the samples."""
    cfg, task = state.cfg, state.task
    k = cfg.eval.samples
    prompt_ids = state.valid_prompt_ids.repeat_interleave(k, dim=0)
    prompt_mask = _prompt_mask(state.valid_prompt_mask, torch.arange(len(task.valid_prompts)), k)
    prompts = [p for p in task.valid_prompts for _ in range(k)]
    generator = torch.Generator().manual_seed(_seed(_EVAL_STREAM, cfg.seed, state.step))
    device = next(state.model.parameters()).device
    token_generator = _device_generator(device, _seed(_EVAL_STREAM, cfg.seed, state.step)) or generator
    passes, lengths, finished, interrupted, logps = [], [], [], [], []
    for start in range(0, len(prompts), EVAL_CHUNK):
        chunk = prompt_ids[start : start + EVAL_CHUNK]
        interrupt = None if state.interrupt is None else state.interrupt.draw(len(chunk), generator)
        chunk_mask = None if prompt_mask is None else prompt_mask[start : start + EVAL_CHUNK]
        out = sample_on_policy(state, chunk, chunk_mask, token_generator, interrupt)
        passes += task.score(prompts[start : start + EVAL_CHUNK], decode(state.tokenizer, out))
        lengths.append(out.lengths_B)
        finished.append(out.finished_B)
        interrupted.append(out.interrupted_B)
        logps.append(out.logp_BT[loss_mask(out)])
    return {
        "pass_rate": float(np.mean(passes)),
        "num_samples": len(passes),
        "mean_length": float(torch.cat(lengths).float().mean()),
        "truncation_rate": float((~torch.cat(finished)).float().mean()),
        "interrupted_fraction": float(torch.cat(interrupted).float().mean()),
        "entropy": float(-torch.cat(logps).mean()),
        **pass_rate_by_difficulty(task, prompts, passes),
    }


def pass_rate_by_difficulty(task: Task, prompts: list[str], passes: list[float]) -> dict[str, float]:
    """`pass_rate_<level>` for each difficulty level of a task that has them (sumk: `pass_rate_k5`)."""
    if task.difficulty is None:
        return {}
    by_level: dict[int, list[float]] = {}
    for prompt, passed in zip(prompts, passes):
        by_level.setdefault(task.difficulty(prompt), []).append(passed)
    prefix = "pass_rate_k" if task.name == "sumk" else "pass_rate_level"
    return {f"{prefix}{level}": float(np.mean(v)) for level, v in sorted(by_level.items())}
