"""Verifiable tasks: prompts, held-out prompts and a reward function (`Task`), by `data.task`.

sort6 (`recipe.tasks.sort6`), the built-in task, asks for the six digits of two 3-digit numbers
in ascending order.

sumk (`recipe.tasks.sumk`) has a thinking phase and a length ceiling: the sum modulo 10 of k
digits, worked out as running sums inside `<think>...</think>`; k is mixed over
[data.sumk_min_digits, data.sumk_max_digits].

math-jsonl reads `{prompt, answer}` rows from JSONL files (`data.train`, `data.valid`; docs/math.md).
Each prompt is a user message rendered with the model's own chat template, and generation starts
inside an open thinking block; the reward is `recipe.tasks.math.score.score_math`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from recipe.config import ConfigError, DataConfig, NotAvailableError
from recipe.tasks import sort6
from recipe.tasks import sumk
from recipe.tasks.math import score as math_check
from recipe.tasks.math.data import MathRow, read_math_jsonl


@dataclass(frozen=True)
class Task:
    """What the training loop needs from a task."""

    name: str
    train_prompts: list[str]
    valid_prompts: list[str]
    reward: Callable[[str, str], float]
    max_new_tokens: int
    """The task's own generation cap, applied below `length.max_new_tokens`."""
    chat: bool = False
    """Prompts are user messages, rendered with the model's chat template into an open thinking block."""
    batch_reward: Callable[[list[str], list[str]], list[float]] | None = None
    """Scores many (prompt, completion) pairs at once, where that is faster than `reward` one by one."""
    think_close: str | None = None
    """The token that ends the thinking phase (generation starts inside it); None: no thinking phase."""
    interrupt_phrase: str | None = None
    """What `length.control=interrupt` appends at the thinking budget; it ends with `think_close`."""
    answer_tokens: int = 1
    """The fewest new tokens an answer needs after the thinking phase (for the interrupt's room)."""
    difficulty: Callable[[str], int] | None = None
    """A prompt's difficulty level (sumk: its k); evaluation then reports the pass rate per level."""
    ceiling: Callable[[int], float] | None = None
    """The highest pass rate any policy can show on the held-out set with a given generation
    budget, where the task knows it (sumk); evaluation then reports it (`ceiling`)."""

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """The reward of each completion of the matching prompt."""
        if self.batch_reward is not None:
            return self.batch_reward(list(prompts), list(completions))
        return [self.reward(p, c) for p, c in zip(prompts, completions)]

    def encode(self, tokenizer: Any, prompts: Sequence[str]) -> tuple[Any, Any]:
        """Prompt token ids B x P and their attention mask, or None for the mask when none is needed.

        Prompts of different lengths are padded on the left, so every completion starts at the
        same column; the mask marks the real tokens.
        """
        texts = [render_chat_prompt(tokenizer, p) for p in prompts] if self.chat else list(prompts)
        if tokenizer.pad_token_id is None:
            # Many chat models ship without one; padding is masked out, so EOS serves (as in TRL).
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        mask = encoded.attention_mask.bool()
        return encoded.input_ids, None if bool(mask.all()) else mask


def load_task(data: DataConfig) -> Task:
    """The task named by `data.task`, with its train and held-out prompt sets."""
    if data.task == "math-jsonl":
        return math_task(data)
    if data.task == "sumk":
        return sumk_task(data)
    train, valid = sort6.sort6_prompt_sets(data.num_train_prompts, data.num_valid_prompts)
    return Task("sort6", train, valid, sort6.reward, sort6.SORT6_MAX_NEW_TOKENS)


def sumk_task(data: DataConfig) -> Task:
    """sumk with k uniform on [data.sumk_min_digits, data.sumk_max_digits]; its own cap is the
    longest worked completion (k + 4 tokens), so a larger `length.max_new_tokens` changes nothing."""
    train, valid = sumk.prompt_sets(
        data.num_train_prompts, data.num_valid_prompts, data.sumk_min_digits, data.sumk_max_digits
    )
    return Task(
        "sumk",
        train,
        valid,
        sumk.reward,
        sumk_max_new_tokens(data.sumk_max_digits),
        think_close=sumk.THINK_CLOSE,
        interrupt_phrase=sumk.THINK_CLOSE,
        answer_tokens=sumk.ANSWER_TOKENS,
        difficulty=lambda prompt: len(sumk.prompt_digits(prompt)),
        ceiling=lambda budget: sumk.ceiling(valid, budget),
    )


