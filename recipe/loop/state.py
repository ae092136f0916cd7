"""A run's state on trainer rank 0, how it is set up at step 0, and how it is saved and resumed.

`RunState` is everything a step reads or changes; `checkpoint_state` is the part that changes, the
checkpoint's contents (`recipe.loop.checkpoint` writes and validates the file). A resumed run
continues the same trajectory bit for bit: weights, AdamW state, step, compute counters, prompt
order and NPR state, batches generated but not yet trained on (ppo-offpolicy), random states.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from recipe.config import RecipeConfig, flatten, resolve_generator
from recipe.engines.base import Trainer
from recipe.engines.torch_trainer import TorchTrainer
from recipe.loop import checkpoint
from recipe.loop.curriculum import PromptDrawer
from recipe.loop.lag import Span
from recipe.model.policy import load_policy, matmul_param_count
from recipe.model.sampler import Completions, InterruptRule
from recipe.tasks.builtin import resolve_model_dir
from recipe.tasks.task import Task
from recipe.telemetry.sinks import Sink

if TYPE_CHECKING:
    from recipe.loop.colocated import ColocatedVllm
    from recipe.loop.rollout import RolloutSource

_SAMPLING_STREAM, _PROMPT_STREAM, _EVAL_STREAM = 1, 2, 3


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
    """Samples the drop rule discarded while this batch was assembled (`recipe.loop.lag`)."""

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
    colocated: ColocatedVllm | None = None
    """The vLLM engine that samples in this process (`generator_ranks: 0` with vLLM); None: the policy samples."""


def job_gpus(team: Team | None) -> int:
    """The GPUs the run's job holds, all tasks together (what one second of a step costs in GPU-seconds)."""
    if team is not None:
        return team.num_gpus
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Team(Protocol):
    """The run's other ranks as trainer rank 0 sees them (`recipe.pipeline`); `SOLO` for one task."""

    num_gpus: int

    def lead(self, trainer: Trainer) -> Trainer:
        """The trainer trainer rank 0 calls: it drives the other trainer ranks' steps too."""
        ...

    def rollouts(self, state: RunState) -> RolloutSource: ...


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
    (`recipe.pipeline`), GPU 0 in a one-task run, the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _device_generator(device: torch.device, seed: int) -> torch.Generator | None:
    return None if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)


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


def uses_vllm(cfg: RecipeConfig) -> bool:
    """`engine.generator` resolved: vLLM when asked for, or `auto` with CUDA and vllm importable
    (on generator ranks; with `generator_ranks: 0` colocated in this process, `recipe.loop.colocated`)."""
    import importlib.util

    has_vllm = cfg.engine.generator != "torch" and importlib.util.find_spec("vllm") is not None
    return resolve_generator(cfg.engine.generator, cuda=torch.cuda.is_available(), vllm=has_vllm) == "vllm"


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
    path = checkpoint.checkpoint_path(run_dir, saved["step"])  # the other trainer ranks read it there
    state.trainer.load_state_dict({"model": saved["model"], "optimizer": saved["optimizer"]}, path=path)
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
