"""Database URLs: resolving the default, parsing with one clear error per mistake, and masking
passwords and secret-looking parameters in everything printed or logged."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from store.errors import BadURLError

DEFAULT_DB_FILE = "sweeps.db"


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
