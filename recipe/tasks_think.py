"""sumk: a built-in task family with a thinking phase and a length ceiling (docs/effects.md).

A prompt is k digits; the answer is their sum modulo 10. The worked completion writes the running
sums as a scratchpad, closes it with `</think>`, then gives the answer and EOS:

    prompt      3 1 4 1 5 = <think>
    completion  3 4 8 9 4 </think> 4 </s>

Solving a k-digit problem step by step needs k + 3 new tokens. Prompts mix k from `MIN_DIGITS` to
`MAX_DIGITS`, so a generation budget B caps what any policy can reach: problems with k + 3 <= B
are solvable, the rest only by a guess (1 in 10). That ceiling is the asymptote knob (`ceiling`).

`length.control=interrupt` is real here: at a budget drawn from [interrupt_min, interrupt_max],
a completion still thinking gets `</think>` appended and must answer (`interrupt_at`).

Status: prompts, reward, the ceiling and the interrupt rule are done and tested
(tests/test_tasks_think.py). Not yet wired into `recipe.tasks.load_task`, the built-in warm-up
model or the training loop's generation; `load_task` does not offer it until then.
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
VOCABULARY = (PAD, EOS, *DIGITS, ANSWER_MARK, THINK_OPEN, THINK_CLOSE)
"""Every symbol of sumk; the position of a symbol is its token id."""

MIN_DIGITS = 2
MAX_DIGITS = 12
ANSWER_TOKENS = 2
"""After `</think>`: the answer digit and EOS."""
SPLIT_SEED = 20251203
"""Fixed, so every run of every sweep sees the same train and held-out prompts."""


def make_prompt(digits: Sequence[int]) -> str:
    """The prompt for a list of digits."""
    if not MIN_DIGITS <= len(digits) <= MAX_DIGITS or any(not 0 <= d <= 9 for d in digits):
        raise ValueError(f"sumk takes {MIN_DIGITS}-{MAX_DIGITS} digits 0-9, got {list(digits)}")
    return " ".join([*(str(d) for d in digits), ANSWER_MARK, THINK_OPEN])


def prompt_digits(prompt: str) -> list[int]:
    """The digits of a sumk prompt."""
    symbols = prompt.split()
    if symbols[-2:] != [ANSWER_MARK, THINK_OPEN] or not all(s in DIGITS for s in symbols[:-2]):
        raise ValueError(f"not a sumk prompt: {prompt!r}")
    return [int(s) for s in symbols[:-2]]


def answer(prompt: str) -> int:
    """The sum of the prompt's digits modulo 10."""
    return sum(prompt_digits(prompt)) % 10


def worked_completion(prompt: str) -> str:
    """The step-by-step completion the warm-up teaches: running sums, `</think>`, answer, EOS."""
    running = np.cumsum(prompt_digits(prompt)) % 10
    return " ".join([*(str(int(s)) for s in running), THINK_CLOSE, str(answer(prompt)), EOS])


def tokens_needed(prompt: str) -> int:
    """New tokens the worked completion takes: k scratchpad tokens, `</think>`, answer, EOS."""
    return len(prompt_digits(prompt)) + 1 + ANSWER_TOKENS


def reward(prompt: str, completion: str) -> float:
    """1.0 when the completion closes its thinking once and then gives exactly the answer and EOS.

    The scratchpad itself is not scored: only what follows `</think>` counts, as on real
    reasoning tasks; a completion that never closes its thinking scores 0.
    """
    symbols = completion.split()
    if symbols.count(THINK_CLOSE) != 1:
        return 0.0
    after = symbols[symbols.index(THINK_CLOSE) + 1 :]
    return 1.0 if after == [str(answer(prompt)), EOS] else 0.0


def ceiling(prompts: Sequence[str], budget: int, *, guess: float = 0.1) -> float:
    """The highest expected pass rate any policy reaches on `prompts` with `budget` new tokens.

    A problem fits when its worked completion does; one that does not can only be guessed (the
    answer after a forced or too-early `</think>`), which succeeds with probability `guess`.
    """
    fits = np.array([tokens_needed(p) <= budget for p in prompts], dtype=float)
    return float(np.mean(fits + (1.0 - fits) * guess)) if budget >= 1 + ANSWER_TOKENS else 0.0


def prompt_sets(num_train: int, num_valid: int) -> tuple[list[str], list[str]]:
    """Disjoint train and held-out prompts, the same on every machine; k uniform on its range.

    The held-out set is drawn first from its own stream, so it does not depend on `num_train`;
    a train prompt equal to a held-out one is dropped and redrawn.
    """
    if num_train < 1 or num_valid < 1:
        raise ValueError(f"data.num_train_prompts={num_train} and data.num_valid_prompts={num_valid} must be >= 1")
    valid = _draw(np.random.default_rng([SPLIT_SEED, 0]), num_valid, set())
    train = _draw(np.random.default_rng([SPLIT_SEED, 1]), num_train, set(valid))
    return train, valid


def _draw(rng: np.random.Generator, count: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    seen = set(exclude)
    while len(out) < count:
        k = int(rng.integers(MIN_DIGITS, MAX_DIGITS + 1))
        prompt = make_prompt([int(d) for d in rng.integers(0, 10, size=k)])
        if prompt not in seen:
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
