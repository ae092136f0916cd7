"""Mirrors a run to the experiment trackers its sweep file names (`tracking:`): W&B and TensorBoard.

`mirrored(sink, ...)` wraps the run's Sink: everything still goes to the store first, and train
metrics (per step, as `train/NAME`) and eval points (as `eval/pass_rate`, `eval/flops`, ... with
the step as their x) are copied to each tracker.

- W&B: one W&B run per scalesweep run, whose id is the run id, so every attempt (a requeue, a
  retry) resumes the same W&B run; grouped by sweep; its config is the resolved recipe config
  and the axis values. Files under RUN_DIR/wandb/ (offline mode: `wandb sync RUN_DIR/wandb/offline-run-*`).
  Steps go in a `step` metric of their own (`define_metric`): W&B's own step counter must only
  grow, and a resumed attempt reports again from its checkpoint's step.
- TensorBoard: event files in RUN_DIR/tensorboard/; a resumed attempt opens its file with a
  purge at the checkpoint's step, so TensorBoard drops what the earlier attempt wrote past it.

A tracker never stops training: if it fails (no network on a compute node, a full disk), the
failure is logged once and the run goes on without it; an online W&B run that cannot start
falls back to offline mode, for a later `wandb sync`.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recipe.config import tracking_block
from recipe.telemetry.sinks import Sink

log = logging.getLogger("recipe")

WANDB_DIR = "wandb"  # the same names as analysis/trackers.py, which links to them
TENSORBOARD_DIR = "tensorboard"
EVAL_FIELDS = ("pass_rate", "flops", "gpu_hours", "tokens", "device_seconds", "num_samples")


class Tracker:
    """One tracker; `Mirror` calls these and turns the tracker off at its first exception."""

    name = "tracker"

    def resumed(self, step: int) -> None: ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class WandbTracker(Tracker):
    name = "W&B"

    def __init__(self, options: Mapping[str, Any], *, sweep: str, run_id: str, run_dir: Path, config: dict[str, Any]):
        import wandb

        self._wandb = wandb
        kwargs = dict(
            project=options["project"], entity=options["entity"], id=run_id, resume="allow", group=sweep,
            name=run_id, job_type="scalesweep-run", config=config, dir=str(run_dir), reinit="create_new",
        )  # fmt: skip
        settings = wandb.Settings(
            init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", "60")), silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True,
            disable_git=True, save_code=False, x_save_requirements=False,
        )  # fmt: skip
        try:
            self.run = wandb.init(mode=options["mode"], settings=settings, **kwargs)
        except Exception as exc:
            if options["mode"] == "offline":
                raise
            log.warning("W&B: online run failed to start (%s); logging offline for a later `wandb sync`", exc)
            wandb.teardown()  # the failed run keeps its id in the W&B service otherwise
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("eval/*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker(Tracker):
    name = "TensorBoard"

    def __init__(self, run_dir: Path):
        self.dir = run_dir / TENSORBOARD_DIR
        self.writer: Any = None
        self._purge: int | None = None

    def resumed(self, step: int) -> None:
        if self.writer is None:
            self._purge = step + 1

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir), purge_step=self._purge, flush_secs=30)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Mirror:
    """A Sink that reports to `inner` and copies metrics and eval points to the trackers.

    The trackers are called from a thread of their own, in order: a W&B `log` or a TensorBoard
    scalar costs ~0.5 ms a metric in Python, which the training thread only hands over. `flush`
    and `close` wait until the trackers have taken everything."""

    def __init__(self, inner: Sink, trackers: list[Tracker]):
        self.inner = inner
        self.trackers = trackers
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]]] = queue.Queue()
        self._closed = False
        threading.Thread(target=self._work, name="tracker-mirror", daemon=True).start()
        atexit.register(self.close)

    def __getattr__(self, name: str) -> Any:  # flush's companions on StoreSink (pending, spool)
        return getattr(self.inner, name)

    def resumed(self, step: int) -> None:
        self.inner.resumed(step)
        self._each("resumed", step)

    def eval_point(self, point: dict[str, Any]) -> None:
        self.inner.eval_point(point)
        values = {f"eval/{k}": point[k] for k in EVAL_FIELDS if k in point}
        values |= {f"eval/{k}": v for k, v in (point.get("metrics") or {}).items()}
        self._each("log", point["step"], _numbers(values))

    def train_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.inner.train_metrics(step, metrics)
        self._each("log", step, _numbers({f"train/{k}": v for k, v in metrics.items()}))

    def checkpoint_saved(self, step: int, path: str) -> None:
        self.inner.checkpoint_saved(step, path)

    def checkpoint_deleted(self, step: int) -> None:
        self.inner.checkpoint_deleted(step)

    def flush(self, **kwargs: Any) -> bool:
        if not self._closed:
            self._each("flush")
            self._queue.join()
        inner = getattr(self.inner, "flush", None)  # StoreSink's: send what is buffered
        return bool(inner(**kwargs)) if inner else True

    def close(self) -> None:
        if not self._closed:
            self._each("close")
            self._queue.join()
            self._closed = True

    def _each(self, method: str, *args: Any) -> None:
        if not self._closed:
            self._queue.put((method, args))

    def _work(self) -> None:
        while True:
            method, args = self._queue.get()
            for tracker in list(self.trackers):
                try:
                    getattr(tracker, method)(*args)
                except Exception as exc:  # a tracker never stops training
                    log.warning("%s mirror failed (%s: %s); training goes on without it", tracker.name, type(exc).__name__, exc)
                    self.trackers.remove(tracker)
            self._queue.task_done()
            if method == "close":
                self.trackers = []
                return


def for_run(sink: Any, store: Any, run_id: str, run_dir: Path, config: dict[str, Any]) -> Any:
    """`mirrored` with the sweep's `tracking:` block and the run's axes read from the store."""
    try:
        run = store.get_run(run_id)
        sweep = store.get_sweep(run.sweep)
        block = ((sweep.spec if sweep else {}).get("grid") or {}).get("tracking")
    except Exception as exc:  # the store was reachable a moment ago; trackers are not worth a failed run
        log.warning("tracking: could not read the sweep's tracking block (%s); no tracker", exc)
        return sink
    if not block:
        return sink
    return mirrored(sink, block, sweep=run.sweep, run_id=run_id, run_dir=run_dir, config=config, axes=run.axes)


def mirrored(
    sink: Any, block: Any, *, sweep: str, run_id: str, run_dir: Path, config: dict[str, Any], axes: dict[str, Any]
) -> Any:
    """`sink` wrapped in a Mirror to the trackers of the sweep's `tracking:` block; `sink` itself
    when the block names none (or every tracker failed to start: logged once each)."""
    try:
        options = tracking_block(block)
    except ValueError as exc:
        log.warning("tracking: %s; no tracker", exc)
        return sink
    trackers: list[Tracker] = []
    if options["tensorboard"]:
        trackers.append(TensorBoardTracker(Path(run_dir)))
    if options["wandb"]:
        try:
            trackers.append(
                WandbTracker(options["wandb"], sweep=sweep, run_id=run_id, run_dir=Path(run_dir), config={**config, "axes": axes})
            )
        except Exception as exc:  # not installed, or neither online nor offline would start
            log.warning("W&B mirror failed to start (%s: %s); training goes on without it", type(exc).__name__, exc)
    return Mirror(sink, trackers) if trackers else sink


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
