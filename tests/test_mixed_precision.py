"""Mixed precision: a bf16 body trains on fp32 master weights on every trainer.

At ScaleRL's learning rate (1e-6) an AdamW update is far below half a bf16 ulp of a typical weight,
so stepping the bf16 weights directly leaves them where they were; with fp32 masters the run
follows the fp32 run. `recipe.engines.precision_probe` trains the same tiny Llama on the same 8
batches three ways (fp32; bf16 on the trainer; bf16 stepped directly) and compares how far the
weights moved. Measured here (torch trainer and DeepSpeed ZeRO 0/1/2 alike):

- bf16 with masters: tracking error 0.034 (|delta - delta_fp32| / |delta_fp32|: the bf16 forward
  and backward round the gradients, so the steps differ slightly), moved 1.000 of the fp32 distance;
- bf16 without masters: tracking error 0.993, moved 0.12 (only the ~1% of weights nearest zero,
  whose half ulp is below the update, hop by one ulp, in no particular direction).

Tolerances: with masters, tracking error < 0.1; without, tracking error > 0.9 and moved < 0.25.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from recipe.config import resolve
from recipe.engines.mixed_precision import MASTER_KEY, MasterWeights
from recipe.engines.precision_probe import VOCABULARY, probe, random_batch
from recipe.engines.torch_trainer import shard_loss
from recipe.loop.state import build_optimizer, build_trainer
from recipe.model.policy import TinyLlamaShape, build_tiny_llama, build_tokenizer
from recipe.model.precision import upcast_lm_head

pytestmark = pytest.mark.usefixtures("torch_one_thread")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
TRAINERS = [("torch", 0)] + [
    pytest.param("deepspeed", stage, marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed"))
    for stage in (0, 1, 2)
]


@pytest.mark.parametrize(("trainer", "stage"), TRAINERS)
def test_a_bf16_run_at_lr_1e6_follows_the_fp32_run_and_without_masters_stays_put(trainer, stage):
    result = probe(trainer, zero_stage=stage, steps=8, lr=1e-6)
    assert result.masters.reference_norm > 0
    assert result.masters.tracking_error < 0.1, result
    assert 0.9 < result.masters.moved < 1.1, result
    assert result.no_masters.tracking_error > 0.9, result
    assert result.no_masters.moved < 0.25, result


def test_at_a_large_learning_rate_bf16_moves_without_masters_too():
    """The probe is not rigged: at lr 1e-2 an update is many ulps, and the plain bf16 run moves."""
    result = probe("torch", steps=4, lr=1e-2)
    assert result.no_masters.moved > 0.5 and result.masters.tracking_error < 0.1, result


# ---------------------------------------------------------------------------------------------
# MasterWeights in the torch trainer


def tiny(dtype: torch.dtype) -> torch.nn.Module:
    tokenizer = build_tokenizer(VOCABULARY, eos="<eos>", pad="<pad>")
    model = build_tiny_llama(TinyLlamaShape(num_layers=1, max_positions=16), tokenizer, seed=7)
    return upcast_lm_head(model.to(dtype))


def config(engine: str = "torch", **overrides):
    return resolve({"engine.trainer": engine, "optim.lr": 1e-3, "optim.max_grad_norm": 1.0, **overrides})


def trainer_for(model: torch.nn.Module, engine: str = "torch", **overrides):
    cfg = config(engine, **overrides)
    return build_trainer(cfg, model, build_optimizer(cfg, model))


def test_an_fp32_model_steps_exactly_as_plain_adamw():
    """No master for an fp32 parameter: the optimizer steps the parameters themselves, as before."""
    model = tiny(torch.float32)
    trainer = trainer_for(model)
    assert not trainer.masters.active
    assert all(a is b for a, b in zip(trainer.optimizer.param_groups[0]["params"], model.parameters()))
    reference = tiny(torch.float32)
    optimizer = build_optimizer(config(), reference)
    for seed in range(3):
        batch = random_batch(2, seed)
        trainer.step(batch, lr=1e-3)
        optimizer.zero_grad()
        shard_loss(reference, trainer.loss_cfg, batch, 0, 1)[0].backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(got, want), name


def test_the_optimizer_steps_fp32_masters_and_the_weights_are_them_rounded():
    model = tiny(torch.bfloat16)
    model.model.norm.float()  # a parameter already fp32 keeps no master
    trainer = trainer_for(model)
    stepped = trainer.masters.params()
    assert {p.dtype for p in stepped} == {torch.float32}
    assert len(list(trainer.masters.masters())) == len(list(model.parameters())) - 1
    trainer.step(random_batch(2, 0), lr=1e-3)
    state = trainer.optimizer.state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())  # fp32 optimizer state
    for param, master in trainer.masters.masters():
        assert param.dtype == torch.bfloat16 and param.grad is None
        assert torch.equal(param, master.to(torch.bfloat16))


def test_a_checkpoint_carries_the_masters_and_resumes_exactly_on_either_trainer():
    trainer = trainer_for(tiny(torch.bfloat16))
    for seed in range(2):
        trainer.step(random_batch(2, seed), lr=1e-3)
    state = copy.deepcopy(trainer.state_dict())
    slots = state["optimizer"]["state"]
    assert all(MASTER_KEY in s and s[MASTER_KEY].dtype == torch.float32 for s in slots.values())
    trainer.step(random_batch(2, 5), lr=1e-3)

    resumed = trainer_for(tiny(torch.bfloat16))
    resumed.check_state(state)
    resumed.load_state_dict(copy.deepcopy(state))
    assert MASTER_KEY not in resumed.optimizer.state_dict()["state"][0]  # not kept twice
    resumed.step(random_batch(2, 5), lr=1e-3)
    for (name, got), want in zip(resumed.model.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(got, want), name
    for (_, got), (_, want) in zip(resumed.masters.masters(), trainer.masters.masters()):
        assert torch.equal(got, want)  # the masters, not the bf16 weights, carried the step


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [0, 2])
def test_the_torch_trainers_masters_resume_on_deepspeed(stage):
    trainer = trainer_for(tiny(torch.bfloat16))
    trainer.step(random_batch(2, 0), lr=1e-3)
    state = copy.deepcopy(trainer.state_dict())
    masters = [m.clone() for _, m in trainer.masters.masters()]
    other = trainer_for(tiny(torch.bfloat16), "deepspeed", **{"engine.zero_stage": stage})
    try:
        other.check_state(state)
        other.load_state_dict(copy.deepcopy(state))
        back = other.state_dict()["optimizer"]["state"]
        for i, master in enumerate(masters):
            assert torch.equal(back[i][MASTER_KEY], master), i
    finally:
        other.close()


def test_masters_made_after_a_step_are_refused():
    model = tiny(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2]])).logits.sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="before the optimizer's first step"):
        MasterWeights(optimizer)
