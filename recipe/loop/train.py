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
   budget gets the end-of-thinking phrase appended and goes on to answer (`recipe.model.sampler`). The
   forced tokens are context for the policy but not its actions: they are left out of the loss.
   A task without a thinking phase (sort6) accepts interrupt only with budgets beyond its cap.
3. Rewards: the task's verifiable reward; with `length.control=penalty` plus DAPO's overlong
   penalty.
4. Advantages: A = r - mean(group r), scaled by `advantage.norm`. With `filter.zero_variance`,
   groups whose rewards are all equal leave the batch before anything is computed on it; a step
   left with fewer than `filter.damp_below` of the batch's groups takes a proportionally smaller lr
   (`recipe.loop.update.step_damping`).
5. Update: `loss.type` on the importance ratio exp(logp_trainer - logp_behaviour), aggregated by
   `loss.aggregation` over whole-batch counts; one AdamW step (lr rising linearly over
   `optim.warmup_steps`, then constant), gradient norm clipped to `optim.max_grad_norm`.

Off-policy modes (`async.mode`, k = `async.max_lag`):

- ppo-offpolicy (PPO-off-policy-k): k batches are generated with one policy, then k optimizer steps
  are taken, one per batch; the i-th step of a round trains on data i policy versions old, so the
  importance ratios move away from 1.
- pipeline (PipelineRL-k): in one task generation and training alternate, so every batch comes
  from the current policy: lag 0, within PipelineRL-k's bound, ratios 1 up to numerics. With
  generator ranks (`engine.generator_ranks`, `recipe.pipeline.lead.PipelineRollouts`) the
  generators stream while weights are pushed in flight after every step, up to k versions ahead.
- Both modes run on generator ranks: there ppo-offpolicy pushes once per round of k steps.

Evaluation: the held-out pass rate, mean@k (k = `eval.samples`) over every held-out prompt, sampled
at temperature 1 with a random stream of its own (seeded by run seed and step), at step 0, at steps
1, 2, 4, 8, ... below `eval.every` (`eval.log_spaced`), every `eval.early_every` steps below
`eval.early_until`, every `eval.every` steps, and at the last step (`EvalConfig.evaluates`).

Compute, cumulative, in every eval point: `flops` = 2·N·(prompt + completion tokens) generated +
6·N·(prompt + completion tokens) trained, with N every parameter but the input embedding table
(`recipe.model.policy.matmul_param_count`; a lookup costs no multiply-adds); attention FLOPs are left
out (tiny at these lengths), and so is evaluation. `tokens` = completion tokens generated for
training. `device_seconds` = wall time of training steps (generation + update), without evaluation
and checkpointing. `gpu_hours` = the job's GPUs x those hours (0 on a CPU); `budget.gpu_hours` stops the
run when they reach it.

Checkpoints (`recipe.loop.checkpoint`) every `checkpoint.every` steps, at the end, and when
`should_stop()` (asked once per step) returns true. A run resumes from its newest valid checkpoint
and continues the same trajectory bit for bit: weights, AdamW state, step (the lr schedule is a
function of it), compute counters, prompt order and NPR state, batches generated but not yet
trained on (ppo-offpolicy), and the random states. The eval stream is seeded per step, so eval
points do not depend on where a run was interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from recipe.config import RecipeConfig
from recipe.loop.checks import check_budget, check_engine, generation_cap, interrupt_rule
from recipe.loop.evaluate import is_eval_step, report_eval
from recipe.loop.lag import lag_metrics
from recipe.loop.rollout import LocalRollouts, RolloutSource, StopBeforeStep, rollout_metrics
from recipe.loop.colocated import colocate
from recipe.loop.state import RunState, Team, initial_state, job_gpus, resume, save_checkpoint, uses_vllm
from recipe.loop.update import policy_update
from recipe.tasks.task import load_task
from recipe.telemetry.sinks import Sink
from recipe.telemetry.waits import WaitWatch


@dataclass(frozen=True)
class TrainOutcome:
    final_step: int
    state: Literal["completed", "stopped"]
    resumed_from_step: int | None


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
    if team is None and uses_vllm(cfg):
        state.colocated, state.trainer = colocate(cfg, state.trainer, state.tokenizer, log)
    try:
        return _loop(state, source, run_dir, sink, should_stop, log, resumed_from)
    finally:
        source.close()
        if state.colocated is not None:
            state.colocated.close()
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
