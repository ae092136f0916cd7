"""sumk: a built-in task family with a thinking phase and a length ceiling (docs/effects.md).

A prompt is k digits in a row of `MAX_DIGITS` places (the empty places hold `_`). The answer is
a check pair: the sum of all digits but the last and the sum of all digits, both modulo 10. The
worked completion writes the running sums as a scratchpad, closes it with `</think>`, then gives
the answer (its last two running sums) and EOS:

    prompt      3 1 4 1 5 _ _ _ _ _ _ _ = <think>
    completion  3 4 8 9 4 </think> 9 4 </s>

Two answer digits make a guess succeed 1 time in 100, as on real tasks whose answers come from a
large space. (Measured with the single digit, sum mod 10: a guess wins 1 in 10, and RL on
problems too long for the budget learned from lucky guesses, rewarding wrong scratchpads or
stopping early; pass rates oscillated and collapsed at learning rates that were stable otherwise.)

The fixed row makes each step local for a tiny transformer: the j-th running sum is the token
before it plus the prompt digit at a fixed distance back, so one attention head at a fixed
offset and an addition table suffice. (Measured: with prompts of k tokens, `3 1 4 1 5 = <think>`,
the j-th digit lies k + 2 tokens back, a distance that changes with k, and the built-in tiny
Llama could not learn to find it: greedy pass rate at chance after 1,500 warm-up steps.)

Solving a k-digit problem step by step needs k + 4 new tokens. Prompts mix k uniformly from
`data.sumk_min_digits` to `data.sumk_max_digits` (any range within `MIN_DIGITS`..`MAX_DIGITS`), so
a generation budget B caps what any policy can reach: problems with k + 4 <= B are solvable, the
rest only by a guess (1 in 100). That ceiling is the asymptote knob (`ceiling`).

`length.control=interrupt` is real here: at a budget drawn from [interrupt_min, interrupt_max],
a completion still thinking gets `</think>` appended and must answer. The rule is `interrupt_at`;
generation applies it token by token in `recipe.model.sampler` (`Interrupt`).

Wired as `data.task: sumk` (`recipe.tasks.task.load_task`), with its built-in base model
`builtin:sumk-tiny` (`recipe.tasks.builtin`); measured effects of the recipe's knobs on it are in
docs/effects.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

PAD = "<pad>"
EOS = "</s>"
ANSWER_MARK = "="
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DIGITS = tuple(str(d) for d in range(10))
EMPTY = "_"
"""An empty place of the prompt's row."""
VOCABULARY = (PAD, EOS, *DIGITS, ANSWER_MARK, THINK_OPEN, THINK_CLOSE, EMPTY)
"""Every symbol of sumk; the position of a symbol is its token id."""

MIN_DIGITS = 1
MAX_DIGITS = 12
"""The family's limits: every k a sumk config may ask for, and what the built-in base is taught."""
DEFAULT_MIN_DIGITS = 2
DEFAULT_MAX_DIGITS = 12
"""The default difficulty mixture (`data.sumk_min_digits`, `data.sumk_max_digits`)."""
ANSWER_TOKENS = 3
"""After `</think>`: the two answer digits and EOS."""
SPLIT_SEED = 20251203
"""Fixed, so every run of every sweep sees the same train and held-out prompts."""


def make_prompt(digits: Sequence[int]) -> str:
    """The prompt for a list of digits."""
    if not MIN_DIGITS <= len(digits) <= MAX_DIGITS or any(not 0 <= d <= 9 for d in digits):
        raise ValueError(f"sumk takes {MIN_DIGITS}-{MAX_DIGITS} digits 0-9, got {list(digits)}")
    row = [*(str(d) for d in digits), *[EMPTY] * (MAX_DIGITS - len(digits))]
    return " ".join([*row, ANSWER_MARK, THINK_OPEN])


def prompt_digits(prompt: str) -> list[int]:
    """The digits of a sumk prompt."""
    symbols = prompt.split()
    row = symbols[:-2]
    k = sum(s in DIGITS for s in row)
    if (
        symbols[-2:] != [ANSWER_MARK, THINK_OPEN]
        or len(row) != MAX_DIGITS
        or not MIN_DIGITS <= k
        or not all(s in DIGITS for s in row[:k])
        or row[k:] != [EMPTY] * (MAX_DIGITS - k)
    ):
        raise ValueError(f"not a sumk prompt: {prompt!r}")
    return [int(s) for s in row[:k]]


def answer(prompt: str) -> list[str]:
    """The check pair: the sums modulo 10 of all digits but the last (0 for one digit) and of all."""
    digits = prompt_digits(prompt)
    return [str(sum(digits[:-1]) % 10), str(sum(digits) % 10)]


def worked_completion(prompt: str) -> str:
    """The step-by-step completion the warm-up teaches: running sums, `</think>`, answer, EOS."""
    running = np.cumsum(prompt_digits(prompt)) % 10
    return " ".join([*(str(int(s)) for s in running), THINK_CLOSE, *answer(prompt), EOS])


def tokens_needed(prompt: str) -> int:
    """New tokens the worked completion takes: k running sums, `</think>`, two answer digits, EOS."""
    return thinking_tokens(len(prompt_digits(prompt))) + 1 + ANSWER_TOKENS


def thinking_tokens(k: int) -> int:
    """The worked scratchpad of a k-digit problem: one running sum per digit."""
    return k


def reward(prompt: str, completion: str) -> float:
    """1.0 when the completion closes its thinking once and then gives exactly the answer and EOS.

    The scratchpad itself is not scored: only what follows `</think>` counts, as on real
    reasoning tasks; a completion that never closes its thinking scores 0.
    """
    symbols = completion.split()
    if symbols.count(THINK_CLOSE) != 1:
        return 0.0
    after = symbols[symbols.index(THINK_CLOSE) + 1 :]
    return 1.0 if after == [*answer(prompt), EOS] else 0.0


