"""A Sink that writes to the store and survives the database going away.

Every report is applied to the store at once when it answers, except per-step training metrics,
which are sent in batches every `metrics_every_s` seconds (and before any other report, so the
store sees them in order): one transaction per step would make the database the bottleneck of a
fast run. When it does not, the report goes
to RUN_DIR/spool.jsonl and training carries on; the spool is replayed, in order, at the next
report after a back-off, at the end of the run, or by the next attempt. Every operation is
idempotent (upserts keyed by run and step, deletes by step), so a replay that is cut off half
way can simply start again: nothing is lost and nothing is duplicated.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store import Store, StoreError

log = logging.getLogger("recipe")

SPOOL_FILE = "spool.jsonl"


class StoreSink:
    def __init__(
        self,
        store: Store,
        run_id: str,
        run_dir: Path,
        *,
        attempt_id: int | None = None,
        backoff_s: float = 5.0,
        max_backoff_s: float = 60.0,
        metrics_every_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.run_id, self.attempt_id = store, run_id, attempt_id
        self.spool = Path(run_dir) / SPOOL_FILE
        self._backoff_s, self._min_backoff_s, self._max_backoff_s = backoff_s, backoff_s, max_backoff_s
        self._clock = clock
        self._next_try = 0.0
        self._metrics: list[tuple[int, dict[str, Any]]] = []
        self._metrics_every_s = metrics_every_s
        self._metrics_sent = clock()

    # -- the Sink protocol -----------------------------------------------------------------

    def resumed(self, step: int) -> None:
        self._report("resumed", step=step)

    def eval_point(self, point: dict[str, Any]) -> None:
        self._report("eval_point", point=point)

    def train_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self._metrics.append((step, metrics))
        if self._clock() - self._metrics_sent >= self._metrics_every_s:
            self._send_metrics()

    def checkpoint_saved(self, step: int, path: str) -> None:
        self._report("checkpoint_saved", step=step, path=path)

    def checkpoint_deleted(self, step: int) -> None:
        self._report("checkpoint_deleted", step=step)

    # -- spooling --------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Reports waiting in the spool."""
        if not self.spool.exists():
            return 0
        return sum(1 for line in self.spool.read_text().splitlines() if line.strip())

    def flush(self, *, timeout_s: float = 0.0, poll_s: float = 2.0) -> bool:
        """Send buffered metrics and replay the spool; with a timeout, keep trying until the
        spool is empty. True when everything reached the store."""
        self._send_metrics()
        deadline = self._clock() + timeout_s
        while True:
            if self._replay():
                return True
            if self._clock() >= deadline:
                return False
            time.sleep(poll_s)

    def _send_metrics(self) -> None:
        self._metrics_sent = self._clock()
        if self._metrics:
            rows, self._metrics = self._metrics, []
            self._deliver("train_metrics", {"rows": rows})

    def _report(self, op: str, **args: Any) -> None:
        self._send_metrics()  # metrics of earlier steps go first
        self._deliver(op, args)

    def _deliver(self, op: str, args: dict[str, Any]) -> None:
        if self.spool.exists() and not (self._clock() >= self._next_try and self._replay()):
            self._append(op, args)
            return
        try:
            self._apply(op, args)
            self._backoff_s = self._min_backoff_s
        except StoreError as exc:
            log.warning("database unreachable (%s); buffering in %s and training on", exc, self.spool)
            self._append(op, args)
            self._schedule_retry()

    def _replay(self) -> bool:
        if not self.spool.exists():
            return True
        entries = [json.loads(line) for line in self.spool.read_text().splitlines() if line.strip()]
        try:
            for entry in entries:
                self._apply(entry["op"], entry["args"])
        except StoreError:
            self._schedule_retry()
            return False
        self.spool.unlink()
        self._backoff_s = self._min_backoff_s
        log.info("database back: replayed %d buffered reports", len(entries))
        return True

    def _append(self, op: str, args: dict[str, Any]) -> None:
        with open(self.spool, "a") as handle:
            handle.write(json.dumps({"op": op, "args": args}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def _schedule_retry(self) -> None:
        self._next_try = self._clock() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)

    def _apply(self, op: str, args: dict[str, Any]) -> None:
        store, run_id = self.store, self.run_id
        if op == "eval_point":
            store.add_eval_points(run_id, [args["point"]])
        elif op == "train_metrics":
            store.add_train_metrics(run_id, [(step, metrics) for step, metrics in args["rows"]])
        elif op == "checkpoint_saved":
            store.add_checkpoint(run_id, args["step"], args["path"])
        elif op == "checkpoint_deleted":
            store.delete_checkpoint(run_id, args["step"])
        elif op == "resumed":
            dropped = store.delete_eval_points_after(run_id, args["step"])
            if dropped:
                log.info("dropped %d eval points past step %d (an abandoned trajectory)", dropped, args["step"])
            if self.attempt_id is not None:
                store.update_attempt(self.attempt_id, resumed_from_step=args["step"])
        else:
            raise ValueError(f"unknown spool operation {op!r} in {self.spool}")
