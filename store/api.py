"""The store: every read and write of sweeps, runs, attempts, eval points and checkpoints.

This is the only module that opens SQLAlchemy sessions; callers get frozen records back, never ORM
objects. SQLite (one machine) runs in WAL mode with a busy timeout and takes the write lock at the
start of each write transaction, so concurrent writers queue instead of failing; PostgreSQL serves
a cluster where many jobs write at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Text, bindparam, cast, create_engine, delete, event, func, insert, literal, select, update
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session

from store import migrate
from store.errors import BadURLError, NotFoundError, StoreError
from store.models import Attempt, Checkpoint, EvalPoint, Run, Sweep, TrainMetric, utcnow
from store.states import (
    ACTIVE_STATES,
    OPEN_ATTEMPT_STATES,
    RUN_STATES,
    UNSTARTED_ATTEMPT_STATES,
    AttemptState,
    RunState,
)

DEFAULT_DB_FILE = "sweeps.db"
PRUNE_EXEMPT = "exempt"
"""Key of a run's prune record (Run.prune) once resumed with --resume-pruned: never pruned again."""
SQLITE_BUSY_TIMEOUT_MS = 60_000

# ---------------------------------------------------------------------------------------------
# Records returned to callers


@dataclass(frozen=True)
class SweepRecord:
    id: int
    name: str
    spec: dict[str, Any]
    root_dir: str
    executor: str
    created_at: datetime


@dataclass(frozen=True)
class RunRecord:
    id: str
    sweep: str
    position: int
    config_data: dict[str, Any] | str = field(repr=False)
    """The resolved config, or its JSON text as read from the database: `config` decodes it on
    first use (`sweep status` lists 10,000 runs and reads no config; decoding them all was a
    third of its time)."""
    axes: dict[str, Any]
    budget: dict[str, Any]
    run_dir: str
    state: RunState
    state_reason: str | None
    step: int
    updated_at: datetime
    prune: dict[str, Any] | None = None
    """The live prune policy's word on the run (store.models.Run.prune)."""

    @functools.cached_property
    def config(self) -> dict[str, Any]:
        """The resolved RecipeConfig, as a dict."""
        data = self.config_data
        return json.loads(data) if isinstance(data, str) else data


@dataclass(frozen=True)
class NewRun:
    id: str
    position: int
    config: dict[str, Any]
    axes: dict[str, Any]
    budget: dict[str, Any]
    run_dir: str


@dataclass(frozen=True)
class AttemptRecord:
    id: int
    run_id: str
    number: int
    executor: str
    job_id: str | None
    array_job_id: str | None
    array_index: int | None
    node: str | None
    pid: int | None
    state: AttemptState
    exit_reason: str | None
    resumed_from_step: int | None
    stdout_path: str | None
    stderr_path: str | None
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    provenance: dict[str, Any] | None = None


@dataclass(frozen=True)
class TrackedAttempt:
    """What an executor's reconcile step needs of a run's newest attempt (Store.tracked_attempts)."""

    id: int
    run_id: str
    job_id: str
    stderr_path: str | None
    run_state: RunState


@dataclass(frozen=True)
class EvalRecord:
    run_id: str
    step: int
    pass_rate: float
    flops: float
    tokens: int
    device_seconds: float
    gpu_hours: float
    num_samples: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class CheckpointRecord:
    run_id: str
    step: int
    path: str
    created_at: datetime


EVAL_FIELDS = ("step", "pass_rate", "flops", "tokens", "device_seconds", "gpu_hours", "num_samples", "metrics")


# ---------------------------------------------------------------------------------------------
# URLs


URL_FORMS = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
DRIVERS = ("sqlite", "sqlite+pysqlite", "postgresql", "postgresql+psycopg")
CONNECT_TIMEOUT_S = 10  # libpq waits forever on a port that accepts and never answers
_SECRET_PARAM = re.compile(r"(?i)([?&;][^=&;?]*(?:pass|secret|token|key)[^=&;?]*=)([^&;]*)")


def resolve_url(url: str | None = None) -> str:
    """`url`, else $SWEEP_DB, else a SQLite file in the working directory; relative SQLite paths
    become absolute so that jobs started elsewhere write to the same file. A URL this store cannot
    use raises StoreError naming it (masked) and what is allowed."""
    url = url or os.environ.get("SWEEP_DB") or f"sqlite:///{DEFAULT_DB_FILE}"
    parsed = _parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:"):
            parsed = parsed.set(database=str(Path(db).expanduser().resolve()))
    elif parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3, our dependency
    return parsed.render_as_string(hide_password=False)


