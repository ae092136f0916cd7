"""Where a run waits: wall time spent off the CPU, phase by phase.

A training process on the CPU engine is busy all the time; when a phase of the loop (a step, an
evaluation, a report to the store, a checkpoint) takes much longer in wall time than in CPU time,
the process was waiting: on the store's write lock, on the disk, on another process that holds
the cores. `WaitWatch` measures every phase with both clocks and logs a phase that waited longer
than `threshold_s`, naming it, so that a stall in a run's log says what it was. The total wait
of each step's loop iteration is also recorded in its train metrics (`wait_seconds`).

CPU time is the process's (`time.process_time`, every thread): with several torch threads a
phase can use more CPU than wall time, so the wait is clamped at zero and is a lower bound there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DEFAULT_THRESHOLD_S = 5.0


def threshold_s() -> float:
    """$SWEEP_WAIT_WARN_S, default 5 s."""
    return float(os.environ.get("SWEEP_WAIT_WARN_S") or DEFAULT_THRESHOLD_S)


class WaitWatch:
    def __init__(
        self,
        log: Callable[[str], None],
        *,
        threshold: float | None = None,
        wall: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.log = log
        self.threshold = threshold_s() if threshold is None else threshold
        self._wall, self._cpu = wall, cpu
        self.waited = 0.0
        """Seconds waited since the last `take`."""

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        wall, cpu = self._wall(), self._cpu()
        try:
            yield
        finally:
            wall, cpu = self._wall() - wall, self._cpu() - cpu
            waited = max(0.0, wall - cpu)
            self.waited += waited
            if waited > self.threshold:
                self.log(
                    f"step {step}: {name} took {wall:.1f} s of wall time on {cpu:.1f} s of CPU: it waited "
                    f"{waited:.1f} s (the store's lock, the disk, or other processes on the cores)"
                )

    def take(self) -> float:
        """The wait accumulated since the last call, reset to zero."""
        waited, self.waited = self.waited, 0.0
        return waited
