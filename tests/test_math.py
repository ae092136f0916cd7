"""recipe.tasks.math.score: the math-jsonl answer checker, on real math-verify in real worker processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from recipe.tasks.math import score as rmath
from recipe.tasks.math.score import extract_answer, gold_parse_errors, last_boxed, score_math, score_math_batch

pytestmark = pytest.mark.usefixtures("math_pool")


# ---------------------------------------------------------------------------------------------
# Extraction (no math-verify)


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"x \boxed{1} y \boxed{\sqrt{\frac{a}{b}}} z") == r"\sqrt{\frac{a}{b}}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"\boxed {7}") == "7"


def test_last_boxed_ignores_an_unclosed_box():
    assert last_boxed(r"\boxed{3} then \boxed{\frac{1}{2}") == "3"
    assert last_boxed(r"\boxed{") is None
    assert last_boxed("no box") is None


def test_answer_region_rules():
    assert extract_answer(r"<think>\boxed{1}</think> \boxed{2}") == "2"
    assert extract_answer(r"<think>\boxed{1}</think> nothing") is None
    assert extract_answer(r"<think>still thinking \boxed{1}") is None
    assert extract_answer(r"\boxed{4} no thinking at all") == "4"
    assert extract_answer(r"<think>a</think><think>b</think>\boxed{5}") == "5"
    assert extract_answer(r"\boxed{ }") is None


# ---------------------------------------------------------------------------------------------
# Scoring


def think(answer: str) -> str:
    return f"<think>Let me work it out... maybe \\boxed{{999}}.</think>\nThe answer is {answer}."


EQUIVALENT = [
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{1/2}", "0.5"),
    (r"\boxed{\frac{1}{2}}", "1/2"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{\sqrt{12}}", r"2\sqrt{3}"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{\{2,1\}}", r"\{1,2\}"),
    (r"\boxed{(0, 1]}", "(0,1]"),
    (r"\boxed{1000}", "1,000"),
    (r"\boxed{10\%}", "0.1"),
    (r"\boxed{1000000}", "10^{6}"),
    (r"\boxed{\pi/3}", r"\frac{\pi}{3}"),
    (r"\boxed{x=3}", "3"),
]


@pytest.mark.parametrize(("box", "gold"), EQUIVALENT)
def test_equivalent_forms_score_one(box, gold):
    assert score_math(think(box), gold) == 1.0


NOT_EQUIVALENT = [
    (r"\boxed{2}", r"2\sqrt{3}"),  # raw gold would parse as 2: a false positive
    (r"\boxed{10}", "10^{6}"),  # raw gold would parse as 10
    (r"\boxed{2}", "x=2 and y=3"),
    (r"\boxed{[0,1]}", "(0,1]"),
    (r"\boxed{0.333}", "1/3"),
    (r"\boxed{60}", r"\frac{\pi}{3}"),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}"),
]


@pytest.mark.parametrize(("box", "gold"), NOT_EQUIVALENT)
def test_inequivalent_forms_and_boxed_gold_traps_score_zero(box, gold):
    assert score_math(think(box), gold) == 0.0


def test_gold_already_boxed_is_not_wrapped_twice():
    assert score_math(r"\boxed{3}", r"\boxed{3}") == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        r"<think>The answer is \boxed{3}",  # unfinished thinking
        r"<think>The answer is \boxed{3}</think> so there.",  # only inside the thinking
        r"<think>ok</think> The answer is 3.",  # no box: the strict config takes no bare number
        r"The answer is 3",
        r"<think>ok</think> \boxed{}",
        r"<think>ok</think> \boxed{3",  # never closed
        r"<think>ok</think> \boxed{\frac{}{}",
        "",
    ],
)
def test_no_valid_final_box_scores_zero(completion):
    assert score_math(completion, "3") == 0.0


def test_last_box_after_thinking_wins():
    assert score_math(r"<think>x</think> \boxed{2}, no wait, \boxed{3}", "3") == 1.0
    assert score_math(r"<think>x</think> \boxed{3}, no wait, \boxed{2}", "3") == 0.0


def test_no_thinking_block_takes_the_last_box():
    assert score_math(r"first \boxed{1} then \boxed{7}", "7") == 1.0


def test_unparsable_gold_or_prediction_scores_zero():
    assert score_math(r"\boxed{3}", r"\frac{") == 0.0
    assert score_math(r"\boxed{\frac{}{", "3") == 0.0
    assert score_math(r"\boxed{@@##}", "3") == 0.0


# ---------------------------------------------------------------------------------------------
# Bounded time, the pool, threads


PATHOLOGICAL = [
    (r"\boxed{9^{9^{9^{9^9}}}}", r"9^{9^{9^{9^9}}}+1"),
    (r"\boxed{10^{10^{10}}}", "3"),
    (r"\boxed{10^{10^{10^{10}}}}", r"10^{10^{10^{10}}}"),
    (r"\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", "1"),
    (r"\boxed{" + r"\frac{1}{" * 150 + "2" + "}" * 150 + "}", "2"),
    (r"\boxed{" + "+".join(f"x^{{{i}}}" for i in range(400)) + "}", "1"),
]


@pytest.mark.parametrize(("box", "gold"), PATHOLOGICAL)
def test_pathological_answers_finish_in_bounded_time(box, gold):
    started = time.monotonic()
    score = score_math(think(box), gold, timeout_s=2)
    elapsed = time.monotonic() - started
    assert score in (0.0, 1.0)
    assert elapsed < 5.0, f"took {elapsed:.1f} s"


def test_a_hanging_check_scores_zero_and_the_pool_recovers():
    started = time.monotonic()
    scores = score_math_batch([(r"\boxed{10^{10^{10}}}", "3"), (r"\boxed{0.5}", "1/2")], timeout_s=1.5)
    assert scores == [0.0, 1.0]
    assert time.monotonic() - started < 5.0
    assert score_math(r"\boxed{2}", "2") == 1.0


def test_batch_of_many_completions_is_fast_on_a_warm_pool():
    score_math(r"\boxed{1}", "1")  # start the pool
    pairs = [(think(f"\\boxed{{{i}/4}}"), str(i / 4)) for i in range(200)]
    started = time.monotonic()
    assert score_math_batch(pairs) == [1.0] * 200
    assert time.monotonic() - started < 20.0


def test_batch_keeps_order_and_skips_boxless_completions():
    pairs = [("no box", "1"), (r"\boxed{2}", "2"), (r"<think>\boxed{3}", "3"), (r"\boxed{5}", "4"), (r"\boxed{4}", "4")]
    assert score_math_batch(pairs) == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert score_math_batch([]) == []


def test_a_killed_worker_is_replaced():
    assert score_math(r"\boxed{1}", "1") == 1.0
    pool = rmath._pool()
    victim = pool.workers[0].process.pid
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.2)
    assert score_math_batch([(r"\boxed{2}", "2")] * 4) == [1.0] * 4
    assert victim not in [w.process.pid for w in pool.workers]


def test_scoring_from_other_threads():
    results: dict[int, list[float]] = {}

    def work(n: int) -> None:
        results[n] = score_math_batch([(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "4")] * 3)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {n: [1.0, 0.0] * 3 for n in range(4)}


def test_gold_parse_errors_name_the_problem():
    errors = gold_parse_errors(["1/2", r"\frac{", "", r"2\sqrt{3}", "}{"])
    assert errors[0] is None and errors[3] is None
    assert "unbalanced braces" in errors[1] and "unbalanced braces" in errors[4]
    assert "empty" in errors[2]
