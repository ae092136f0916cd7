"""Schema migrations with Alembic, applied when a Store opens.

Starting a CLI command must stay fast, so Alembic is imported only when the database's recorded
revision differs from HEAD. Concurrent first opens are serialised (an advisory lock on PostgreSQL,
a lock file beside the database on SQLite), so exactly one process runs each migration.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from filelock import FileLock
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.engine import make_url

HEAD = "0001"  # keep in step with the newest file in store/migrations/versions
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_PG_LOCK_KEY = 0x5CA1E5  # any constant shared by every scalesweep process


def current_revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: Engine, url: str) -> None:
    """Bring the schema to HEAD; a no-op (one query) when it is there already."""
    with engine.connect() as conn:
        if current_revision(conn) == HEAD:
            return
    with _exclusive(engine, url) as conn:
        if current_revision(conn) == HEAD:  # another process migrated while we waited
            return
        from alembic import command
        from alembic.config import Config

        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS_DIR))
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        conn.commit()


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
