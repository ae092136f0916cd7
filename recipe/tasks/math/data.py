"""math-jsonl data: JSONL rows {"prompt": ..., "answer": ...} (docs/math.md), read and checked.

`check_math_data` is what `sweep launch` runs on `data.train`/`data.valid` before anything is
registered: stdlib only here (math-verify parses the gold answers in `recipe.tasks.math.score`'s
worker processes), so the launcher imports no torch.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from recipe.config import ConfigError
from recipe.tasks.math.score import DEFAULT_TIMEOUT_S, gold_parse_errors


@dataclass(frozen=True)
class MathRow:
    prompt: str
    answer: str
    line: int
    """1-based line number in its file, for error messages."""


class MathDataError(ConfigError):
    """A math-jsonl file that cannot be used: `key` is its config key, `detail` names file and line."""


def read_math_jsonl(path: str | Path, key: str = "data.train") -> list[MathRow]:
    """The rows of a math-jsonl file, every row's shape checked (gold answers are not parsed here).

    Blank lines are skipped; every other line must be a JSON object with a non-empty string
    `prompt` and an `answer` that is a non-empty string or a number. Other fields are ignored. A
    prompt may repeat only with the same answer (the reward looks answers up by prompt).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise MathDataError(key, f"{path}: no such file (a math-jsonl file of {{prompt, answer}} rows)")
    rows: list[MathRow] = []
    seen: dict[str, MathRow] = {}
    with file.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                row = _row(key, path, number, text)
                first = seen.setdefault(row.prompt, row)
                if first.answer != row.answer:
                    raise MathDataError(
                        key,
                        f"{path}:{number}: repeats the prompt of line {first.line} with a different answer "
                        f"({row.answer!r}, not {first.answer!r})",
                    )
                rows.append(row)
    if not rows:
        raise MathDataError(key, f"{path}: the file has no rows")
    return rows


def _row(key: str, path: str | Path, number: int, text: str) -> MathRow:
    where = f"{path}:{number}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise MathDataError(key, f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise MathDataError(key, f'{where}: a row must be a JSON object {{"prompt": ..., "answer": ...}}')
    for name in ("prompt", "answer"):
        if name not in obj:
            close = difflib.get_close_matches(name, [str(k) for k in obj], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            fields = ", ".join(map(str, obj)) or "none"
            raise MathDataError(key, f"{where}: the row has no {name!r} field{hint}; its fields: {fields}")
    prompt, answer = obj["prompt"], obj["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise MathDataError(key, f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float) or not str(answer).strip():
        raise MathDataError(key, f"{where}: 'answer' must be a non-empty string or a number, got {answer!r}")
    return MathRow(prompt, str(answer), number)


def check_math_data(path: str | Path, key: str = "data.train", timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """What `sweep launch` checks of a math-jsonl file: it exists, rows parse, gold answers parse.

    Returns the number of rows; raises `MathDataError` (a `ConfigError` on `key`, the config key
    that named the file) naming the file and the first bad line.
    Gold answers go through math-verify in the worker pool (about 1 ms each on 4 workers).
    """
    rows = read_math_jsonl(path, key)
    if importlib.util.find_spec("math_verify") is None:
        raise MathDataError(key, f"{path}: checking gold answers needs math-verify; pip install 'scalesweep[math]'")
    for row, error in zip(rows, gold_parse_errors([r.answer for r in rows], timeout_s)):
        if error is not None:
            raise MathDataError(key, f"{path}:{row.line}: {error}")
    return len(rows)
