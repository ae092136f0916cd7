"""recipe.telemetry.waits: a phase that waits off the CPU is logged by name; busy phases are not."""

from __future__ import annotations

import threading
import time

from recipe.telemetry.waits import WaitWatch


class Clocks:
    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0


def test_a_phase_waiting_past_the_threshold_is_logged_with_its_name_and_step():
    clocks, lines = Clocks(), []
    watch = WaitWatch(lines.append, threshold=5.0, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    with watch.phase("eval report", 120):
        clocks.wall += 16.0
        clocks.cpu += 1.0
    assert len(lines) == 1
    assert lines[0].startswith("step 120: eval report took 16.0 s of wall time on 1.0 s of CPU: it waited 15.0 s")
    assert watch.take() == 15.0
    assert watch.take() == 0.0


def test_busy_phases_and_short_waits_are_not_logged_but_add_up():
    clocks, lines = Clocks(), []
    watch = WaitWatch(lines.append, threshold=5.0, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    with watch.phase("train step", 1):
        clocks.wall += 30.0
        clocks.cpu += 30.0  # busy all along
    with watch.phase("checkpoint", 1):
        clocks.wall += 3.0  # waited, under the threshold
    with watch.phase("train step", 2):
        clocks.wall += 1.0
        clocks.cpu += 2.0  # two threads: more CPU than wall time, no negative wait
    assert lines == []
    assert watch.take() == 3.0


def test_the_wait_is_measured_even_when_the_phase_raises():
    clocks, lines = Clocks(), []
    watch = WaitWatch(lines.append, threshold=1.0, wall=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    try:
        with watch.phase("checkpoint", 7):
            clocks.wall += 2.5
            raise OSError("disk full")
    except OSError:
        pass
    assert watch.take() == 2.5 and "checkpoint" in lines[0]


def test_real_clocks_see_a_sleep_and_a_lock_wait():
    # (No busy phase here: on a loaded machine a busy loop is descheduled and looks like waiting.)
    lines: list[str] = []
    watch = WaitWatch(lines.append, threshold=0.15)
    with watch.phase("sleeping", 0):
        time.sleep(0.3)
    lock = threading.Lock()
    lock.acquire()
    threading.Timer(0.3, lock.release).start()
    with watch.phase("waiting on a lock", 0):
        lock.acquire()
    assert [line.split(" took")[0] for line in lines] == ["step 0: sleeping", "step 0: waiting on a lock"]