def _parse_url(url: str) -> URL:
    shown = mask_url(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise BadURLError(f"bad database URL {shown!r}: not a URL; expected {URL_FORMS}") from None
    except ValueError:  # the text would echo the URL's pieces: keep it out
        raise BadURLError(f"bad database URL {shown!r}: its port is not a number; expected {URL_FORMS}") from None
    if parsed.host and "@" in parsed.host:
        raise BadURLError(f"bad database URL {shown!r}: its password holds an '@'; write it as %40")
    if parsed.drivername not in DRIVERS:
        raise BadURLError(
            f"unsupported database URL scheme {parsed.drivername!r} in {shown!r}; allowed: {', '.join(DRIVERS)}"
        )
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise BadURLError(f"bad port {parsed.port} in database URL {shown!r}; allowed: 1 to 65535")
    if parsed.get_backend_name() == "sqlite" and parsed.query and "uri" not in parsed.query:
        # pysqlite would ignore them with a warning; a password there is a mistake worth saying
        raise BadURLError(
            f"database URL {shown!r}: SQLite takes no query parameters ({', '.join(sorted(parsed.query))})"
            "; allowed: none, or a file: URI with uri=true"
        )
    if parsed.get_backend_name() == "sqlite" and not parsed.database:
        raise BadURLError(f"database URL {shown!r} names no file; expected {URL_FORMS}")
    return parsed


def mask_url(url: str) -> str:
    """The URL fit to print: password and secret-looking query parameters replaced by ***. What
    does not parse cleanly (an unencoded '@' in a password) is masked up to its last '@'."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL: mask by hand, below
        return _mask_raw(url)
    if parsed.host and "@" in parsed.host:
        return _mask_raw(url)
    return _SECRET_PARAM.sub(r"\1***", parsed.render_as_string(hide_password=True))


def _mask_raw(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<unparseable database URL>" if "@" in url or ":" in url else _SECRET_PARAM.sub(r"\1***", url)
    userinfo, at, host = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}{':***' if colon else ''}@{host}"
    return _SECRET_PARAM.sub(r"\1***", f"{scheme}://{rest}")


def url_secrets(url: str) -> list[str]:
    """The strings of `url` that must never be printed: its password and secret query values."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001
        return []
    found = [parsed.password or ""]
    found += [m.group(2) for m in _SECRET_PARAM.finditer(url)]
    return sorted({str(v) for v in found if v}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` with every secret of `url` replaced by ***."""
    for secret in url_secrets(url):
        text = text.replace(secret, "***")
    return text


# ---------------------------------------------------------------------------------------------
# The store


class Store:
    """The store at `url`. With `create` (writing commands and jobs) a missing SQLite file is
    created and an older schema migrated; without it (read commands) nothing is created or
    migrated: a missing store or a schema other than this code's is a StoreError saying what to
    do. A schema newer than this code is refused either way."""

    def __init__(self, url: str | None = None, *, create: bool = True):
        self.url = resolve_url(url)
        self.display_url = mask_url(self.url)
        self.is_sqlite = make_url(self.url).get_backend_name() == "sqlite"
        self._engine = self._make_engine(create)
        self._write_engine = self._engine.execution_options(sqlite_immediate=True)
        self._eval_upsert = _upsert_statement(self, EvalPoint, ("run_id", "step"), EVAL_FIELDS[1:])
        if create:
            with self._errors("migrating the schema"):
                migrate.upgrade(self._engine, self.url, self.display_url)
        else:
            with self._errors("reading the schema version"):
                migrate.check(self._engine, self.display_url)

    def _make_engine(self, create: bool) -> Engine:
        try:
            if not self.is_sqlite:
                return self._postgres_engine()
            return self._sqlite_engine(create)
        except (ArgumentError, ImportError) as exc:  # NoSuchModuleError is an ArgumentError
            raise StoreError(f"cannot open {self.display_url}: {scrub(str(exc), self.url)}") from None

    def _postgres_engine(self) -> Engine:
        timeout = int(os.environ.get("SWEEP_DB_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S))
        connect_args = {} if "connect_timeout" in make_url(self.url).query else {"connect_timeout": timeout}
        return create_engine(self.url, pool_pre_ping=True, pool_size=2, max_overflow=4, connect_args=connect_args)

    def _sqlite_engine(self, create: bool) -> Engine:
        url, read_only = self.url, False
        db = make_url(self.url).database
        if db and db != ":memory:" and not db.startswith("file:"):
            path = Path(db)
            if create:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise StoreError(f"cannot create the store {self.display_url}: {exc}") from None
            elif not path.is_file():
                raise NotFoundError(
                    f"no store at {self.display_url} (no such file); `sweep launch` creates it, or pass --db"
                )
            if not create and not os.access(path.parent, os.W_OK):
                # A directory we cannot write (read-only media, another user's results): SQLite
                # cannot make its WAL index there, so read the file as it stands.
                url, read_only = f"sqlite:///file:{path}?mode=ro&immutable=1&uri=true", True
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
            cur = dbapi_conn.cursor()
            if not read_only:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # A deferred transaction that reads and then writes cannot wait for the lock (SQLite
            # fails it at once); writers take the lock up front and wait for it instead.
            immediate = conn.get_execution_options().get("sqlite_immediate", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:  # a lock file or directory the store could not make
            raise StoreError(f"error while {what} ({self.display_url}): {scrub(str(exc), self.url)}") from exc
        except SQLAlchemyError as exc:
            cause = scrub(str(getattr(exc, "orig", None) or exc).strip().splitlines()[0], self.url)
            raise StoreError(f"database error while {what} ({self.display_url}): {cause}") from exc

    @contextmanager
    def _read(self, what: str) -> Iterator[Session]:
        with self._errors(what), Session(self._engine, expire_on_commit=False) as session:
            yield session

    @contextmanager
    def _write(self, what: str) -> Iterator[Session]:
        with self._errors(what), Session(self._write_engine, expire_on_commit=False) as session:
            with session.begin():
                yield session

    def ping(self) -> None:
        """Raise StoreError if the database cannot be reached."""
        with self._read("connecting") as s:
            s.execute(select(1))

    # -- sweeps --------------------------------------------------------------------------------

    def upsert_sweep(self, name: str, spec: dict[str, Any], root_dir: str, executor: str) -> SweepRecord:
        """Create the sweep, or update its spec/root/executor if it exists (safe to race)."""
        values = {"name": name, "spec": spec, "root_dir": root_dir, "executor": executor}
        with self._write(f"registering sweep {name!r}") as s:
            stmt = _insert(self)(Sweep).values(**values)
            s.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={**values, "updated_at": utcnow()}))
            return _sweep(s.scalars(select(Sweep).where(Sweep.name == name)).one())

    def get_sweep(self, name: str) -> SweepRecord | None:
        with self._read(f"reading sweep {name!r}") as s:
            row = s.scalar(select(Sweep).where(Sweep.name == name))
            return _sweep(row) if row else None

    def list_sweeps(self) -> list[SweepRecord]:
        with self._read("listing sweeps") as s:
            return [_sweep(r) for r in s.scalars(select(Sweep).order_by(Sweep.created_at))]

    # -- runs ----------------------------------------------------------------------------------

    def register_runs(self, sweep: str, runs: Sequence[NewRun]) -> list[str]:
        """Insert the runs that are not in the store yet; return the ids that were new. Two
        launches racing on one grid each see only the runs they inserted themselves."""
        if not runs:
            return []
        with self._write(f"registering runs of {sweep!r}") as s:
            sweep_id = _sweep_id(s, sweep)
            rows = [
                {"id": r.id, "sweep_id": sweep_id, "position": r.position, "config": r.config, "axes": r.axes,
                 "budget": r.budget, "run_dir": r.run_dir, "state": RunState.REGISTERED, "step": 0}
                for r in runs
            ]  # fmt: skip
            # One statement executed with all rows: SQLAlchemy batches it into multi-row INSERTs
            # under the bound-parameter limit and compiles it once (a 1,000-row .values() took
            # 0.3 s to compile, 3 s for 10,000 runs); RETURNING yields only the rows inserted.
            stmt = _insert(self)(Run).on_conflict_do_nothing().returning(Run.id)
            inserted = set(s.scalars(stmt, rows))
            return [r.id for r in runs if r.id in inserted]

    def import_runs(
        self,
        sweep: str,
        spec: dict[str, Any],
        runs: Sequence[tuple[NewRun, Sequence[dict[str, Any]]]],
        *,
        executor: str,
        reason: str,
    ) -> tuple[bool, list[str]]:
        """`sweep import`: the sweep (created if new), its runs and their eval points, each run
        completed with one attempt, all in ONE transaction: a failure leaves nothing behind.
        Returns (whether the sweep was created, the ids of the runs that were new)."""
        now = utcnow()
        with self._write(f"importing {len(runs)} runs into {sweep!r}") as s:
            created = s.scalar(select(Sweep.id).where(Sweep.name == sweep)) is None
            if created:
                s.add(Sweep(name=sweep, spec=spec, root_dir="", executor=executor))
                s.flush()
            sweep_id = _sweep_id(s, sweep)
            start = (s.scalar(select(func.max(Run.position)).where(Run.sweep_id == sweep_id)) or -1) + 1
            rows = [
                {"id": r.id, "sweep_id": sweep_id, "position": start + i, "config": r.config, "axes": r.axes,
                 "budget": r.budget, "run_dir": r.run_dir, "state": RunState.COMPLETED, "state_reason": reason,
                 "step": max((p["step"] for p in points), default=0)}
                for i, (r, points) in enumerate(runs)
            ]  # fmt: skip
            new: set[str] = set()
            for chunk in range(0, len(rows), 1000):  # SQLite caps the bound parameters of one statement
                stmt = _insert(self)(Run).values(rows[chunk : chunk + 1000]).on_conflict_do_nothing()
                new.update(s.scalars(stmt.returning(Run.id)))
            for row in rows:
                if row["id"] not in new:  # imported before: new points may extend it
                    s.execute(update(Run).where(Run.id == row["id"]).values(step=row["step"], state=RunState.COMPLETED))
            s.add_all(
                Attempt(run_id=r.id, number=1, executor=executor, state=AttemptState.COMPLETED, started_at=now, ended_at=now)
                for r, _ in runs
                if r.id in new
            )
            points = [
                {"run_id": r.id, "metrics": {}, "created_at": now, **{k: p[k] for k in EVAL_FIELDS if k in p}}
                for r, pts in runs
                for p in pts
            ]
            for chunk in range(0, len(points), 1000):
                s.execute(self._eval_upsert, points[chunk : chunk + 1000])
            return created, [r.id for r, _ in runs if r.id in new]

    def set_run_budget(self, run_id: str, budget: dict[str, Any], config: dict[str, Any]) -> None:
        with self._write(f"updating the budget of run {run_id}") as s:
            s.execute(update(Run).where(Run.id == run_id).values(budget=budget, config=config))

    def runs(self, sweep: str, *, states: Sequence[str] | None = None) -> list[RunRecord]:
        # Plain rows, not ORM objects: `sweep status` reads every run of a 10,000-run sweep.
        with self._read(f"listing runs of {sweep!r}") as s:
            query = select(*_RUN_COLUMNS).join(Sweep).where(Sweep.name == sweep)
            if states is not None:
                query = query.where(Run.state.in_(states))
            return [_run_row(r, sweep) for r in s.execute(query.order_by(Run.position))]

    def config_values(self, sweep: str, keys: Sequence[str]) -> dict[str, tuple[Any, ...]]:
        """Run id -> the values of these dotted config keys (None where a key is unset), read
        by the database's JSON paths: no config is decoded in Python."""
        paths = [Run.config[tuple(key.split("."))] for key in keys]
        with self._read(f"reading {', '.join(keys)} of the runs of {sweep!r}") as s:
            rows = s.execute(select(Run.id, *paths).join(Sweep).where(Sweep.name == sweep))
            return {r[0]: tuple(r[1:]) for r in rows}

    def get_run(self, ref: str) -> RunRecord:
        """A run by id or unique id prefix; NotFoundError names the problem."""
        if not ref.strip():
            raise NotFoundError(f"an empty run id matches nothing in {self.display_url}")
        with self._read(f"reading run {ref!r}") as s:
            # autoescape: `%` and `_` in `ref` are characters to match, not LIKE wildcards
            match = Run.id.startswith(ref, autoescape=True)
            rows = s.execute(select(Run, Sweep.name).join(Sweep).where(match).limit(2)).all()
            if not rows:
                raise NotFoundError(f"no run with id {ref!r} in {self.display_url}")
            if len(rows) > 1:
                raise NotFoundError(f"run id prefix {ref!r} is ambiguous; give more characters")
            return _run(*rows[0])

    def claim_runs(self, run_ids: Sequence[str], from_states: Sequence[str], token: str) -> list[str]:
        """Atomically move runs from `from_states` to `submitting`; return those this call won.

        Two launchers racing on one grid each claim disjoint sets, so every run is submitted once.
        """
        if not run_ids:
            return []
        with self._write("claiming runs for submission") as s:
            s.execute(
                update(Run)
                .where(Run.id.in_(run_ids), Run.state.in_(from_states))
                .values(state=RunState.SUBMITTING, claim=token, state_reason=None)
            )
            return list(s.scalars(select(Run.id).where(Run.id.in_(run_ids), Run.claim == token)))

    def claim_pruned_runs(self, run_ids: Sequence[str], token: str) -> dict[str, dict[str, Any] | None]:
        """`claim_runs` for pruned runs that `sweep launch --resume-pruned` resumes: in the same
        transaction each claimed run's prune record becomes {"exempt": true, "resumed_at", and the
        decision it "overruled"}, so the live policy never prunes it again. Returns the claimed
        ids with the decisions they had."""
        if not run_ids:
            return {}
        with self._write("claiming pruned runs to resume") as s:
            rows = s.execute(
                select(Run.id, Run.prune).where(Run.id.in_(run_ids), Run.state == RunState.PRUNED)
            ).all()
            now = utcnow().isoformat(timespec="seconds")
            for run_id, record in rows:
                s.execute(
                    update(Run)
                    .where(Run.id == run_id, Run.state == RunState.PRUNED)
                    .values(
                        state=RunState.SUBMITTING, claim=token, state_reason=None,
                        prune={PRUNE_EXEMPT: True, "resumed_at": now, "overruled": record},
                    )
                )  # fmt: skip
            return {run_id: record for run_id, record in rows}

    def set_run_state(
        self, run_id: str, state: str, reason: str | None = None, *, only_from: Sequence[str] | None = None
    ) -> bool:
        """Set a run's state; with `only_from`, only if it is currently in one of those states."""
        if state not in RUN_STATES:
            raise ValueError(f"unknown run state {state!r}; allowed: {', '.join(RUN_STATES)}")
        with self._write(f"setting run {run_id} to {state}") as s:
            query = update(Run).where(Run.id == run_id)
            if only_from is not None:
                query = query.where(Run.state.in_(only_from))
            values: dict[str, Any] = {"state": state, "state_reason": reason}
            if state != RunState.SUBMITTING:
                values["claim"] = None
            return s.execute(query.values(**values)).rowcount > 0  # type: ignore[attr-defined]  # a CursorResult

    def set_run_step(self, run_id: str, step: int) -> None:
        with self._write(f"recording the step of run {run_id}") as s:
            s.execute(update(Run).where(Run.id == run_id).values(step=step))

    # -- attempts ------------------------------------------------------------------------------

    def add_attempt(self, run_id: str, executor: str, **fields: Any) -> AttemptRecord:
        """Record a new submission (or requeue) of a run, numbered 1, 2, ..."""
        with self._write(f"recording an attempt of run {run_id}") as s:
            number = (s.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run_id)) or 0) + 1
            row = Attempt(run_id=run_id, number=number, executor=executor, **fields)
            s.add(row)
            s.flush()
            return _attempt(row)

    def begin_attempt(self, run_id: str, executor: str, **fields: Any) -> AttemptRecord:
        """A job starts: take over the run's newest attempt if it has not started yet (the one its
        submission recorded), else record a new one (a requeue, or a run started by hand)."""
        now = utcnow()
        with self._write(f"starting an attempt of run {run_id}") as s:
            row = s.scalar(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1))
            if row is None or row.started_at is not None or row.state not in UNSTARTED_ATTEMPT_STATES:
                number = (row.number if row else 0) + 1
                if row is not None and row.state == AttemptState.RUNNING:
                    # Its job started again without a word from it: the attempt's process was
                    # killed with its node (NODE_FAIL) or by a requeue before it could say so.
                    row.state, row.ended_at = AttemptState.PREEMPTED, now
                    row.exit_reason = (
                        f"ended without a word (its node failed, or it was killed); job {row.job_id} "
                        f"started again as attempt {number}"
                    )
                carried = (
                    {
                        k: getattr(row, k)
                        for k in ("job_id", "array_job_id", "array_index", "stdout_path", "stderr_path")
                    }
                    if row
                    else {}
                )
                row = Attempt(run_id=run_id, number=number, executor=executor, **{**carried, **fields})
                s.add(row)
            else:
                for key, value in fields.items():
                    setattr(row, key, value)
            row.state, row.started_at = AttemptState.RUNNING, now
            s.execute(
                update(Run).where(Run.id == run_id).values(state=RunState.RUNNING, state_reason=None, claim=None)
            )
            s.flush()
            return _attempt(row)

    def end_attempt(self, attempt_id: int, state: str, reason: str | None = None) -> None:
        with self._write(f"ending attempt {attempt_id}") as s:
            s.execute(
                update(Attempt)
                .where(Attempt.id == attempt_id)
                .values(state=state, exit_reason=reason, ended_at=utcnow())
            )

    def settle_attempt(self, attempt_id: int, state: str, reason: str | None, **fields: Any) -> bool:
        """An executor learned how an attempt ended (a crash, a kill, Slurm's verdict). End the
        attempt if it is still open, and set the run's state too if this is the run's newest
        attempt and the run is still active: a late word on an old attempt never overrides a
        newer submission. True if the run's state was set."""
        return self.settle_attempts([(attempt_id, state, reason, fields)]) == 1

    def settle_attempts(self, outcomes: Sequence[tuple[int, str, str | None, dict[str, Any]]]) -> int:
        """`settle_attempt` for many (attempt id, state, reason, other fields) in one transaction;
        returns how many runs changed state. The outcomes take effect in their order, as if
        settled one by one, but in a few statements however many there are (`sweep status`
        settles 10,000 cancelled jobs at once)."""
        changed = 0
        with self._write(f"settling {len(outcomes)} attempts") as s:
            for round_ in _rounds(outcomes):
                changed += self._settle_round(s, round_)
        return changed

    def _settle_round(self, s: Session, outcomes: Sequence[tuple[int, str, str | None, dict[str, Any]]]) -> int:
        """Settle outcomes of distinct attempts of distinct runs (so their order does not matter)."""
        ids = [attempt_id for attempt_id, *_ in outcomes]
        found: dict[int, tuple[str, int, str]] = {}  # attempt id -> (run id, number, state)
        for id_chunk in _chunks(ids):
            query = select(Attempt.id, Attempt.run_id, Attempt.number, Attempt.state).where(Attempt.id.in_(id_chunk))
            found.update({i: (run_id, number, state) for i, run_id, number, state in s.execute(query)})
        newest: dict[str, int] = {}
        for run_chunk in _chunks(list({run_id for run_id, _, _ in found.values()})):
            top = (
                select(Attempt.run_id, func.max(Attempt.number))
                .where(Attempt.run_id.in_(run_chunk))
                .group_by(Attempt.run_id)
            )
            newest.update({run_id: n for run_id, n in s.execute(top)})
        attempt_updates: dict[tuple[str, ...], list[dict[str, Any]]] = {}  # by the columns they set
        run_updates = []
        now = utcnow()
        for attempt_id, state, reason, fields in outcomes:
            if attempt_id not in found:
                continue
            run_id, number, attempt_state = found[attempt_id]
            values = dict(fields)
            if attempt_state in OPEN_ATTEMPT_STATES:
                values = {"state": state, "exit_reason": reason, **values, "ended_at": values.get("ended_at") or now}
            if values:
                attempt_updates.setdefault(tuple(values), []).append(
                    {"b_id": attempt_id, **{f"b_{k}": v for k, v in values.items()}}
                )
            if number == newest.get(run_id):
                run_updates.append({"b_id": run_id, "b_state": state, "b_reason": reason})
        for columns, params in attempt_updates.items():
            values = {c: bindparam(f"b_{c}") for c in columns}
            s.connection().execute(update(Attempt).where(Attempt.id == bindparam("b_id")).values(values), params)
        if not run_updates:
            return 0
        active = [literal(a) for a in ACTIVE_STATES]  # executemany takes no expanding IN
        stmt = (
            update(Run)
            .where(Run.id == bindparam("b_id"), Run.state.in_(active))
            .values(state=bindparam("b_state"), state_reason=bindparam("b_reason"), claim=None)
        )
        return s.connection().execute(stmt, run_updates).rowcount  # sqlite3 and psycopg sum executemany's rowcounts

    def record_submissions(self, executor: str, submissions: Sequence[dict[str, Any]], run_state: str) -> None:
        """One new attempt per submitted run (fields: run_id, and any of job_id, array_job_id,
        array_index, stdout_path, stderr_path, state), and the runs move from `submitting` to
        `run_state`: all in one transaction, so submitting 2,000 runs is one write."""
        if not submissions:
            return
        ids = [sub["run_id"] for sub in submissions]
        with self._write(f"recording {len(ids)} submissions") as s:
            numbers: dict[str, int] = {}
            for chunk in _chunks(ids):
                query = (
                    select(Attempt.run_id, func.max(Attempt.number))
                    .where(Attempt.run_id.in_(chunk))
                    .group_by(Attempt.run_id)
                )
                numbers.update({run_id: n for run_id, n in s.execute(query)})
            now = utcnow()
            rows = [
                {
                    "executor": executor,
                    "state": run_state,
                    "submitted_at": now,
                    **sub,
                    "number": numbers.get(sub["run_id"], 0) + 1,
                }
                for sub in submissions
            ]
            s.execute(insert(Attempt), rows)
            for chunk in _chunks(ids):
                s.execute(
                    update(Run)
                    .where(Run.id.in_(chunk), Run.state == RunState.SUBMITTING)
                    .values(state=run_state, state_reason=None, claim=None)
                )

    def set_runs_state(
        self, run_ids: Sequence[str], state: str, *, only_from: Sequence[str], reason: str | None = None
    ) -> int:
        """Move many runs to `state` (those currently in `only_from`); returns how many moved."""
        moved = 0
        with self._write(f"setting {len(run_ids)} runs to {state}") as s:
            for chunk in _chunks(list(run_ids)):
                query = update(Run).where(Run.id.in_(chunk), Run.state.in_(only_from))
                moved += s.execute(query.values(state=state, state_reason=reason, claim=None)).rowcount  # type: ignore[attr-defined]  # a CursorResult
        return moved

    def prune_runs(self, run_ids: Sequence[str], reason: str, record: dict[str, Any]) -> list[str]:
        """Move the runs still active to `pruned` with `reason` and the decision `record`, in one
        transaction; return the ids that moved (a run that ended meanwhile keeps its end)."""
        if not run_ids:
            return []
        with self._write(f"pruning {len(run_ids)} runs") as s:
            moved = list(s.scalars(select(Run.id).where(Run.id.in_(run_ids), Run.state.in_(ACTIVE_STATES))))
            if moved:
                s.execute(
                    update(Run)
                    .where(Run.id.in_(moved))
                    .values(state=RunState.PRUNED, state_reason=reason, prune=record, claim=None)
                )
            return moved

    def set_prune_records(self, records: Mapping[str, dict[str, Any] | None]) -> None:
        """Write the prune policy's word (or None) on each run, leaving states alone."""
        if not records:
            return
        with self._write(f"recording the prune policy's word on {len(records)} runs") as s:
            for run_id, record in records.items():
                s.execute(update(Run).where(Run.id == run_id).values(prune=record))

    def withdraw_submissions(self, run_ids: Sequence[str], reason: str) -> int:
        """A submission failed after it was recorded: the runs (still `submitting` or `queued`) go
        back to `registered` with the reason, and their unstarted attempts end as failed, so
        nothing starts them later by surprise. Returns how many runs moved."""
        moved = 0
        with self._write(f"withdrawing {len(run_ids)} submissions") as s:
            for chunk in _chunks(list(run_ids)):
                waiting = (RunState.SUBMITTING, RunState.QUEUED)
                query = update(Run).where(Run.id.in_(chunk), Run.state.in_(waiting))
                moved += s.execute(
                    query.values(state=RunState.REGISTERED, state_reason=reason, claim=None)
                ).rowcount  # type: ignore[attr-defined]  # a CursorResult
                s.execute(
                    update(Attempt)
                    .where(Attempt.run_id.in_(chunk), Attempt.state == AttemptState.QUEUED)
                    .values(state=AttemptState.FAILED, exit_reason=reason, ended_at=utcnow())
                )
        return moved

    def queued_attempts(self, executor: str, *, limit: int) -> list[AttemptRecord]:
        """Attempts waiting for a slot of `executor`, oldest first."""
        with self._read(f"reading queued {executor} attempts") as s:
            rows = s.scalars(
                select(Attempt)
                .join(Run)
                .where(
                    Attempt.executor == executor,
                    Attempt.state == AttemptState.QUEUED,
                    Run.state == RunState.QUEUED,
                )
                .order_by(Attempt.submitted_at, Attempt.id)
                .limit(limit)
            )
            return [_attempt(r) for r in rows]

    def active_attempts(self, executor: str, sweep: str | None = None) -> list[AttemptRecord]:
        """Open attempts of `executor` (queued, pending, running; optionally of one sweep)."""
        with self._read(f"reading active {executor} attempts") as s:
            query = (
                select(Attempt)
                .join(Run)
                .where(Attempt.executor == executor, Attempt.state.in_(OPEN_ATTEMPT_STATES))
            )
            if sweep is not None:
                query = query.join(Sweep).where(Sweep.name == sweep)
            return [_attempt(r) for r in s.scalars(query.order_by(Attempt.id))]

    def update_attempt(self, attempt_id: int, **fields: Any) -> None:
        with self._write(f"updating attempt {attempt_id}") as s:
            s.execute(update(Attempt).where(Attempt.id == attempt_id).values(**fields))

    def attempts(self, run_id: str) -> list[AttemptRecord]:
        with self._read(f"reading attempts of run {run_id}") as s:
            rows = s.scalars(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number))
            return [_attempt(r) for r in rows]

    def latest_attempts(self, sweep: str) -> dict[str, AttemptRecord]:
        """The newest attempt of every run of the sweep that has one."""
        with self._read(f"reading attempts of {sweep!r}") as s:
            rows = _newest_per_run(s, Attempt, Attempt.number, sweep, _ATTEMPT_COLUMNS)
            return {r[1]: _attempt_row(r) for r in rows}

    def latest_executors(self, sweep: str) -> set[str]:
        """The executors of the runs' newest attempts (one small query, no records built)."""
        with self._read(f"reading the executors of {sweep!r}") as s:
            newest = _newest_subquery(Attempt, Attempt.number, sweep)
            query = select(Attempt.executor).join(
                newest, (Attempt.run_id == newest.c.run_id) & (Attempt.number == newest.c.top)
            )
            return set(s.scalars(query.distinct()))

    def tracked_attempts(self, sweep: str, executor: str) -> list[TrackedAttempt]:
        """The newest attempts of `executor` that carry a job id, of the sweep's runs in an active
        state: what an executor's reconcile step asks about (only the columns it needs)."""
        with self._read(f"reading tracked {executor} attempts of {sweep!r}") as s:
            newest = _newest_subquery(Attempt, Attempt.number, sweep)
            query = (
                select(Attempt.id, Attempt.run_id, Attempt.job_id, Attempt.stderr_path, Run.state)
                .join(newest, (Attempt.run_id == newest.c.run_id) & (Attempt.number == newest.c.top))
                .join(Run, Run.id == Attempt.run_id)
                .where(Attempt.executor == executor, Attempt.job_id.is_not(None), Attempt.job_id != "")
                .where(Run.state.in_(ACTIVE_STATES))
                .order_by(Attempt.id)
            )
            rows = s.execute(query)
            return [TrackedAttempt(i, run, job or "", err, RunState(state)) for i, run, job, err, state in rows]

    def attempt_counts(self, sweep: str) -> dict[str, int]:
        with self._read(f"counting attempts of {sweep!r}") as s:
            rows = s.execute(
                select(Attempt.run_id, func.count())
                .join(Run)
                .join(Sweep)
                .where(Sweep.name == sweep)
                .group_by(Attempt.run_id)
            )
            return {run_id: n for run_id, n in rows}

    # -- eval points, train metrics, checkpoints ------------------------------------------------

    def add_eval_points(self, run_id: str, points: Sequence[dict[str, Any]]) -> None:
        """Upsert eval points keyed by (run, step): writing the same step twice keeps one row.

        The hot path of every job (and of 32 writers at once): one cached statement, no ORM."""
        if not points:
            return
        now = utcnow()
        rows = [
            {"run_id": run_id, "metrics": {}, "created_at": now, **{k: p[k] for k in EVAL_FIELDS if k in p}}
            for p in points
        ]
        with self._errors(f"writing eval points of run {run_id}"), self._write_engine.begin() as conn:
            conn.execute(self._eval_upsert, rows)

    def eval_points(self, run_id: str) -> list[EvalRecord]:
        with self._read(f"reading eval points of run {run_id}") as s:
            rows = s.scalars(select(EvalPoint).where(EvalPoint.run_id == run_id).order_by(EvalPoint.step))
            return [_eval(r) for r in rows]

    def sweep_eval_points(self, sweep: str) -> dict[str, list[EvalRecord]]:
        """All eval points of a sweep, by run id, in step order."""
        with self._read(f"reading eval points of {sweep!r}") as s:
            rows = s.scalars(
                select(EvalPoint)
                .join(Run)
                .join(Sweep)
                .where(Sweep.name == sweep)
                .order_by(EvalPoint.run_id, EvalPoint.step)
            )
            out: dict[str, list[EvalRecord]] = {}
            for r in rows:
                out.setdefault(r.run_id, []).append(_eval(r))
            return out

    def last_eval_points(self, sweep: str) -> dict[str, EvalRecord]:
        """The newest eval point of every run of the sweep that has one."""
        with self._read(f"reading eval points of {sweep!r}") as s:
            rows = _newest_per_run(s, EvalPoint, EvalPoint.step, sweep, _EVAL_COLUMNS)
            return {r[0]: _eval_row(r) for r in rows}

    def delete_eval_points_after(self, run_id: str, step: int) -> int:
        """Forget eval points past `step`: they belong to a trajectory that a resume abandons."""
        with self._write(f"trimming eval points of run {run_id}") as s:
            return s.execute(delete(EvalPoint).where(EvalPoint.run_id == run_id, EvalPoint.step > step)).rowcount  # type: ignore[attr-defined]  # a CursorResult

    def add_train_metrics(self, run_id: str, rows: Sequence[tuple[int, dict[str, Any]]]) -> None:
        """Upsert per-step training metrics; the run's step becomes the newest of them."""
        if not rows:
            return
        values = [{"run_id": run_id, "step": step, "metrics": m} for step, m in rows]
        newest = max(step for step, _ in rows)
        with self._write(f"writing train metrics of run {run_id}") as s:
            s.execute(_upsert(self, TrainMetric, values, ("run_id", "step")))
            s.execute(update(Run).where(Run.id == run_id, Run.step < newest).values(step=newest))

    def train_metrics(self, run_id: str) -> list[tuple[int, dict[str, Any]]]:
        with self._read(f"reading train metrics of run {run_id}") as s:
            rows = s.execute(
                select(TrainMetric.step, TrainMetric.metrics)
                .where(TrainMetric.run_id == run_id)
                .order_by(TrainMetric.step)
            )
            return [(step, m) for step, m in rows]

    def add_checkpoint(self, run_id: str, step: int, path: str) -> None:
        with self._write(f"recording a checkpoint of run {run_id}") as s:
            s.execute(_upsert(self, Checkpoint, [{"run_id": run_id, "step": step, "path": path}], ("run_id", "step")))

    def delete_checkpoint(self, run_id: str, step: int) -> None:
        with self._write(f"forgetting a checkpoint of run {run_id}") as s:
            s.execute(delete(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step))

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        with self._read(f"reading checkpoints of run {run_id}") as s:
            rows = s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step))
            return [CheckpointRecord(r.run_id, r.step, r.path, _aware(r.created_at)) for r in rows]


# ---------------------------------------------------------------------------------------------
# Helpers


_T = typing.TypeVar("_T")


def _rounds(outcomes: Sequence[tuple[int, str, str | None, dict[str, Any]]]) -> list[list[Any]]:
    """Split settle outcomes into rounds with each attempt at most once per round, in order: an
    outcome goes in the round after the last one holding its attempt. Within a round nothing
    depends on order: only a run's newest attempt sets the run, and that attempt is there once."""
    rounds: list[list[Any]] = []
    last: dict[int, int] = {}
    for outcome in outcomes:
        index = last.get(outcome[0], -1) + 1
        if index == len(rounds):
            rounds.append([])
        rounds[index].append(outcome)
        last[outcome[0]] = index
    return rounds


def _chunks(items: list[_T], size: int = 900) -> Iterator[list[_T]]:
    """Slices small enough for SQLite's limit on bound parameters."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _insert(store: Store) -> Any:
    """The dialect's INSERT, which knows ON CONFLICT."""
    if store.is_sqlite:
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert
    from sqlalchemy.dialects.postgresql import insert as postgresql_insert

    return postgresql_insert


def _upsert_statement(store: Store, model: type, keys: tuple[str, ...], updated: Sequence[str]) -> Any:
    """INSERT .. ON CONFLICT (keys) DO UPDATE, without values: executed with a list of rows, it
    compiles once and is cached (psycopg then prepares it on the server)."""
    stmt = _insert(store)(model)
    return stmt.on_conflict_do_update(index_elements=list(keys), set_={c: stmt.excluded[c] for c in updated})


def _upsert(store: Store, model: type, rows: list[dict[str, Any]], keys: tuple[str, ...]) -> Any:
    stmt = _insert(store)(model).values(rows)
    updatable = {c: stmt.excluded[c] for c in rows[0] if c not in keys}
    return stmt.on_conflict_do_update(index_elements=list(keys), set_=updatable)


def _newest_subquery(model: Any, order: Any, sweep: str) -> Any:
    """(run_id, top): the largest `order` of `model`'s rows for each run of the sweep."""
    return (
        select(model.run_id, func.max(order).label("top"))
        .join(Run)
        .join(Sweep)
        .where(Sweep.name == sweep)
        .group_by(model.run_id)
        .subquery()
    )


def _newest_per_run(s: Session, model: Any, order: Any, sweep: str, columns: Sequence[Any]) -> Any:
    """`columns` of the rows of `model` with the largest `order` for each run of the sweep, as
    plain tuples (one per run of a 10,000-run sweep: ORM objects for them cost more than the query)."""
    newest = _newest_subquery(model, order, sweep)
    query = select(*columns).join(newest, (model.run_id == newest.c.run_id) & (order == newest.c.top))
    return s.execute(query)


def _sweep_id(s: Session, name: str) -> int:
    sweep_id = s.scalar(select(Sweep.id).where(Sweep.name == name))
    if sweep_id is None:
        raise NotFoundError(f"no sweep named {name!r}")
    return sweep_id


@typing.overload
def _aware(dt: datetime) -> datetime: ...
@typing.overload
def _aware(dt: datetime | None) -> datetime | None: ...
def _aware(dt: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; everything we store is UTC.
    if dt is not None and dt.tzinfo is None:
        return dt.replace(tzinfo=UTC)
    return dt


def _sweep(r: Sweep) -> SweepRecord:
    return SweepRecord(r.id, r.name, r.spec, r.root_dir, r.executor, _aware(r.created_at))


_RUN_COLUMNS = (
    Run.id, Run.position, cast(Run.config, Text).label("config"), Run.axes, Run.budget, Run.run_dir, Run.state,
    Run.state_reason, Run.step, Run.updated_at, Run.prune,
)  # fmt: skip
"""The columns of a RunRecord (all but `sweep`), in its order: what `_run_row` reads. The config
comes as its JSON text, decoded only when a caller asks for it (RunRecord.config)."""


def _run(r: Run, sweep: str) -> RunRecord:
    return _run_row(tuple(getattr(r, column.key) for column in _RUN_COLUMNS), sweep)


def _run_row(r: Sequence[Any], sweep: str) -> RunRecord:
    """A run record from a tuple of `_RUN_COLUMNS`."""
    run_id, position, config, axes, budget, run_dir, state, reason, step, updated_at, prune = r
    return RunRecord(
        run_id, sweep, position, config, axes, budget, run_dir, RunState(state), reason, step, _aware(updated_at), prune
    )


_ATTEMPT_FIELDS = tuple(f.name for f in dataclasses.fields(AttemptRecord))
_ATTEMPT_COLUMNS = tuple(getattr(Attempt, name) for name in _ATTEMPT_FIELDS)
"""The columns of an AttemptRecord, in its order: what `_attempt_row` reads."""
_ATTEMPT_TIMES = tuple(_ATTEMPT_FIELDS.index(k) for k in ("submitted_at", "started_at", "ended_at"))
_ATTEMPT_STATE = _ATTEMPT_FIELDS.index("state")


def _attempt_row(r: Sequence[Any]) -> AttemptRecord:
    """An attempt record from a tuple of `_ATTEMPT_COLUMNS`."""
    values = list(r)
    for i in _ATTEMPT_TIMES:
        values[i] = _aware(values[i])
    values[_ATTEMPT_STATE] = AttemptState(values[_ATTEMPT_STATE])
    return AttemptRecord(*values)


def _attempt(r: Attempt) -> AttemptRecord:
    return _attempt_row(tuple(getattr(r, name) for name in _ATTEMPT_FIELDS))


_EVAL_COLUMNS = (
    EvalPoint.run_id, EvalPoint.step, EvalPoint.pass_rate, EvalPoint.flops, EvalPoint.tokens,
    EvalPoint.device_seconds, EvalPoint.gpu_hours, EvalPoint.num_samples, EvalPoint.metrics,
)  # fmt: skip
"""The columns of an EvalRecord, in its order: what `_eval_row` reads."""


def _eval_row(r: Sequence[Any]) -> EvalRecord:
    """An eval record from a tuple of `_EVAL_COLUMNS`."""
    run_id, step, pass_rate, flops, tokens, device_seconds, gpu_hours, num_samples, metrics = r
    return EvalRecord(run_id, step, pass_rate, flops, tokens, device_seconds, gpu_hours, num_samples, metrics or {})


def _eval(r: EvalPoint) -> EvalRecord:
    return EvalRecord(
        r.run_id, r.step, r.pass_rate, r.flops, r.tokens, r.device_seconds, r.gpu_hours, r.num_samples, r.metrics or {}
    )