def ceiling(prompts: Sequence[str], budget: int, *, guess: float = 0.01) -> float:
    """The highest expected pass rate any policy reaches on `prompts` with `budget` new tokens.

    A problem fits when its worked completion does; one that does not can only be guessed (the
    answer after a forced or too-early `</think>`), which succeeds with probability `guess`.
    """
    fits = np.array([tokens_needed(p) <= budget for p in prompts], dtype=float)
    return float(np.mean(fits + (1.0 - fits) * guess)) if budget >= 1 + ANSWER_TOKENS else 0.0


def prompt_sets(
    num_train: int, num_valid: int, min_digits: int = DEFAULT_MIN_DIGITS, max_digits: int = DEFAULT_MAX_DIGITS
) -> tuple[list[str], list[str]]:
    """Train and held-out prompts, the same on every machine; k uniform on [min_digits, max_digits].

    The held-out set is drawn first from its own stream, so it does not depend on `num_train`,
    and its prompts are distinct. Train prompts avoid the held-out ones. Short problems have few
    distinct prompts (k = 2: 100), so k is drawn first and only the digits are redrawn: the
    mixture over k stays uniform in both sets; where a k has no unused prompt left, that draw is
    a repeat (a train prompt seen before, or for the held-out set a held-out one again).
    """
    if num_train < 1 or num_valid < 1:
        raise ValueError(f"data.num_train_prompts={num_train} and data.num_valid_prompts={num_valid} must be >= 1")
    valid = held_out_prompts(num_valid, min_digits, max_digits)
    train = _draw(np.random.default_rng([SPLIT_SEED, 1]), num_train, min_digits, max_digits, set(valid))
    return train, valid


def held_out_prompts(
    num_valid: int, min_digits: int = DEFAULT_MIN_DIGITS, max_digits: int = DEFAULT_MAX_DIGITS
) -> list[str]:
    """The held-out prompts of `prompt_sets` (drawn from their own stream: no train set needed)."""
    check_digit_range(min_digits, max_digits)
    return _draw(np.random.default_rng([SPLIT_SEED, 0]), num_valid, min_digits, max_digits, set(), unique=True)


def warmup_prompts(count: int, seed: int) -> list[str]:
    """The built-in base's supervised warm-up prompts: every k of the family, uniform."""
    return _draw(np.random.default_rng([SPLIT_SEED, 2, seed]), count, MIN_DIGITS, MAX_DIGITS, set())


def check_digit_range(min_digits: int, max_digits: int) -> None:
    if not MIN_DIGITS <= min_digits <= max_digits <= MAX_DIGITS:
        raise ValueError(
            f"sumk digit range [{min_digits}, {max_digits}] must satisfy {MIN_DIGITS} <= min <= max <= {MAX_DIGITS}"
        )


_MAX_REDRAWS = 64
"""Digit redraws for one k before a repeat is taken (k <= 3 runs out of unused prompts)."""


def _draw(
    rng: np.random.Generator, count: int, lo: int, hi: int, exclude: set[str], *, unique: bool = False
) -> list[str]:
    out: list[str] = []
    seen = set(exclude)
    while len(out) < count:
        k = int(rng.integers(lo, hi + 1))
        for _ in range(_MAX_REDRAWS):
            prompt = make_prompt([int(d) for d in rng.integers(0, 10, size=k)])
            if prompt not in seen:
                break
        if unique:
            seen.add(prompt)
        out.append(prompt)
    return out


def draw_interrupt_budget(rng: np.random.Generator, interrupt_min: int, interrupt_max: int) -> int:
    """A thinking budget uniform on [interrupt_min, interrupt_max], inclusive."""
    if not 1 <= interrupt_min <= interrupt_max:
        raise ValueError(f"interrupt budget range [{interrupt_min}, {interrupt_max}] must satisfy 1 <= min <= max")
    return int(rng.integers(interrupt_min, interrupt_max + 1))


def interrupt_at(thinking: Sequence[str], budget: int) -> tuple[list[str], bool]:
    """The completion so far, forced to answer once it has thought for `budget` tokens.

    `thinking` is what the policy generated. If it closed its thinking within `budget` tokens it is
    returned as is; otherwise it is cut to `budget` tokens and `</think>` is appended, so the
    policy's next tokens are its answer. The flag says whether the interrupt fired.
    """
    if budget < 0:
        raise ValueError(f"interrupt budget must be >= 0, got {budget}")
    head = list(thinking[:budget])
    if THINK_CLOSE in head:
        return list(thinking), False
    return [*head, THINK_CLOSE], True


def generate_with_interrupt(
    next_token: Callable[[list[str]], str], budget: int, *, answer_tokens: int = ANSWER_TOKENS
) -> tuple[list[str], bool]:
    """Decode with a thinking budget: `next_token(completion_so_far)` gives the policy's next symbol.

    The policy thinks until it writes `</think>` or reaches `budget` tokens; at the budget
    `</think>` is forced. It then has `answer_tokens` tokens to answer (stopping at EOS). Returns
    the completion and whether the interrupt fired.
    """
    out: list[str] = []
    while len(out) < budget:
        out.append(next_token(out))
        if out[-1] == EOS:
            return out, False
        if out[-1] == THINK_CLOSE:
            break
    out, fired = interrupt_at(out, budget)
    for _ in range(answer_tokens):
        out.append(next_token(out))
        if out[-1] == EOS:
            break
    return out, fired
