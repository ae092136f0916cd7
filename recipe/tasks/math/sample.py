"""The shipped math-jsonl sample, `recipe/tasks/math/math_sample.jsonl`, and the code that writes it.

Small arithmetic problems the project generates itself (no download), with LaTeX gold answers in
the forms math-verify must handle: integers, fractions, square roots, powers, intervals and sets.
Deterministic: `python -m recipe.tasks.math.sample` rewrites the shipped file byte for byte.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

SAMPLE_PATH = Path(__file__).parent / "math_sample.jsonl"
NUM_ROWS = 64
SEED = 7
INSTRUCTION = "Put the final answer in \\boxed{}."


def _latex(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _fraction_sum(rng: random.Random) -> tuple[str, str]:
    a, b = Fraction(rng.randint(1, 9), rng.randint(2, 9)), Fraction(rng.randint(1, 9), rng.randint(2, 9))
    return f"Compute {a} + {b} as a fraction in lowest terms.", _latex(a + b)


def _product(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    return f"What is {a} times {b}?", str(a * b)


def _root(rng: random.Random) -> tuple[str, str]:
    square, rest = rng.choice((4, 9, 16, 25)), rng.choice((2, 3, 5, 6, 7))
    return f"Simplify the square root of {square * rest}.", f"{int(square**0.5)}\\sqrt{{{rest}}}"


def _power(rng: random.Random) -> tuple[str, str]:
    base, exponent = rng.randint(2, 5), rng.randint(2, 4)
    return f"Compute {base} raised to the power {exponent}.", f"{base}^{{{exponent}}}"


def _linear(rng: random.Random) -> tuple[str, str]:
    a, x, b = rng.randint(2, 9), rng.randint(-9, 9), rng.randint(1, 20)
    return f"Solve for x: {a}x + {b} = {a * x + b}.", f"x={x}"


def _interval(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 5), rng.randint(6, 12)
    return f"Give the set of real x with {a} < x <= {b} in interval notation.", f"({a},{b}]"


def _roots_set(rng: random.Random) -> tuple[str, str]:
    r, s = rng.sample(range(-6, 7), 2)
    return (
        f"Find all roots of x^2 {-(r + s):+d}x {r * s:+d} = 0, as a set.",
        f"\\{{{min(r, s)},{max(r, s)}\\}}",
    )


def _mean(rng: random.Random) -> tuple[str, str]:
    values = [rng.randint(1, 20) for _ in range(rng.randint(3, 6))]
    return f"What is the mean of {', '.join(map(str, values))}?", _latex(Fraction(sum(values), len(values)))


GENERATORS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _fraction_sum,
    _product,
    _root,
    _power,
    _linear,
    _interval,
    _roots_set,
    _mean,
)


def sample_rows(num_rows: int = NUM_ROWS, seed: int = SEED) -> list[dict[str, str]]:
    """`num_rows` distinct {prompt, answer} rows, the same for the same seed."""
    rng = random.Random(seed)
    rows: dict[str, str] = {}
    for attempt in range(100 * num_rows):  # some generators have few distinct problems: bounded, never stuck
        if len(rows) == num_rows:
            break
        generator = GENERATORS[len(rows) % len(GENERATORS)] if attempt % 2 == 0 else rng.choice(GENERATORS)
        problem, answer = generator(rng)
        rows.setdefault(f"{problem} {INSTRUCTION}", answer)
    else:
        raise ValueError(f"cannot generate {num_rows} distinct problems")
    return [{"prompt": p, "answer": a} for p, a in rows.items()]


def sample_jsonl(num_rows: int = NUM_ROWS, seed: int = SEED) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in sample_rows(num_rows, seed))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else SAMPLE_PATH
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(sample_jsonl())
    print(out)
