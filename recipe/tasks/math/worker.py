"""`python -m recipe.tasks.math.worker`: one math-verify worker of `recipe.tasks.math.score`'s pool.

Reads one JSON request per line on stdin, writes one JSON reply per line on stdout, in order:

    {"op": "score", "gold": "1/2", "pred": "0.5", "timeout": 5}  ->  {"value": true}
    {"op": "gold", "gold": "2\\sqrt{3}", "timeout": 5}             ->  {"value": true}

`pred` is the content of the completion's last box (the parent extracts it). Everything runs in
this process's main thread, where math-verify's `signal.alarm` timeouts work; the parent still
kills the process if a request overruns its wall-clock limit (a C-level big-integer power does not
see the alarm). Any error is a false value, never a crash.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

from math_verify import LatexExtractionConfig, parse, verify

# The strict config: only a \boxed{} answer, no fallback to the last bare number in the text.
STRICT = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]


def _seconds(timeout: float) -> int:
    """Each of the three alarms (parse gold, parse prediction, verify) gets a third of the limit, so
    a slow check usually ends here, before the parent kills the worker; signal.alarm counts whole
    seconds."""
    return max(1, int(timeout / 3))


@functools.lru_cache(maxsize=4096)
def parse_gold(gold: str, timeout: int) -> tuple[Any, ...]:
    """The gold parsed wrapped in \\boxed{}: raw, `2\\sqrt{3}` parses as 2 (docs/math.md)."""
    stripped = gold.strip()
    text = stripped if stripped.startswith("\\boxed") else f"\\boxed{{{stripped}}}"
    return tuple(parse(text, extraction_config=STRICT, extraction_mode="first_match", parsing_timeout=timeout))


def score(gold: str, pred: str, timeout: int) -> bool:
    gold_parsed = parse_gold(gold, timeout)
    if not gold_parsed:
        return False
    pred_parsed = parse(
        f"\\boxed{{{pred}}}", extraction_config=STRICT, extraction_mode="first_match", parsing_timeout=timeout
    )
    if not pred_parsed:
        return False
    return bool(verify(list(gold_parsed), pred_parsed, strict=True, timeout_seconds=timeout))


def handle(request: dict[str, Any]) -> bool:
    timeout = _seconds(float(request.get("timeout", 5)))
    if request["op"] == "gold":
        return bool(parse_gold(request["gold"], timeout))
    return score(request["gold"], request["pred"], timeout)


def main() -> None:
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            value = handle(json.loads(line))
        except Exception:  # a bad parse or verify scores 0; the worker lives on
            value = False
        out.write(json.dumps({"value": value}).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