def sumk_max_new_tokens(max_digits: int) -> int:
    """The worked completion of the longest problem: its scratchpad, `</think>`, answer, EOS."""
    return sumk.thinking_tokens(max_digits) + 1 + sumk.ANSWER_TOKENS


# ---------------------------------------------------------------------------------------------
# math-jsonl

MATH_MAX_NEW_TOKENS = 1 << 30
"""math-jsonl has no cap of its own: `length.max_new_tokens` decides."""
MATH_INTERRUPT_PHRASE = (
    "Okay, time is up. Let me stop thinking and formulate a final answer now.\n" + math_check.THINK_CLOSE
)
"""ScaleRL's end-of-thinking phrase, forced at the thinking budget under `length.control=interrupt`."""


def math_task(data: DataConfig) -> Task:
    """Prompts and gold answers from `data.train` and `data.valid` (see `math_split`)."""
    if importlib.util.find_spec("math_verify") is None:
        raise NotAvailableError("data.task=math-jsonl scores answers with math-verify; pip install 'scalesweep[math]'")
    train_rows, valid_rows = math_split(data)
    answers: dict[str, str] = {}
    for row in (*valid_rows, *train_rows):
        if answers.setdefault(row.prompt, row.answer) != row.answer:
            raise ConfigError("data.train", f"{data.train}:{row.line}: the prompt is in data.valid with another answer")

    def one(prompt: str, completion: str) -> float:
        return math_check.score_math(math_check.THINK_OPEN + completion, answers[prompt])

    def batch(prompts: list[str], completions: list[str]) -> list[float]:
        # The prompt opened the thinking block, so the completion is inside it until `</think>`.
        pairs = [(math_check.THINK_OPEN + c, answers[p]) for p, c in zip(prompts, completions)]
        return math_check.score_math_batch(pairs)

    return Task(
        "math-jsonl",
        [r.prompt for r in train_rows],
        [r.prompt for r in valid_rows],
        one,
        MATH_MAX_NEW_TOKENS,
        chat=True,
        batch_reward=batch,
        think_close=math_check.THINK_CLOSE,
        interrupt_phrase=MATH_INTERRUPT_PHRASE,
    )


def math_split(data: DataConfig) -> tuple[list[MathRow], list[MathRow]]:
    """Train and held-out rows: at most `data.num_train_prompts` and `data.num_valid_prompts`.

    Rows are taken in the order of a fixed permutation of each file (the same on every machine,
    and not biased by a file sorted by difficulty). When `data.valid` is the same file as
    `data.train`, the held-out rows come first in that order and the train rows are the rest, so
    the two sets are disjoint.
    """
    valid_all = read_math_jsonl(data.valid, "data.valid")
    same = data.same_files()
    train_all = valid_all if same else read_math_jsonl(data.train, "data.train")
    valid_order = _row_order(len(valid_all))
    valid = [valid_all[i] for i in valid_order[: data.num_valid_prompts]]
    if same:
        data.check_split(len(valid_all))  # `sweep launch` checks it too (launcher.preflight)
        train = [valid_all[i] for i in valid_order[data.num_valid_prompts :][: data.num_train_prompts]]
    else:
        train = [train_all[i] for i in _row_order(len(train_all))[: data.num_train_prompts]]
    return train, valid


def _row_order(num_rows: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(sort6.SPLIT_SEED).permutation(num_rows)]  # sort6's fixed seed


def render_chat_prompt(tokenizer: Any, problem: str) -> str:
    """`problem` as a user turn in the model's chat template, ending inside an open `<think>` block."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "model.path", "the model's tokenizer has no chat template; math-jsonl renders prompts with it"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
    )
    # Templates that do not open the thinking block themselves (Qwen3's) get it opened here.
    return text if text.rstrip().endswith(math_check.THINK_OPEN) else text + math_check.THINK_OPEN + "\n"
