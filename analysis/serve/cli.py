"""`sweep serve`'s body (launcher/cli.py parses its options and calls this)."""

from __future__ import annotations

import os

from analysis.serve.snapshot import ServeOptions
from store import NotFoundError, Store

TOKEN_ENV = "SWEEP_SERVE_TOKEN"
"""Set it to choose the token instead of getting a new one at every start."""


def serve_command(
    store: Store, sweep: str | None, host: str, port: int, compute: str | None, predict_at: float | None
) -> None:
    try:
        from analysis.serve.app import serve
    except ImportError as exc:
        raise NotFoundError(f"`sweep serve` needs {exc.name}: pip install -e '.[serve]'") from None
    names = [sweep] if sweep else [s.name for s in store.list_sweeps()]
    if not names:
        raise NotFoundError(f"no sweeps in {store.display_url}; start one with `sweep launch GRID.yaml`")
    options = ServeOptions(compute=compute, predict_at=predict_at)
    serve(store, names, host=host, port=port, options=options, token=os.environ.get(TOKEN_ENV) or None)
