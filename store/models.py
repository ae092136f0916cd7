"""SQLAlchemy 2 models. Schema changes go through an Alembic migration in store/migrations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from store.states import AttemptState, RunState


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    spec: Mapped[dict[str, Any]]  # the grid file as loaded, overrides applied
    root_dir: Mapped[str] = mapped_column(Text)  # runs live in root_dir/<run id>/
    executor: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)  # order in the expanded grid
    config: Mapped[dict[str, Any]]  # resolved RecipeConfig
    axes: Mapped[dict[str, Any]]  # the grid axis values that distinguish this run
    budget: Mapped[dict[str, Any]]
    run_dir: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default=RunState.REGISTERED.value, index=True)
    state_reason: Mapped[str | None] = mapped_column(Text, default=None)
    step: Mapped[int] = mapped_column(Integer, default=0)  # newest step reported by the run
    claim: Mapped[str | None] = mapped_column(String(64), default=None)  # who is submitting it
    prune: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """The live prune policy's word on the run (analysis/pruning.py): the last judgment it took
    part in, or the decision that pruned it (the fit that decided), or that it was resumed."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Attempt(Base):
    """One submission or requeue of a run."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    executor: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    array_job_id: Mapped[str | None] = mapped_column(String(64), default=None)
    array_index: Mapped[int | None] = mapped_column(Integer, default=None)
    node: Mapped[str | None] = mapped_column(String(255), default=None)
    pid: Mapped[int | None] = mapped_column(Integer, default=None)
    state: Mapped[str] = mapped_column(String(16), default=AttemptState.QUEUED.value)
    exit_reason: Mapped[str | None] = mapped_column(Text, default=None)
    resumed_from_step: Mapped[int | None] = mapped_column(Integer, default=None)
    stdout_path: Mapped[str | None] = mapped_column(Text, default=None)
    stderr_path: Mapped[str | None] = mapped_column(Text, default=None)
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    ended_at: Mapped[datetime | None] = mapped_column(default=None)
    provenance: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """Code, environment and machine of the attempt (recipe/telemetry/provenance.py)."""


class EvalPoint(Base):
    """One held-out evaluation; unique on (run, step) so a replay after requeue is idempotent."""

    __tablename__ = "eval_points"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    pass_rate: Mapped[float] = mapped_column(Float)
    flops: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(BigInteger)
    device_seconds: Mapped[float] = mapped_column(Float)
    gpu_hours: Mapped[float] = mapped_column(Float)
    num_samples: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TrainMetric(Base):
    __tablename__ = "train_metrics"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]]


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
