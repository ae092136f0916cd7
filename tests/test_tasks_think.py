"""sumk: prompts, reward, the length ceiling and forced interruption (recipe/tasks_think.py)."""

import numpy as np
import pytest

from recipe import tasks_think as t


def test_prompt_and_worked_completion():
    prompt = t.make_prompt([3, 1, 4, 1, 5])
    assert prompt == "3 1 4 1 5 = <think>"
    assert t.worked_completion(prompt) == "3 4 8 9 4 </think> 4 </s>"
    assert t.tokens_needed(prompt) == 8 == len(t.worked_completion(prompt).split())


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("3 4 8 9 4 </think> 4 </s>", 1.0),
        ("</think> 4 </s>", 1.0),  # a lucky guess without thinking still counts
        ("3 4 8 9 4 </think> 5 </s>", 0.0),
        ("3 4 8 9 4 </think> 4", 0.0),  # no EOS
        ("3 4 8 9 4 4 </s>", 0.0),  # never closed its thinking
        ("</think> </think> 4 </s>", 0.0),
    ],
)
def test_reward_scores_only_the_answer_after_thinking(completion, score):
    assert t.reward("3 1 4 1 5 = <think>", completion) == score


def test_bad_prompts_are_refused():
    with pytest.raises(ValueError, match="sumk takes"):
        t.make_prompt([1])
    with pytest.raises(ValueError, match="not a sumk prompt"):
        t.answer("1 2 =")


def test_prompt_sets_are_disjoint_fixed_and_mixed():
    train, valid = t.prompt_sets(2000, 500)
    assert not set(train) & set(valid) and len(set(train)) == 2000
    assert t.prompt_sets(10, 500)[1] == valid  # held-out set independent of train size
    ks = {len(t.prompt_digits(p)) for p in valid}
    assert ks == set(range(t.MIN_DIGITS, t.MAX_DIGITS + 1))


def test_ceiling_rises_with_budget_and_saturates():
    _, valid = t.prompt_sets(1, 1000)
    values = [t.ceiling(valid, b) for b in (2, 6, 10, 15, 64)]
    assert values[0] == 0.0
    assert values == sorted(values) and values[1] < values[2] < values[3]
    assert values[3] == values[4] == 1.0  # 12 digits + 3 tokens fit in 15
    # Budget 10 fits k <= 7: 6 of the 11 values of k, the rest guessed.
    assert values[2] == pytest.approx(6 / 11 + 5 / 11 * 0.1, abs=0.04)


def test_interrupt_fires_exactly_at_the_drawn_budget():
    rng = np.random.default_rng(0)
    budgets = [t.draw_interrupt_budget(rng, 3, 6) for _ in range(200)]
    assert set(budgets) == {3, 4, 5, 6}

    def rambler(so_far):  # thinks forever; once its thinking is closed, answers 7 and stops
        if t.THINK_CLOSE in so_far:
            return "</s>" if so_far[-1] == "7" else "7"
        return "1"

    for budget in budgets[:20]:
        out, fired = t.generate_with_interrupt(rambler, budget)
        assert fired
        assert out.index(t.THINK_CLOSE) == budget  # forced right after `budget` thinking tokens
        assert out[budget + 1 :] == ["7", "</s>"]


def test_no_interrupt_when_thinking_ends_in_time():
    worked = "3 4 8 9 4 </think> 4 </s>".split()

    def policy(so_far):
        return worked[len(so_far)]

    out, fired = t.generate_with_interrupt(policy, 6)
    assert not fired and out == worked
    out, fired = t.generate_with_interrupt(policy, 3)
    assert fired and out[:4] == ["3", "4", "8", t.THINK_CLOSE]
    with pytest.raises(ValueError):
        t.draw_interrupt_budget(np.random.default_rng(0), 5, 4)
