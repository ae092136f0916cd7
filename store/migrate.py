"""Schema migrations with Alembic, applied when a Store opens.

Starting a CLI command must stay fast, so Alembic is imported only when the database's recorded
revision differs from HEAD. Concurrent first opens are serialised (an advisory lock on PostgreSQL,
a lock file beside the database on SQLite), so exactly one process runs each migration.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from filelock import FileLock
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.engine import make_url

from store.errors import SchemaError

HEAD = "0003"  # keep in step with the newest file in store/migrations/versions
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
REVISION_FILE = re.compile(r"^(\d{4})_\w+\.py$")
_PG_LOCK_KEY = 0x5CA1E5  # any constant shared by every scalesweep process


def current_revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def known_revisions() -> list[str]:
    """The revisions this code can migrate from and to, oldest first (from the file names)."""
    names = (p.name for p in (MIGRATIONS_DIR / "versions").iterdir())
    return sorted(m.group(1) for name in names if (m := REVISION_FILE.match(name)))


def check(engine: Engine, where: str) -> None:
    """For commands that must not write: the schema is HEAD, or a SchemaError says what to do."""
    with engine.connect() as conn:
        revision = current_revision(conn)
    if revision == HEAD:
        return
    _refuse_unknown(revision, where)
    if revision is None:
        raise SchemaError(f"{where} holds no scalesweep store yet; `sweep launch` creates one")
    raise SchemaError(
        f"the store {where} has schema revision {revision}, older than this code's {HEAD}; "
        "run a writing command once (`sweep launch`, `sweep import`) to migrate it"
    )


def upgrade(engine: Engine, url: str, where: str) -> None:
    """Bring the schema to HEAD; a no-op (one query) when it is there already. A revision this
    code does not know (written by a newer scalesweep) is refused, never migrated."""
    with engine.connect() as conn:
        revision = current_revision(conn)
    if revision == HEAD:
        return
    _refuse_unknown(revision, where)
    with _exclusive(engine, url) as conn:
        revision = current_revision(conn)
        if revision == HEAD:  # another process migrated while we waited
            return
        _refuse_unknown(revision, where)
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        conn.commit()


def _refuse_unknown(revision: str | None, where: str) -> None:
    if revision is not None and revision not in known_revisions():
        raise SchemaError(
            f"the store {where} has schema revision {revision!r}, which this scalesweep does not know "
            f"(it knows {', '.join(known_revisions())}): it was written by a newer version; upgrade scalesweep"
        )


@contextmanager
def _exclusive(engine: Engine, url: str) -> Iterator[Connection]:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        lock_path = Path(f"{db}.migrate.lock") if db and db != ":memory:" else None
        with FileLock(lock_path) if lock_path else nullcontext(), engine.connect() as conn:
            yield conn
    else:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
            conn.commit()
            try:
                yield conn
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
                conn.commit()
