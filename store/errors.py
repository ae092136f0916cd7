"""The store's errors. Each message says what was being done, the (masked) URL and the cause."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A database failure, with its cause and the (password-masked) URL."""


class NotFoundError(StoreError):
    """No sweep or run by that name, or a run id prefix that names several."""


class SchemaError(StoreError):
    """The database's schema is not the one this code knows: older (and this command does not
    migrate) or newer (written by a newer scalesweep)."""


class BadURLError(StoreError):
    """A database URL this store cannot use (a usage error: the command exits 2)."""
