"""sumk: prompts, reward, the length ceiling and forced interruption (recipe/tasks/sumk.py)."""

import numpy as np
import pytest

from recipe.tasks import sumk as t


def test_prompt_and_worked_completion():
    prompt = t.make_prompt([3, 1, 4, 1, 5])
    assert prompt == "3 1 4 1 5 _ _ _ _ _ _ _ = <think>"
    assert len(prompt.split()) == t.MAX_DIGITS + 2  # every prompt has the same length
    assert t.prompt_digits(prompt) == [3, 1, 4, 1, 5]
    assert t.answer(prompt) == ["9", "4"]  # sums mod 10 of all digits but the last, and of all
    assert t.worked_completion(prompt) == "3 4 8 9 4 </think> 9 4 </s>"
    assert t.tokens_needed(prompt) == 9 == len(t.worked_completion(prompt).split())
    assert t.answer(t.make_prompt([7])) == ["0", "7"]
    assert all(s in t.VOCABULARY for s in (prompt + " " + t.worked_completion(prompt)).split())


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("3 4 8 9 4 </think> 9 4 </s>", 1.0),
        ("</think> 9 4 </s>", 1.0),  # a lucky guess without thinking still counts
        ("1 1 1 </think> 9 4 </s>", 1.0),  # the scratchpad is not scored
        ("3 4 8 9 4 </think> 4 </s>", 0.0),  # half the check pair
        ("3 4 8 9 4 </think> 9 5 </s>", 0.0),
        ("3 4 8 9 4 </think> 4 9 </s>", 0.0),
        ("3 4 8 9 4 </think> 9 4", 0.0),  # no EOS
        ("3 4 8 9 4 9 4 </s>", 0.0),  # never closed its thinking
        ("</think> </think> 9 4 </s>", 0.0),
    ],
)
def test_reward_scores_only_the_answer_after_thinking(completion, score):
    assert t.reward(t.make_prompt([3, 1, 4, 1, 5]), completion) == score


@pytest.mark.parametrize(
    "prompt",
    ["1 2 =", "1 2 = <think>", "1 _ 2 _ _ _ _ _ _ _ _ _ = <think>", "_ _ _ _ _ _ _ _ _ _ _ _ = <think>"],
)
def test_bad_prompts_are_refused(prompt):
    with pytest.raises(ValueError, match="not a sumk prompt"):
        t.answer(prompt)


def test_digit_counts_outside_the_family_are_refused():
    with pytest.raises(ValueError, match="sumk takes"):
        t.make_prompt([])
    with pytest.raises(ValueError, match="sumk takes"):
        t.make_prompt([1] * (t.MAX_DIGITS + 1))
    with pytest.raises(ValueError, match="digit range"):
        t.prompt_sets(10, 10, 3, 2)


def test_prompt_sets_are_disjoint_fixed_and_mixed():
    train, valid = t.prompt_sets(2000, 500)
    assert not set(train) & set(valid) and len(set(valid)) == 500
    assert t.prompt_sets(2000, 500) == (train, valid)  # the same on every call (and machine)
    assert t.prompt_sets(10, 500)[1] == valid  # held-out set independent of train size
    ks = [len(t.prompt_digits(p)) for p in valid]
    assert set(ks) == set(range(t.DEFAULT_MIN_DIGITS, t.DEFAULT_MAX_DIGITS + 1))


def test_the_mixture_over_k_stays_uniform_where_short_problems_run_out():
    # k = 2 has only 100 distinct prompts; about 91 of them are among 1,000 held-out prompts.
    train, valid = t.prompt_sets(20_000, 1000)
    train_ks = np.array([len(t.prompt_digits(p)) for p in train])
    assert abs((train_ks == 2).mean() - 1 / 11) < 0.01  # repeats keep k uniform
    assert len(set(train) & set(valid)) <= 5  # only where 64 redraws found no unused k = 2 prompt
    # Where the held-out set takes every k = 2 prompt, it repeats them, and so does the train set.
    train, valid = t.prompt_sets(2000, 1000, 2, 3)
    valid_ks = np.array([len(t.prompt_digits(p)) for p in valid])
    assert len({p for p, k in zip(valid, valid_ks) if k == 2}) == 100
    assert abs((valid_ks == 2).mean() - 0.5) < 0.05
    assert abs(np.mean([len(t.prompt_digits(p)) == 2 for p in train]) - 0.5) < 0.05
    one_k = t.prompt_sets(50, 20, 5, 5)
    assert {len(t.prompt_digits(p)) for p in one_k[0] + one_k[1]} == {5}


def test_ceiling_rises_with_budget_and_saturates():
    _, valid = t.prompt_sets(1, 1000)  # k in 2..12
    values = [t.ceiling(valid, b) for b in (3, 6, 10, 15, 64)]
    assert values[0] == 0.0
    assert values == sorted(values) and values[1] < values[2] < values[3]
    assert values[3] < values[4] == 1.0  # 12 running sums + 4 tokens fit in 16, not 15
    # Budget 10 fits k <= 6: 5 of the 11 values of k, the rest guessed (1 in 100).
    assert values[2] == pytest.approx(5 / 11 + 6 / 11 * 0.01, abs=0.04)


def test_interrupt_fires_exactly_at_the_drawn_budget():
    rng = np.random.default_rng(0)
    budgets = [t.draw_interrupt_budget(rng, 3, 6) for _ in range(200)]
    assert set(budgets) == {3, 4, 5, 6}

    def rambler(so_far):  # thinks forever; once its thinking is closed, answers 7 7 and stops
        if t.THINK_CLOSE in so_far:
            return "</s>" if so_far[-2:] == ["7", "7"] else "7"
        return "1"

    for budget in budgets[:20]:
        out, fired = t.generate_with_interrupt(rambler, budget)
        assert fired
        assert out.index(t.THINK_CLOSE) == budget  # forced right after `budget` thinking tokens
        assert out[budget + 1 :] == ["7", "7", "</s>"]


def test_no_interrupt_when_thinking_ends_in_time():
    worked = "3 4 8 9 4 </think> 9 4 </s>".split()

    def policy(so_far):
        return worked[len(so_far)]

    out, fired = t.generate_with_interrupt(policy, 6)
    assert not fired and out == worked
    out, fired = t.generate_with_interrupt(policy, 3)
    assert fired and out[:4] == ["3", "4", "8", t.THINK_CLOSE]
    with pytest.raises(ValueError):
        t.draw_interrupt_budget(np.random.default_rng(0), 5, 4)
