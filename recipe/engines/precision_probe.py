"""Does a bf16 body learn at ScaleRL's learning rates? One probe for the CPU test and the GPU check.

The same tiny Llama trains on the same batches for `steps` steps at `lr` (ScaleRL's 1e-6 by
default) three times, with the run's own trainer and optimizer (`recipe.loop.state.build_trainer`):

- fp32: the reference;
- bf16 (FP32 LM head, as `recipe.model.load_policy` builds it) on the trainer, which steps fp32
  master weights (`recipe.engines.mixed_precision`, DeepSpeed's partitions under ZeRO 1/2);
- bf16 stepped by AdamW directly, no masters: what a trainer without them does.

Each bf16 run is compared with the fp32 run by how its weights moved from where it started
(`delta`; for the run with masters, its fp32 masters: its bf16 weights are those rounded):
`tracking_error` = |delta_bf16 - delta_fp32| / |delta_fp32| (small: it follows the fp32 run) and
`moved` = |delta_bf16| / |delta_fp32| (about 0: it stays put). `tests/test_mixed_precision.py`
runs it on CPU for every trainer; the GPU check runs it on CUDA (a learning signal, not a speed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from recipe.config import RecipeConfig, resolve
from recipe.engines.base import TrainBatch, Trainer
from recipe.engines.mixed_precision import MASTER_KEY
from recipe.engines.torch_trainer import shard_loss
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer
from recipe.model.precision import upcast_lm_head

GROUP_SIZE = 4
VOCABULARY = [f"t{i}" for i in range(14)] + ["<eos>", "<pad>"]


@dataclass(frozen=True)
class Follow:
    """How a bf16 run's weights moved, against the fp32 run's (see the module docstring)."""

    tracking_error: float
    moved: float
    delta_norm: float
    """|delta| of this run; the fp32 run's is `reference_norm`."""
    reference_norm: float


@dataclass(frozen=True)
class ProbeResult:
    masters: Follow
    """bf16 on the trainer (fp32 masters)."""
    no_masters: Follow
    """bf16 stepped by AdamW directly."""
    trainer: str


def random_batch(num_groups: int, seed: int, device: torch.device | str = "cpu") -> TrainBatch:
    """A batch of random prompts, completions, behaviour log-probs and advantages."""
    gen = torch.Generator().manual_seed(seed)
    rows, length, vocab = num_groups * GROUP_SIZE, 6, len(VOCABULARY) - 2
    lengths = torch.randint(2, length + 1, (rows,), generator=gen)
    batch = TrainBatch(
        prompt_ids_BP=torch.randint(0, vocab, (rows, 4), generator=gen),
        prompt_mask_BP=None,
        tokens_BT=torch.randint(0, vocab, (rows, length), generator=gen),
        behaviour_logp_BT=-torch.rand(rows, length, generator=gen) * 3,
        mask_BT=torch.arange(length)[None, :] < lengths[:, None],
        adv_B=torch.randn(rows, generator=gen),
        group_size=GROUP_SIZE,
    )
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return TrainBatch(**{k: move(v) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()})


def probe(
    trainer: str = "torch",
    *,
    zero_stage: int = 2,
    steps: int = 8,
    lr: float = 1e-6,
    device: str = "cpu",
    shape: TinyLlamaShape | None = None,
) -> ProbeResult:
    """The three runs (module docstring) with `trainer` (torch, or deepspeed at `zero_stage`) on `device`."""
    cfg = resolve(
        {
            "engine.trainer": trainer,
            "engine.zero_stage": zero_stage,
            "optim.lr": lr,
            "optim.weight_decay": 0.1,
            "optim.max_grad_norm": 1.0,
        }
    )
    shape = shape or TinyLlamaShape(num_layers=2, max_positions=16)
    tokenizer = build_tokenizer(VOCABULARY, eos="<eos>", pad="<pad>")
    batches = [random_batch(3, seed, device) for seed in range(steps)]

    def policy(dtype: torch.dtype) -> torch.nn.Module:
        return upcast_lm_head(build_tiny_llama(shape, tokenizer, seed=5).to(device=device, dtype=dtype))

    reference = _train_with_trainer(cfg, policy(torch.float32), batches, lr)
    start = {k: v.float().cpu() for k, v in policy(torch.bfloat16).state_dict().items()}
    masters = _train_with_trainer(cfg, policy(torch.bfloat16), batches, lr)
    plain = _train_without_masters(cfg, policy(torch.bfloat16), batches, lr)
    fp32_start = {k: v.float().cpu() for k, v in policy(torch.float32).state_dict().items()}
    want = {k: reference[k] - fp32_start[k] for k in reference}
    name = trainer if trainer == "torch" else f"{trainer} ZeRO-{zero_stage}"
    return ProbeResult(
        masters=_follow({k: masters[k] - start[k] for k in want}, want),
        no_masters=_follow({k: plain[k] - start[k] for k in want}, want),
        trainer=name,
    )


def _train_with_trainer(
    cfg: RecipeConfig, model: torch.nn.Module, batches: Iterable[TrainBatch], lr: float
) -> dict[str, torch.Tensor]:
    """The run's trainer on `batches`; its weights after, in fp32: the masters where it has them."""
    from recipe.loop.state import build_optimizer, build_trainer  # the trainers as a run builds them

    trainer: Trainer = build_trainer(cfg, model, build_optimizer(cfg, model))
    try:
        for batch in batches:
            trainer.step(batch, lr=lr)
        return _master_weights(model, trainer.state_dict())
    finally:
        trainer.close()


def _master_weights(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master from a trainer's checkpoint state (the weight where it is fp32)."""
    slots = state["optimizer"]["state"]
    out = {}
    for i, (name, param) in enumerate(model.named_parameters()):
        master = slots.get(i, {}).get(MASTER_KEY)
        out[name] = (param.detach() if master is None else master).float().cpu()
    return out


def _train_without_masters(
    cfg: RecipeConfig, model: torch.nn.Module, batches: Iterable[TrainBatch], lr: float
) -> dict[str, torch.Tensor]:
    """The same loss, clipping and AdamW, stepping the bf16 weights themselves."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )  # fmt: skip
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        result = shard_loss(model, cfg.loss, batch, 0, 1)
        assert result is not None
        result[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        optimizer.step()
    return {k: v.detach().float().cpu() for k, v in model.named_parameters()}


def _follow(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> Follow:
    flat = lambda d: torch.cat([d[k].cpu().flatten() for k in want])  # noqa: E731
    got_v, want_v = flat(got), flat(want)
    reference = float(want_v.norm())
    return Follow(
        tracking_error=float((got_v - want_v).norm()) / reference,
        moved=float(got_v.norm()) / reference,
        delta_norm=float(got_v.norm()),
        reference_norm=reference,
    )
