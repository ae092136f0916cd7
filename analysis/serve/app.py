"""`sweep serve`: a small Starlette app (run by uvicorn) that serves the sweep page, its data as
JSON, and Plotly's JavaScript from the plotly Python package (nothing comes from a CDN).

A background thread polls the store's fingerprint of each sweep (`Store.sweep_stamp`) every
`poll_s` seconds and rebuilds that sweep's data when it changed (refitting only the
configurations whose points changed, analysis.serve.snapshot); the page asks for the current
version every second and fetches the data when it moved, so a new point reaches the chart
without a reload. Handlers never fit: they hand out the newest JSON as it is. The one exception
is the backtest (`/api/backtest/{sweep}`, the page's "Backtest" section, `sweep report
--backtest`'s figures): it replays fits at ten cuts, so it runs only when the section is opened,
in a worker thread, and is kept until the sweep's fingerprint moves.

Access: bound to 127.0.0.1 by default. On any other address a token is required (printed at
start): `?token=` on the first request sets a cookie, and every request is checked against it
(the page shows run directories and configs).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from analysis.backtest import BacktestOptions
from analysis.report.backtest import sweep_backtest, to_json_dict
from analysis.serve.snapshot import ServeOptions, SweepView
from analysis.trackers import tracker_links
from store import NotFoundError, Store, StoreError

log = logging.getLogger("sweep.serve")
COOKIE = "sweep_serve_token"
BACKTEST = BacktestOptions(n_boot=50, workers=1)
"""The page's backtest: `sweep report --backtest`'s cuts and bootstrap size, in the server's own
process (no pool forked from a threaded server)."""


def plotly_js() -> Path:
    """Plotly's bundled JavaScript, shipped inside the plotly Python package."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall plotly (pip install -e '.[serve]')")
    return path


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class _Published:
    version: int = 0
    stamp: Any = None
    body: bytes = b"null"
    error: str | None = None


