"""PipelineRL-k's rules as properties: whatever the interleaving of admissions, finishing groups,
weight pushes and trainer steps, no trained sample is older than k policy versions; with pushes
that arrive at once and groups that finish in order, admission alone keeps every sample (nothing
is dropped); every admitted group is trained, dropped or still in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.loop.lag import Admission, Span, admission_limit, lag_metrics, split_stale


@dataclass
class Pipeline:
    """A model of one run: generators, a trainer rank 0 and the rules of recipe.loop.lag."""

    max_lag: int
    groups_per_step: int
    admission: Admission = field(init=False)
    step: int = 0  # trainer steps taken = the trainer's policy version
    generator_version: int = 0  # what the generators hold (pushes may lag)
    in_flight: list[int] = field(default_factory=list)  # version_start of running groups
    finished: list[Span] = field(default_factory=list)
    trained: list[tuple[int, Span]] = field(default_factory=list)  # (step, span)
    num_admitted: int = 0
    num_dropped: int = 0
    metrics: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.admission = Admission(self.max_lag, self.groups_per_step)

    def admit(self) -> None:
        if self.admission.try_admit(self.generator_version):
            self.in_flight.append(self.generator_version)
            self.num_admitted += 1

    def finish(self, which: int) -> None:
        if self.in_flight:
            start = self.in_flight.pop(which % len(self.in_flight))
            self.finished.append(Span(start, self.generator_version))

    def push(self) -> None:
        self.generator_version = self.step

    def train(self) -> None:
        if len(self.finished) < self.groups_per_step:
            return
        batch, self.finished = self.finished[: self.groups_per_step], self.finished[self.groups_per_step :]
        keep, drop = split_stale(self.step, batch, self.max_lag)
        self.trained += [(self.step, batch[i]) for i in keep]
        self.num_dropped += len(drop)
        self.admission.give_back(len(drop))
        self.metrics.append(lag_metrics(self.step, [batch[i] for i in keep], len(drop)))
        self.step += 1


EVENTS = st.lists(
    st.one_of(st.just(("admit", 0)), st.tuples(st.just("finish"), st.integers(0, 50)), st.just(("push", 0)),
              st.just(("train", 0))),
    max_size=300,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(max_lag=st.integers(0, 4), groups=st.integers(1, 4), events=EVENTS)
def test_no_trained_sample_is_older_than_k(max_lag, groups, events):
    pipe = Pipeline(max_lag, groups)
    for name, arg in events:
        pipe.finish(arg) if name == "finish" else getattr(pipe, name)()
    assert all(step - span.version_start <= max_lag for step, span in pipe.trained)
    assert all(m["lag_max"] <= max_lag and 0 <= m["lag_mean"] <= m["lag_max"] for m in pipe.metrics)
    assert pipe.num_admitted == len(pipe.trained) + pipe.num_dropped + len(pipe.in_flight) + len(pipe.finished)
    assert pipe.admission.admitted <= admission_limit(pipe.generator_version, max_lag, groups)


@settings(max_examples=200, deadline=None)
@given(max_lag=st.integers(0, 4), groups=st.integers(1, 4), rounds=st.lists(st.integers(0, 12), max_size=40))
def test_admission_alone_prevents_drops_when_pushes_are_immediate(max_lag, groups, rounds):
    """Groups finish in admission order and every push lands at once: nothing is dropped, and
    the generators really run ahead (lag reaches k once there is enough work)."""
    pipe = Pipeline(max_lag, groups)
    for admits in rounds:
        for _ in range(admits):
            pipe.admit()
        while pipe.in_flight:
            pipe.finish(0)
        pipe.train()
        pipe.push()
    assert pipe.num_dropped == 0
    assert all(step - span.version_start <= max_lag for step, span in pipe.trained)


def test_generators_run_up_to_k_versions_ahead():
    pipe = Pipeline(max_lag=2, groups_per_step=1)
    for _ in range(10):
        pipe.admit()  # the generator at version 0 may start k + 1 = 3 groups
    assert pipe.num_admitted == 3
    for _ in range(3):
        pipe.finish(0)
    for _ in range(3):
        pipe.train()  # no push in between: versions 0, 1, 2 train version-0 samples
    assert [m["lag_max"] for m in pipe.metrics] == [0.0, 1.0, 2.0]
    assert pipe.num_dropped == 0


def test_a_straggler_past_k_is_dropped_and_its_slot_given_back():
    pipe = Pipeline(max_lag=1, groups_per_step=1)
    pipe.admit()
    pipe.admit()  # limit (0 + 1 + 1) * 1 = 2
    pipe.finish(1)  # the second group finishes first
    pipe.train()
    pipe.push()
    pipe.admit()  # version 1: limit 3
    pipe.finish(1)
    pipe.train()
    pipe.push()
    pipe.finish(0)  # the first group (started at version 0) finally finishes; step 2 - 0 > 1
    pipe.train()
    assert pipe.num_dropped == 1 and pipe.metrics[-1]["num_dropped"] == 1.0
    assert pipe.admission.admitted == 2  # 3 admitted, 1 given back


def test_spans_run_forward():
    with pytest.raises(ValueError, match="forward"):
        Span(3, 2)
