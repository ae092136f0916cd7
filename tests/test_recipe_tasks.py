"""The sort6 task: prompts, reward, and deterministic disjoint prompt sets."""

import pytest

from recipe import tasks
from recipe.config import ConfigError, DataConfig


def test_prompt_and_expected_completion():
    prompt = tasks.make_prompt(471, 903)
    assert prompt == "4 7 1 + 9 0 3 ="
    assert tasks.expected_completion(prompt) == "0 1 3 4 7 9 </s>"


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("0 1 3 4 7 9 </s>", 1.0),
        ("0 1 3 4 7 9", 0.0),  # truncated: no EOS
        ("0 1 3 4 9 7 </s>", 0.0),  # not sorted
        ("0 1 3 4 7 </s>", 0.0),  # a digit missing
        ("0 1 3 4 7 9 9", 0.0),
        ("</s>", 0.0),
    ],
)
def test_reward_is_one_only_for_the_exact_answer(completion, reward):
    assert tasks.reward("4 7 1 + 9 0 3 =", completion) == reward


def test_repeated_digits_are_kept():
    assert tasks.expected_completion(tasks.make_prompt(100, 101)) == "0 0 0 1 1 1 </s>"


def test_make_prompt_rejects_non_three_digit_numbers():
    with pytest.raises(ValueError, match="3-digit"):
        tasks.make_prompt(99, 100)


def test_prompt_sets_are_disjoint_deterministic_and_sized():
    train, valid = tasks.sort6_prompt_sets(500, 64)
    assert (len(train), len(valid)) == (500, 64)
    assert len(set(train)) == 500 and len(set(valid)) == 64
    assert not set(train) & set(valid)
    assert tasks.sort6_prompt_sets(500, 64) == (train, valid)


def test_held_out_set_does_not_depend_on_the_train_size_and_never_meets_the_warmup():
    _, valid = tasks.sort6_prompt_sets(10, 64)
    train, same_valid = tasks.sort6_prompt_sets(3000, 64)
    assert valid == same_valid
    warmup = set(tasks.sort6_warmup_prompts())
    assert len(warmup) == tasks.NUM_WARMUP_PROMPTS
    assert not warmup & (set(train) | set(valid))


def test_prompt_set_sizes_are_checked():
    with pytest.raises(ValueError, match="data.num_train_prompts"):
        tasks.sort6_prompt_sets(0, 10)
    with pytest.raises(ValueError, match="exceeds"):
        tasks.sort6_prompt_sets(800_000, 10)


def test_every_symbol_is_one_vocabulary_entry():
    prompt = tasks.make_prompt(123, 456)
    assert all(s in tasks.VOCABULARY for s in (prompt + " " + tasks.expected_completion(prompt)).split())


def test_load_task_builds_sort6_and_names_a_missing_math_jsonl_file():
    task = tasks.load_task(DataConfig(num_train_prompts=20, num_valid_prompts=5))
    assert (task.name, len(task.train_prompts), len(task.valid_prompts)) == ("sort6", 20, 5)
    assert task.max_new_tokens == 7
    # math-jsonl itself is tested in tests/test_math_task.py.
    with pytest.raises(ConfigError, match="b.jsonl: no such file"):
        tasks.load_task(DataConfig(task="math-jsonl", train="a.jsonl", valid="b.jsonl"))
