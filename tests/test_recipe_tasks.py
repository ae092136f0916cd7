"""The sort6 task: prompts, reward, and deterministic disjoint prompt sets."""

import pytest

from recipe.config import ConfigError, DataConfig
from recipe.tasks import sort6, task as tasks


def test_prompt_and_expected_completion():
    prompt = sort6.make_prompt(471, 903)
    assert prompt == "4 7 1 + 9 0 3 ="
    assert sort6.expected_completion(prompt) == "0 1 3 4 7 9 </s>"


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
    assert sort6.reward("4 7 1 + 9 0 3 =", completion) == reward


def test_repeated_digits_are_kept():
    assert sort6.expected_completion(sort6.make_prompt(100, 101)) == "0 0 0 1 1 1 </s>"


def test_make_prompt_rejects_non_three_digit_numbers():
    with pytest.raises(ValueError, match="3-digit"):
        sort6.make_prompt(99, 100)


def test_prompt_sets_are_disjoint_deterministic_and_sized():
    train, valid = sort6.sort6_prompt_sets(500, 64)
    assert (len(train), len(valid)) == (500, 64)
    assert len(set(train)) == 500 and len(set(valid)) == 64
    assert not set(train) & set(valid)
    assert sort6.sort6_prompt_sets(500, 64) == (train, valid)


def test_held_out_set_does_not_depend_on_the_train_size_and_never_meets_the_warmup():
    _, valid = sort6.sort6_prompt_sets(10, 64)
    train, same_valid = sort6.sort6_prompt_sets(3000, 64)
    assert valid == same_valid
    warmup = set(sort6.sort6_warmup_prompts())
    assert len(warmup) == sort6.NUM_WARMUP_PROMPTS
    assert not warmup & (set(train) | set(valid))


def test_prompt_set_sizes_are_checked():
    with pytest.raises(ValueError, match="data.num_train_prompts"):
        sort6.sort6_prompt_sets(0, 10)
    with pytest.raises(ValueError, match="exceeds"):
        sort6.sort6_prompt_sets(800_000, 10)


def test_every_symbol_is_one_vocabulary_entry():
    prompt = sort6.make_prompt(123, 456)
    assert all(s in sort6.VOCABULARY for s in (prompt + " " + sort6.expected_completion(prompt)).split())


def test_load_task_builds_sort6_and_names_a_missing_math_jsonl_file():
    task = tasks.load_task(DataConfig(num_train_prompts=20, num_valid_prompts=5))
    assert (task.name, len(task.train_prompts), len(task.valid_prompts)) == ("sort6", 20, 5)
    assert task.max_new_tokens == 7
    # math-jsonl itself is tested in tests/test_math_task.py.
    with pytest.raises(ConfigError, match="b.jsonl: no such file"):
        tasks.load_task(DataConfig(task="math-jsonl", train="a.jsonl", valid="b.jsonl"))


# ---------------------------------------------------------------------------------------------
# sumk (its rules: tests/test_tasks_think.py)


def test_load_task_builds_sumk_with_its_difficulty_mixture_and_cap():
    from recipe.tasks import sumk

    task = tasks.load_task(
        DataConfig(task="sumk", num_train_prompts=300, num_valid_prompts=50, sumk_min_digits=3, sumk_max_digits=5)
    )
    assert (task.name, len(task.train_prompts), len(task.valid_prompts)) == ("sumk", 300, 50)
    assert {len(sumk.prompt_digits(p)) for p in task.valid_prompts} == {3, 4, 5}
    assert task.max_new_tokens == 5 + 4  # the longest worked completion
    assert (task.think_close, task.interrupt_phrase, task.answer_tokens) == ("</think>", "</think>", 3)
    prompt = task.valid_prompts[0]
    assert task.score([prompt], [sumk.worked_completion(prompt)]) == [1.0]


def test_sumk_limits_in_the_torch_free_config_match_the_task():
    from recipe import config
    from recipe.tasks import sumk

    assert config.SUMK_DIGITS == (sumk.MIN_DIGITS, sumk.MAX_DIGITS)
    assert config.SUMK_ANSWER_TOKENS == 1 + sumk.ANSWER_TOKENS
    assert DataConfig().sumk_min_digits == sumk.DEFAULT_MIN_DIGITS
    assert DataConfig().sumk_max_digits == sumk.DEFAULT_MAX_DIGITS


@pytest.mark.parametrize(
    ("overrides", "key", "match"),
    [
        (
            {"data.task": "sumk"},
            "model.path",
            "'builtin:sort6-tiny' is the sort6 base model; data.task='sumk' needs builtin:sumk-tiny",
        ),
        (
            {"model.path": "builtin:sumk-tiny"},
            "model.path",
            "is the sumk base model; data.task='sort6' needs builtin:sort6-tiny",
        ),
        ({"data.sumk_max_digits": 5}, "data.sumk_max_digits", "applies to data.task=sumk only, not 'sort6'"),
        (
            {"data.task": "sumk", "model.path": "builtin:sumk-tiny", "data.sumk_min_digits": 6,
             "data.sumk_max_digits": 5},
            "data.sumk_max_digits",
            "5 is below data.sumk_min_digits=6",
        ),
        ({"data.task": "sumk", "data.sumk_max_digits": 13}, "data.sumk_max_digits", "invalid value 13; must be <= 12"),
        (
            {
                "data.task": "sumk", "model.path": "builtin:sumk-tiny", "length.max_new_tokens": 10,
                "length.interrupt_min": 4, "length.interrupt_max": 7,
            },
            "length.interrupt_max",
            "7: an interrupt at that thinking budget leaves no room for the answer under the generation cap of 10 "
            r"tokens .*lower it to <= 6",
        ),
    ],
)  # fmt: skip
def test_sumk_settings_are_checked_with_one_line_errors(overrides, key, match):
    from recipe.config import resolve

    with pytest.raises(ConfigError, match=match) as error:
        resolve(overrides)
    assert error.value.key == key and "\n" not in str(error.value)


def test_a_sumk_interrupt_with_room_for_the_answer_is_accepted():
    from recipe.config import resolve

    cfg = resolve(
        {"data.task": "sumk", "model.path": "builtin:sumk-tiny", "length.max_new_tokens": 10,
         "length.interrupt_min": 4, "length.interrupt_max": 6}
    )  # fmt: skip
    assert cfg.length.interrupt_max == 6
    resolve({"data.task": "sumk", "model.path": "builtin:sumk-tiny"})  # the default budgets lie beyond the cap
