"""Math answer checking: `score_math(completion, answer)`, built on math-verify (docs/math.md).

The rule, in full:

- The answer region is the text after the last `</think>`. A completion that opens a thinking
  block (`<think>`) and never closes it scores 0, whatever it contains; a completion with no
  thinking block at all is its own answer region.
- The answer is the last `\\boxed{...}` in the answer region (nested braces matched); no box
  scores 0. Earlier boxes, and boxes inside the thinking, are ignored.
- The score is 1.0 if and only if math-verify finds that box mathematically equivalent to the
  gold answer, else 0.0 (unparsable either side included).

Two traps measured with math-verify 0.9.0 are avoided here. The gold answer is parsed wrapped in
`\\boxed{}`: parsed raw, `2\\sqrt{3}` reads as 2 and `10^{6}` as 10. The prediction is parsed with
the strict config (boxed answers only, no bare-number fallback).

Every parse and verify runs in a worker process, in its main thread, under a wall-clock limit.
math-verify's own timeouts use `signal.alarm`, which fails outside a main thread, and a
pathological answer (`9^{9^{9^{9^9}}}`) can compute for minutes; past the limit the parent kills
the worker, scores 0 and starts a fresh one. The workers are started once (lazily) and reused;
calls from several threads are serialised on one lock. This module imports neither math-verify
nor torch: only the workers (and `recipe.tasks.math.worker`) import math-verify.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DEFAULT_TIMEOUT_S = 5.0
"""Wall-clock limit of one check (parse gold, parse prediction, verify)."""
WORKER_START_TIMEOUT_S = 60.0
"""A worker imports math-verify and sympy (about 0.5 s) before it takes work."""
_BOX = re.compile(r"\\boxed\s*\{")


# ---------------------------------------------------------------------------------------------
# Extraction: pure string work, no math-verify


def answer_region(completion: str) -> str | None:
    """The text that may hold the answer, or None when the thinking block never closes."""
    close = completion.rfind(THINK_CLOSE)
    if close >= 0:
        return completion[close + len(THINK_CLOSE) :]
    if THINK_OPEN in completion:
        return None
    return completion


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in `text`, braces matched; None if none."""
    found = None
    for match in _BOX.finditer(text):
        content = _braced(text, match.end())
        if content is not None:
            found = content
    return found


def _braced(text: str, start: int) -> str | None:
    """The text from `start` up to the brace that closes the one just before it (`\\{` escapes)."""
    depth, i = 1, start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character, \{ or \} included, is never structural
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_answer(completion: str) -> str | None:
    """The boxed answer `score_math` would check, or None (which scores 0)."""
    region = answer_region(completion)
    if region is None:
        return None
    content = last_boxed(region)
    return None if content is None or not content.strip() else content


def boxed_gold(answer: str) -> str:
    """The gold answer as math-verify should see it: wrapped in `\\boxed{}` unless it already is."""
    stripped = answer.strip()
    return stripped if last_boxed(stripped) is not None and stripped.startswith("\\boxed") else f"\\boxed{{{stripped}}}"


def balanced(text: str) -> bool:
    """Unescaped braces pair up (math-verify turns `\\frac{` into a string and calls it parsed)."""
    depth, i = 0, 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return False
        i += 1
    return depth == 0


# ---------------------------------------------------------------------------------------------
# The public API