@dataclass
class Live:
    """The newest data of each served sweep, kept fresh by one background thread."""

    store: Store
    sweeps: list[str]
    options: ServeOptions
    poll_s: float = 0.5
    _views: dict[str, SweepView] = field(default_factory=dict)
    _published: dict[str, _Published] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _backtests: dict[str, tuple[Any, bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.sweeps:
            self._views[name] = SweepView(self.store, name, self.options)
            self._published[name] = _Published()

    def refresh(self) -> None:
        """Rebuild every sweep whose fingerprint moved."""
        for name, view in self._views.items():
            current = self._published[name]
            try:
                stamp = self.store.sweep_stamp(name)
                if stamp == current.stamp:
                    continue
                body = json.dumps(view.build() | {"links": self._links(name)}, allow_nan=False).encode()
                error = None
            except (StoreError, ValueError) as exc:
                log.warning("reading sweep %s: %s", name, exc)
                stamp, body, error = None, current.body, str(exc)
            with self._lock:
                self._published[name] = _Published(current.version + 1, stamp, body, error)

    def _links(self, sweep: str) -> dict[str, list[dict[str, str]]]:
        record = self.store.get_sweep(sweep)
        block = ((record.spec if record else {}).get("grid") or {}).get("tracking") or {}
        if not block:
            return {}
        return {r.id: tracker_links(block, sweep, r.id, r.run_dir) for r in self.store.runs(sweep)}

    def backtest(self, sweep: str) -> bytes:
        """The sweep's backtest as JSON (`analysis.report.backtest.to_json_dict`), or {"error": why}
        while no configuration has completed; computed once per fingerprint of the sweep."""
        stamp = self.store.sweep_stamp(sweep)
        with self._lock:
            cached = self._backtests.get(sweep)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            axis, result = sweep_backtest(self.store, sweep, BACKTEST)
            body = json.dumps(to_json_dict(sweep, axis, result), allow_nan=False).encode()
        except ValueError as exc:
            body = json.dumps({"error": str(exc)}).encode()
        with self._lock:
            self._backtests[sweep] = (stamp, body)
        return body

    def published(self, sweep: str) -> _Published:
        with self._lock:
            return self._published[sweep]

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="sweep-serve-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.refresh()


class TokenCheck(BaseHTTPMiddleware):
    def __init__(self, app: Any, token: str | None):
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if self.token is None:
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return PlainTextResponse("403: a valid token is required (it was printed when `sweep serve` started)\n", 403)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        return response


def _page(name: str) -> str:
    return resources.files("analysis.serve").joinpath("static", name).read_text()


def create_app(live: Live, token: str | None = None) -> Starlette:
    js = plotly_js()

    def sweep_of(request: Request) -> str:
        name = request.path_params.get("sweep") or live.sweeps[0]
        if name not in live.sweeps:
            raise NotFoundError(f"no sweep {name!r} is served here; served: {', '.join(live.sweeps)}")
        return name

    async def index(request: Request) -> Response:
        if len(live.sweeps) > 1 and "sweep" not in request.path_params:
            items = "".join(f'<li><a href="/sweep/{s}">{s}</a></li>' for s in live.sweeps)
            return HTMLResponse(f"<!doctype html><title>sweeps</title><h1>Sweeps</h1><ul id='sweeps'>{items}</ul>")
        sweep_of(request)
        return HTMLResponse(_page("sweep.html"))

    async def version(request: Request) -> Response:
        current = live.published(sweep_of(request))
        return JSONResponse({"version": current.version, "error": current.error})

    async def data(request: Request) -> Response:
        current = live.published(sweep_of(request))
        return Response(current.body, media_type="application/json", headers={"X-Version": str(current.version)})

    async def backtest(request: Request) -> Response:
        body = await run_in_threadpool(live.backtest, sweep_of(request))
        return Response(body, media_type="application/json")

    async def run_page(request: Request) -> Response:
        return HTMLResponse(_page("run.html"))

    async def run_data(request: Request) -> Response:
        run_id = request.path_params["run"]
        try:
            found = live.store.get_run(run_id)
        except NotFoundError as exc:
            return JSONResponse({"error": str(exc)}, 404)
        view = SweepView(live.store, found.sweep, live.options)
        body = view.run_page(found.id)
        record = live.store.get_sweep(found.sweep)
        block = ((record.spec if record else {}).get("grid") or {}).get("tracking") or {}
        body["links"] = tracker_links(block, found.sweep, found.id, found.run_dir) if block else []
        return Response(json.dumps(body, default=str).encode(), media_type="application/json")

    async def plotly(request: Request) -> Response:
        return FileResponse(js, media_type="application/javascript", headers={"Cache-Control": "max-age=86400"})

    async def script(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ("sweep.js", "run.js"):
            return PlainTextResponse("404\n", 404)
        return Response(_page(name), media_type="application/javascript")

    async def missing(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(f"404: {exc}\n", 404)

    routes = [
        Route("/", index),
        Route("/sweep/{sweep}", index),
        Route("/api/sweeps", lambda r: JSONResponse(live.sweeps)),
        Route("/api/version", version),
        Route("/api/version/{sweep}", version),
        Route("/api/sweep", data),
        Route("/api/sweep/{sweep}", data),
        Route("/api/backtest", backtest),
        Route("/api/backtest/{sweep}", backtest),
        Route("/run/{run}", run_page),
        Route("/api/run/{run}", run_data),
        Route("/static/plotly.min.js", plotly),
        Route("/static/{name}", script),
    ]
    return Starlette(
        routes=routes, middleware=[Middleware(TokenCheck, token=token)], exception_handlers={NotFoundError: missing}
    )


def serve(
    store: Store,
    sweeps: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8050,
    options: ServeOptions = ServeOptions(),
    token: str | None = None,
    announce: Any = print,
) -> None:
    """Serve until interrupted. Off the loopback address a token is required: `token`, or a new one."""
    import uvicorn

    if not is_loopback(host) and not token:
        token = secrets.token_urlsafe(24)
    live = Live(store, sweeps, options)
    started = time.monotonic()
    live.start()
    shown = "localhost" if is_loopback(host) else host
    query = f"/?token={token}" if token else "/"
    announce(f"serving {', '.join(sweeps)} at http://{shown}:{port}{query} (ready in {time.monotonic() - started:.1f} s; Ctrl-C stops)")
    try:
        uvicorn.run(create_app(live, token), host=host, port=port, log_level="warning")
    finally:
        live.stop()
