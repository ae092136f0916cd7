"""Losses against closed forms: values, gradients (stop-gradient), clip regions, aggregation,
and invariance to micro-batching."""

import itertools
import math

import pytest
import torch

from recipe.config import LossConfig
from recipe.loop.losses import (
    BatchCounts,
    aggregate,
    batch_counts,
    cispo_loss,
    dapo_loss,
    group_token_counts,
    grpo_loss,
    gspo_loss,
    policy_loss,
    token_losses,
)

ALL_TOKENS = torch.ones(1, 1, dtype=torch.bool)


def token_grad(loss_fn, ratio: float, adv: float, **kwargs) -> tuple[float, float]:
    """Value and d loss / d logp for one token whose trainer/behaviour ratio is `ratio`."""
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    behaviour = logp.detach() - math.log(ratio)
    loss = loss_fn(logp, behaviour, torch.tensor([adv]), ALL_TOKENS, **kwargs).sum()
    loss.backward()
    return loss.item(), logp.grad.item()


# ---------------------------------------------------------------------------------------------
# CISPO


@pytest.mark.parametrize(("ratio", "adv"), [(0.3, 1.0), (1.0, -2.0), (4.0, 1.5), (9.0, 1.0), (9.0, -1.0)])
def test_cispo_value_and_gradient_use_the_capped_ratio_as_a_constant(ratio, adv):
    value, grad = token_grad(cispo_loss, ratio, adv, eps_max=5.0)
    weight = min(ratio, 5.0)
    assert value == pytest.approx(-weight * adv * math.log(0.5), rel=1e-5)
    # stop-gradient: d/dlogp [-w A logp] = -w A; without it there would be an extra -ratio A logp term
    assert grad == pytest.approx(-weight * adv, rel=1e-5)


def test_cispo_keeps_a_gradient_where_ppo_clipping_silences_the_token():
    _, cispo_grad = token_grad(cispo_loss, 2.0, 1.0, eps_max=5.0)
    _, dapo_grad = token_grad(dapo_loss, 2.0, 1.0, clip_low=0.2, clip_high=0.28)
    assert cispo_grad == pytest.approx(-2.0, rel=1e-5)
    assert dapo_grad == 0.0


# ---------------------------------------------------------------------------------------------
# PPO-style clipping: DAPO (asymmetric) and GRPO (symmetric)


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped"),
    [
        (1.1, 1.0, False),  # inside the range
        (1.5, 1.0, True),  # above 1 + high with A > 0: clipped
        (1.5, -1.0, False),  # above 1 + high with A < 0: the unclipped branch is the minimum
        (0.5, -1.0, True),  # below 1 - low with A < 0: clipped
        (0.5, 1.0, False),  # below 1 - low with A > 0: unclipped
    ],
)
def test_dapo_clip_regions(ratio, adv, clipped):
    value, grad = token_grad(dapo_loss, ratio, adv, clip_low=0.2, clip_high=0.28)
    bounded = min(max(ratio, 0.8), 1.28)
    assert value == pytest.approx(-min(ratio * adv, bounded * adv), rel=1e-5)
    assert grad == (0.0 if clipped else pytest.approx(-ratio * adv, rel=1e-5))


def test_dapo_upper_clip_is_wider_than_grpo_symmetric_clip():
    # ratio 1.25, A > 0: inside DAPO's 1.28 but above GRPO's 1.2
    assert token_grad(dapo_loss, 1.25, 1.0, clip_low=0.2, clip_high=0.28)[1] == pytest.approx(-1.25, rel=1e-5)
    value, grad = token_grad(grpo_loss, 1.25, 1.0, clip=0.2)
    assert (value, grad) == (pytest.approx(-1.2), 0.0)
    # and GRPO clips symmetrically below
    assert token_grad(grpo_loss, 0.75, -1.0, clip=0.2)[1] == 0.0


# ---------------------------------------------------------------------------------------------
# GSPO


def test_gspo_uses_the_geometric_mean_sequence_ratio():
    ratios = torch.tensor([[1.002, 0.999, 1.004, 5.0]])  # the last token is masked out
    mask = torch.tensor([[True, True, True, False]])
    logp = torch.full((1, 4), math.log(0.25), requires_grad=True)
    behaviour = logp.detach() - ratios.log()
    seq_ratio = (1.002 * 0.999 * 1.004) ** (1 / 3)
    loss_BT = gspo_loss(logp, behaviour, torch.tensor([2.0]), mask, clip_low=3e-3, clip_high=5e-3)
    loss = aggregate(loss_BT, mask, "sample", torch.tensor([3]), BatchCounts(3, 1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(-seq_ratio * 2.0, rel=1e-5)
    # d/dlogp_t of -s A with s = exp(mean log ratio): -A s / |y| on every unmasked token
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 * seq_ratio / 3] * 3 + [0.0]]))


