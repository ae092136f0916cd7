"""Generation and rewards: where trainer rank 0's batches come from, and how one is sampled and scored.

A batch is `batch.prompts` training prompts x `batch.generations` completions, sampled at
temperature 1 with no top-p or top-k, each token's behaviour log-prob recorded; rewards are the
task's own, plus DAPO's overlong penalty under `length.control=penalty`. One task generates its
own batches (`LocalRollouts`: k per policy under ppo-offpolicy, one under pipeline); a multi-task
run streams them from generator ranks (`recipe.pipeline.lead.PipelineRollouts`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from recipe.config import RecipeConfig
from recipe.loop.advantages import overlong_penalty
from recipe.loop.colocated import draw_seed
from recipe.loop.state import Rollout, RunState, uses_deepspeed
from recipe.model.sampler import Completions, Interrupt, Sampling, decode, sample


class StopBeforeStep(Exception):
    """A rollout source gives up on the next batch because a stop signal arrived (its peers
    stop too); the loop checkpoints the last step taken and returns."""


class RolloutSource(Protocol):
    """Where trainer rank 0's batches come from: this process (`LocalRollouts`) or generator
    ranks streaming under PipelineRL-k (`recipe.pipeline.lead.PipelineRollouts`)."""

    def next_rollout(self, state: RunState) -> Rollout: ...

    def after_step(self, state: RunState) -> dict[str, float]:
        """The optimizer step is taken: version `state.step` exists (pipeline: push it). Returns
        metrics of the step's own (the push's time)."""

    def close(self) -> None: ...


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
    mask_BP = prompt_mask(state.train_prompt_mask, rows_P, group_size)
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


def sample_on_policy(
    state: RunState,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor | None,
    generator: torch.Generator,
    interrupt: Interrupt | None,
    *,
    compiled: bool = False,
) -> Completions:
    """`sample` from trainer rank 0's policy where it lives (or the colocated vLLM engine, loaded
    with it); the completions on the CPU.
    compiled: decode through `torch.compile` (the training batches of `engine.kernels=compiled`)."""
    if state.colocated is not None:
        state.colocated.sync(state.trainer.named_weights, state.step)
        return state.colocated.sample(
            prompt_ids_BP, prompt_mask_BP, max_new_tokens=state.max_new_tokens, seed=draw_seed(generator),
            interrupt=interrupt,
        )  # fmt: skip
    device = next(state.model.parameters()).device
    out = sample(
        state.model, prompt_ids_BP.to(device),
        Sampling(
            max_new_tokens=state.max_new_tokens,
            eos_id=state.tokenizer.eos_token_id,
            pad_id=state.tokenizer.pad_token_id,
            generator=generator,
            prompt_mask_BP=None if prompt_mask_BP is None else prompt_mask_BP.to(device),
            interrupt=interrupt,
            compiled=compiled,
        ),
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


def prompt_mask(mask: torch.Tensor | None, rows: torch.Tensor, repeats: int) -> torch.Tensor | None:
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


def loss_mask(c: Completions) -> torch.Tensor:
    """The tokens the policy chose: the completion without what an interrupt forced."""
    return c.mask_BT if c.forced_BT is None else c.mask_BT & ~c.forced_BT
