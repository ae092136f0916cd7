"""Advantages, the zero-variance filter and the overlong penalty against closed forms."""

import math

import pytest
import torch

from recipe.loop.advantages import STD_EPS, group_advantages, overlong_penalty, zero_variance_groups

REWARDS_PG = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
CENTRED_PG = torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.25, 0.25, -0.75, 0.25], [0.0, 0.0, 0.0, 0.0]])


def test_none_only_subtracts_the_group_mean():
    torch.testing.assert_close(group_advantages(REWARDS_PG, "none"), CENTRED_PG)


def test_batch_divides_by_the_population_std_of_all_advantages():
    # 8 entries of +-0.25/0.75 pattern and 4 zeros: sum of squares = 2 * (0.5625 + 3 * 0.0625) = 1.5
    batch_std = math.sqrt(1.5 / 12)
    torch.testing.assert_close(group_advantages(REWARDS_PG, "batch"), CENTRED_PG / (batch_std + STD_EPS))


def test_prompt_divides_each_group_by_its_own_std():
    group_std = math.sqrt(0.75 * 0.25)  # a Bernoulli group with one odd reward out of four
    expected = CENTRED_PG.clone()
    expected[:2] /= group_std + STD_EPS
    torch.testing.assert_close(group_advantages(REWARDS_PG, "prompt"), expected)


def test_a_zero_variance_group_stays_zero_and_finite_under_every_norm():
    for norm in ("batch", "prompt", "none"):
        adv = group_advantages(torch.ones(2, 3), norm)
        assert torch.equal(adv, torch.zeros(2, 3)), norm


def test_unknown_norm_and_bad_shape_are_rejected():
    with pytest.raises(ValueError, match="advantage.norm"):
        group_advantages(REWARDS_PG, "group")
    with pytest.raises(ValueError, match="prompts, generations"):
        group_advantages(torch.ones(4), "none")


def test_zero_variance_groups_flags_all_equal_rewards_only():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    assert zero_variance_groups(rewards).tolist() == [True, True, False, True]


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (40, -1.0)],
)
def test_overlong_penalty_is_dapos_soft_ramp(length, expected):
    # L_max = 16, L_cache = 4: free up to 12 tokens, then -1/4 per token, -1 from 16 on.
    penalty = overlong_penalty(torch.tensor([length]), max_length=16, cache_length=4)
    assert penalty.item() == pytest.approx(expected)


def test_overlong_penalty_rejects_an_empty_cache():
    with pytest.raises(ValueError, match="length.penalty_cache"):
        overlong_penalty(torch.tensor([3]), max_length=16, cache_length=0)