def test_gspo_clips_the_sequence_ratio():
    logp = torch.full((1, 2), math.log(0.5), requires_grad=True)
    behaviour = logp.detach() - math.log(1.01)  # every token ratio 1.01: sequence ratio 1.01 > 1.005
    loss = gspo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), 3e-3, 5e-3)
    loss.sum().backward()
    torch.testing.assert_close(loss, torch.full((1, 2), -1.005))
    assert torch.equal(logp.grad, torch.zeros(1, 2))


# ---------------------------------------------------------------------------------------------
# Aggregation

# Two groups of two sequences; lengths 1, 3 | 2, 2.
MASK_BT = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
LOSS_BT = torch.tensor([[1.0, 100.0, 100.0], [2.0, 3.0, 4.0], [5.0, 6.0, 100.0], [7.0, 8.0, 100.0]])


def test_group_token_counts_and_batch_counts():
    assert group_token_counts(MASK_BT, group_size=2).tolist() == [4, 4, 4, 4]
    assert batch_counts(MASK_BT, group_size=2) == BatchCounts(num_tokens=8, num_sequences=4, num_groups=2)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("prompt", ((1 + 2 + 3 + 4) / 4 + (5 + 6 + 7 + 8) / 4) / 2),
        ("sample", (1 / 1 + (2 + 3 + 4) / 3 + (5 + 6) / 2 + (7 + 8) / 2) / 4),
        ("token", (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 8),
    ],
)
def test_aggregation_closed_forms(aggregation, expected):
    counts = batch_counts(MASK_BT, 2)
    loss = aggregate(LOSS_BT, MASK_BT, aggregation, group_token_counts(MASK_BT, 2), counts)
    assert loss.item() == pytest.approx(expected)


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="loss.aggregation"):
        aggregate(LOSS_BT, MASK_BT, "group", group_token_counts(MASK_BT, 2), batch_counts(MASK_BT, 2))


def test_masked_positions_cannot_overflow_the_loss():
    logp = torch.tensor([[-0.1, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-0.2, -1000.0]])  # the masked token's ratio would be exp(1000)
    mask = torch.tensor([[True, False]])
    for loss_type in ("cispo", "dapo", "grpo", "gspo"):
        cfg = LossConfig(type=loss_type)
        loss = policy_loss(cfg, logp, behaviour, torch.tensor([1.0]), mask, torch.tensor([1]), BatchCounts(1, 1, 1))
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), loss_type
        assert grad[0, 1] == 0.0, loss_type


# ---------------------------------------------------------------------------------------------
# Micro-batching changes nothing


def random_batch(seed: int, group_size: int = 3, num_groups: int = 4, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    size = group_size * num_groups
    lengths = torch.randint(1, length + 1, (size,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    logp = -torch.rand(size, length, generator=gen) * 3
    behaviour = logp + (torch.rand(size, length, generator=gen) - 0.5) * 0.6
    adv = torch.randn(size, generator=gen)
    return logp, behaviour, adv, mask


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    list(itertools.product(["cispo", "dapo", "grpo", "gspo"], ["prompt", "sample", "token"])),
)
def test_micro_batches_sum_to_the_full_batch_loss_and_gradient(loss_type, aggregation):
    cfg = LossConfig(type=loss_type, aggregation=aggregation, gspo_clip_low=0.2, gspo_clip_high=0.2)
    logp, behaviour, adv, mask = random_batch(seed=7)
    group_tokens, counts = group_token_counts(mask, 3), batch_counts(mask, 3)

    full_logp = logp.clone().requires_grad_(True)
    full = policy_loss(cfg, full_logp, behaviour, adv, mask, group_tokens, counts)
    full.backward()

    micro_logp = logp.clone().requires_grad_(True)
    total = torch.zeros(())
    for part in (slice(0, 2), slice(2, 7), slice(7, 12)):  # cuts through groups on purpose
        partial = policy_loss(cfg, micro_logp[part], behaviour[part], adv[part], mask[part], group_tokens[part], counts)
        partial.backward()
        total = total + partial.detach()

    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(micro_logp.grad, full_logp.grad)
    assert full_logp.grad.abs().sum() > 0


def test_token_losses_dispatches_on_loss_type():
    logp, behaviour, adv, mask = random_batch(seed=1)
    cfg = LossConfig(type="grpo", clip_low=0.1)
    torch.testing.assert_close(
        token_losses(cfg, logp, behaviour, adv, mask), grpo_loss(logp, behaviour, adv, mask, 0.1)
    )