def score_math(completion: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 iff the last `\\boxed{...}` after the thinking block is equivalent to `answer`, else 0.0.

    See the module docstring for the rule. Never raises on bad input and returns within about
    `timeout_s` seconds once the worker pool has started.
    """
    return score_math_batch([(completion, answer)], timeout_s)[0]


def score_math_batch(pairs: Sequence[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[float]:
    """`score_math` for many (completion, answer) pairs, spread over the worker pool."""
    requests: list[dict[str, str] | None] = []
    for completion, answer in pairs:
        predicted = extract_answer(completion)
        requests.append(None if predicted is None else {"op": "score", "gold": answer, "pred": predicted})
    results = [0.0] * len(requests)
    todo = [(i, r) for i, r in enumerate(requests) if r is not None]
    for (i, _), value in zip(todo, _pool().run([r for _, r in todo], timeout_s)):
        results[i] = 1.0 if value is True else 0.0
    return results


def gold_parse_errors(answers: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str | None]:
    """For each gold answer, None if math-verify parses it (wrapped in `\\boxed{}`), else why not."""
    errors: list[str | None] = [None] * len(answers)
    todo = []
    for i, answer in enumerate(answers):
        if not answer.strip():
            errors[i] = "the answer is empty"
        elif not balanced(answer):
            errors[i] = f"the answer {answer!r} has unbalanced braces"
        else:
            todo.append(i)
    outcomes = _pool().run([{"op": "gold", "gold": answers[i]} for i in todo], timeout_s)
    for i, outcome in zip(todo, outcomes):
        if outcome is None:
            errors[i] = f"parsing the answer {answers[i]!r} took longer than {timeout_s:g} s"
        elif outcome is not True:
            errors[i] = f"math-verify cannot parse the answer {answers[i]!r}"
    return errors


def shutdown() -> None:
    """Stop the worker pool (it restarts on the next call)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


def num_workers() -> int:
    """Workers in the pool: `SWEEP_MATH_WORKERS`, else up to 4 (one per core)."""
    configured = os.environ.get("SWEEP_MATH_WORKERS")
    return max(1, int(configured)) if configured else max(1, min(4, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# The worker pool


@dataclass
class _Worker:
    process: subprocess.Popen[bytes]
    buffer: bytes = b""
    dead: bool = False
    """Its pipe reached EOF: it crashed or was killed."""

    @classmethod
    def spawn(cls) -> _Worker:
        """Start the process; it is usable once `wait_ready` returns."""
        process = subprocess.Popen(
            [sys.executable, "-m", "recipe.tasks.math.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=os.environ | {"PYTHONPATH": _package_root() + os.pathsep + os.environ.get("PYTHONPATH", "")},
        )
        return cls(process)

    def wait_ready(self) -> _Worker:
        ready = self.read_line(time.monotonic() + WORKER_START_TIMEOUT_S)
        if ready is None or json.loads(ready).get("ready") is not True:
            self.kill()
            raise RuntimeError("the math-verify worker did not start; pip install 'scalesweep[math]'")
        return self

    @classmethod
    def start(cls) -> _Worker:
        return cls.spawn().wait_ready()

    def send(self, request: dict[str, str], timeout_s: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request | {"timeout": timeout_s}).encode() + b"\n")
        self.process.stdin.flush()

    def read_line(self, deadline: float) -> bytes | None:
        """One reply line, or None on timeout or a dead worker."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                if not selector.select(remaining):
                    return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    @property
    def stdout_fd(self) -> int:
        assert self.process.stdout is not None
        return self.process.stdout.fileno()

    def read_available(self) -> None:
        """Read what the worker has written (call only when its pipe is readable)."""
        chunk = os.read(self.stdout_fd, 65536)
        if chunk:
            self.buffer += chunk
        else:
            self.dead = True

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # unflushed input to a dead worker
                    stream.close()


class _Pool:
    """Workers that each take one request at a time; an overdue or dead worker is replaced."""

    def __init__(self, size: int):
        self.size = size
        self.pid = os.getpid()
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()

    def run(self, requests: Sequence[dict[str, str]], timeout_s: float) -> list[object]:
        """Each request's reply `value`, or None where it timed out or its worker died."""
        if not requests:
            return []
        with self.lock:
            missing = min(self.size, len(requests)) - len(self.workers)
            if missing > 0:  # started together: each spends about 0.5 s importing sympy
                self.workers += [w.wait_ready() for w in [_Worker.spawn() for _ in range(missing)]]
            results: list[object] = [None] * len(requests)
            queue = list(range(len(requests)))[::-1]
            busy: dict[int, tuple[int, float]] = {}  # worker slot -> (request index, deadline)
            while queue or busy:
                for slot in range(len(self.workers)):
                    if slot not in busy and queue:
                        index = queue.pop()
                        if self._send(slot, requests[index], timeout_s):
                            busy[slot] = (index, time.monotonic() + timeout_s)
                self._collect(busy, results)
            return results

    def _send(self, slot: int, request: dict[str, str], timeout_s: float) -> bool:
        """Hand `request` to a worker; one that died while idle is replaced and the request resent."""
        for _ in range(2):
            try:
                self.workers[slot].send(request, timeout_s)
                return True
            except OSError:
                self._replace(slot)
        return False  # the request scores None (0), like any check whose worker died

    def _collect(self, busy: dict[int, tuple[int, float]], results: list[object]) -> None:
        """Wait for the first reply or deadline among the busy workers, and handle what came."""
        if not busy:
            return
        pending = [slot for slot in busy if b"\n" not in self.workers[slot].buffer]
        if len(pending) == len(busy):
            timeout = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            with selectors.DefaultSelector() as selector:
                for slot in busy:
                    selector.register(self.workers[slot].stdout_fd, selectors.EVENT_READ, slot)
                for key, _ in selector.select(timeout):
                    self.workers[key.data].read_available()
        now = time.monotonic()
        for slot in list(busy):
            index, deadline = busy[slot]
            worker = self.workers[slot]
            if b"\n" in worker.buffer:
                line, worker.buffer = worker.buffer.split(b"\n", 1)
                results[index] = json.loads(line).get("value")
                del busy[slot]
            elif worker.dead or now >= deadline:
                del busy[slot]
                self._replace(slot)

    def _replace(self, slot: int) -> None:
        self.workers[slot].kill()
        self.workers[slot] = _Worker.start()

    def close(self) -> None:
        with self.lock:
            for worker in self.workers:
                worker.kill()
            self.workers = []


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _Pool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():  # a forked child cannot share its parent's pipes
            _POOL = _Pool(num_workers())
        return _POOL


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[3])


atexit.register(shutdown)
