"""sort6, the built-in task: the six digits of two 3-digit numbers in ascending order.

    prompt      4 7 1 + 9 0 3 =
    completion  0 1 3 4 7 9 </s>

Text is whitespace-separated symbols, one token each, so the word-level tokenizer built in
`recipe.model.policy` maps it one to one. The reward is 1 for an exact match (the EOS included) and 0
otherwise; a wrong length, a missing EOS or a wrong digit all score 0.
"""

from __future__ import annotations

import numpy as np
from recipe.config import SORT6_MAX_NEW_TOKENS  # noqa: F401 - the task's cap, read here by its users

PAD = "<pad>"
EOS = "</s>"
SEPARATOR = "+"
ANSWER_MARK = "="
DIGITS = tuple(str(d) for d in range(10))
VOCABULARY = (PAD, EOS, *DIGITS, SEPARATOR, ANSWER_MARK)
"""Every symbol of sort6; the position of a symbol is its token id."""

# SORT6_MAX_NEW_TOKENS (six digits and EOS: a completion that has not ended by then is truncated)
# lives in recipe.config, where `sweep launch` reads it torch-free.

NUM_NUMBERS = 900
"""3-digit numbers: 100..999."""
SPLIT_SEED = 20251014
"""Fixed, so every run of every sweep sees the same train and held-out prompts."""
NUM_WARMUP_PROMPTS = 20_000
"""Reserved for the built-in model's supervised warm-up: never a train or held-out prompt."""


def make_prompt(a: int, b: int) -> str:
    """The prompt for the pair (a, b) of 3-digit numbers."""
    for number in (a, b):
        if not 100 <= number <= 999:
            raise ValueError(f"sort6 takes 3-digit numbers, got {number}")
    return " ".join([*str(a), SEPARATOR, *str(b), ANSWER_MARK])


def expected_completion(prompt: str) -> str:
    """The one completion that earns reward 1."""
    digits = [s for s in prompt.split() if s in DIGITS]
    if len(digits) != 6:
        raise ValueError(f"not a sort6 prompt: {prompt!r}")
    return " ".join([*sorted(digits), EOS])


def reward(prompt: str, completion: str) -> float:
    """1.0 when `completion` is the prompt's six digits in ascending order followed by EOS."""
    return 1.0 if completion.split() == expected_completion(prompt).split() else 0.0


def sort6_prompt_sets(num_train: int, num_valid: int) -> tuple[list[str], list[str]]:
    """Disjoint train and held-out prompt lists, the same on every machine.

    Both come from one fixed permutation of all 810,000 pairs: the held-out set is its first
    `num_valid` pairs, the train set the next `num_train`, so the held-out set does not depend on
    the size of the train set. The permutation's tail is the warm-up's (`sort6_warmup_prompts`).
    """
    if num_train < 1 or num_valid < 1:
        raise ValueError(f"data.num_train_prompts={num_train} and data.num_valid_prompts={num_valid} must be >= 1")
    available = NUM_NUMBERS**2 - NUM_WARMUP_PROMPTS
    if num_train + num_valid > available:
        raise ValueError(
            f"data.num_train_prompts + data.num_valid_prompts = {num_train + num_valid} exceeds the "
            f"{available} sort6 prompts available (the rest are the warm-up's)"
        )
    prompts = _prompts(_split_order()[: num_valid + num_train])
    return prompts[num_valid:], prompts[:num_valid]


def sort6_warmup_prompts() -> list[str]:
    """The prompts of the built-in model's supervised warm-up, disjoint from every RL prompt set."""
    return _prompts(_split_order()[-NUM_WARMUP_PROMPTS:])


def _split_order() -> np.ndarray:
    return np.random.default_rng(SPLIT_SEED).permutation(NUM_NUMBERS**2)


def _prompts(pair_indices: np.ndarray) -> list[str]:
    return [make_prompt(100 + int(i) // NUM_NUMBERS, 100 + int(i) % NUM_NUMBERS) for i in pair_indices]
