"""The dashboard's Starlette app: one HTML page, its assets, a JSON API and /metrics.

Access rules (docs/operations.md):

* every request that changes something (POST) needs ``Authorization: Bearer
  <token>``, compared in constant time; without it: 401 JSON;
* reads of data (GET /api/...) are open only when the server is bound to a
  loopback address (``open_reads``) **and** the request's Host header names a
  loopback address too, so a web page that rebinds its own DNS name to
  127.0.0.1 still cannot read; otherwise they need the token as well;
* the page, its assets and ``/metrics`` (counts only, no args or errors) are open.

The library is synchronous: handlers run its calls on Starlette's thread pool.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from workpool.app import App
from workpool.core.errors import WorkpoolError
from workpool.dashboard import operator
from workpool.dashboard.operator import UnknownPoolError, UnknownWorkError
from workpool.dashboard.sampler import INTERVAL_S, Sampler
from workpool.observability.metrics import registry_for
from workpool.observability.stats import PoolStats

STATIC = str(Path(__file__).with_name("static"))  # shipped in the wheel: no CDN
STATS_WINDOW_S = 3600.0  # failure rate and start lag on the pool table: the last hour
CHART_MINUTES = 30  # default span of the charts
FAILURES_SHOWN = 20
SECURITY_HEADERS = {
    # Everything the page needs ships with it: no CDN, no inline script.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:;"
    " frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

Handler = Callable[[Request], Awaitable[Response]]


def create_app(
    workpool_app: App,
    token: str,
    *,
    open_reads: bool = True,
    sample_interval: float = INTERVAL_S,
) -> Starlette:
    """The dashboard of ``workpool_app``; ``token`` guards every change (and remote reads)."""
    if not isinstance(token, str) or not token:
        raise ValueError("the dashboard needs a non-empty access token")
    expected = token.encode()
    sampler = Sampler(lambda: operator.stats(workpool_app, 60.0), interval=sample_interval)
    registry = registry_for(workpool_app)

    def token_given(request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(given.encode(), expected)

    def reads_open(request: Request) -> bool:
        return open_reads and _is_loopback(request.headers.get("host", ""))

    def guard(handler: Handler, *, write: bool) -> Handler:
        async def guarded(request: Request) -> Response:
            if not token_given(request) and (write or not reads_open(request)):
                return _error(401, "missing or wrong access token (Authorization: Bearer …)")
            return await handler(request)

        return guarded

    def blocking(fn: Callable[[Request], Any], *, write: bool = False) -> Handler:
        """A JSON endpoint whose body calls the (synchronous) library on the thread pool."""

        async def handler(request: Request) -> Response:
            if write:
                request.state.body = await _json_body(request)
            return JSONResponse(await run_in_threadpool(fn, request))

        return guard(handler, write=write)

    # --- reads ---------------------------------------------------------------------------
    def pools(request: Request) -> dict[str, Any]:
        stats = operator.stats(workpool_app, STATS_WINDOW_S)
        return {
            "store": operator.redact(workpool_app.url),
            "now": workpool_app.clock(),
            "window": STATS_WINDOW_S,
            "pools": [_pool_dict(s) for s in stats],
        }

    def pool_detail(request: Request) -> dict[str, Any]:
        pool = operator.pool(workpool_app, request.path_params["pool"])
        minutes = _int_param(request, "minutes", CHART_MINUTES, 1, 1440)
        now = workpool_app.clock()
        return {
            "pool": _pool_dict(pool.stats(window=STATS_WINDOW_S)),
            "now": now,
            "history": [_minute_dict(t, s) for t, s in pool.history(minutes)],
            "samples": [
                {"t": s.t, "running": s.running, "backlog": s.backlog, "scheduled": s.scheduled}
                for s in sampler.series(pool.name, since=now - minutes * 60)
            ],
            "failures": [i.to_dict() for i in pool.recent_failures(FAILURES_SHOWN)],
        }

    def work(request: Request) -> dict[str, Any]:
        return operator.work_detail(workpool_app, request.path_params["work_id"]).to_dict()

    async def auth(request: Request) -> Response:
        return JSONResponse(
            {
                "token": "valid" if token_given(request) else "missing or wrong",
                "reads_open": reads_open(request),
            }
        )

    # --- changes -------------------------------------------------------------------------
    def pause(request: Request) -> dict[str, Any]:
        pool = operator.pool(workpool_app, request.path_params["pool"])
        pool.pause()
        return {"pool": _pool_dict(pool.stats(window=STATS_WINDOW_S))}

    def resume(request: Request) -> dict[str, Any]:
        pool = operator.pool(workpool_app, request.path_params["pool"])
        pool.resume()
        return {"pool": _pool_dict(pool.stats(window=STATS_WINDOW_S))}

    def configure(request: Request) -> dict[str, Any]:
        pool = operator.pool(workpool_app, request.path_params["pool"])
        body = request.state.body
        if set(body) != {"max_parallelism"}:
            raise _BadRequest('send {"max_parallelism": N}')
        pool.configure(max_parallelism=body["max_parallelism"])
        return {"pool": _pool_dict(pool.stats(window=STATS_WINDOW_S))}

    def cancel_all(request: Request) -> dict[str, Any]:
        pool = operator.pool(workpool_app, request.path_params["pool"])
        return {"canceled": pool.cancel_all()}

    def cancel_work(request: Request) -> dict[str, Any]:
        work_id = request.path_params["work_id"]
        operator.work_detail(workpool_app, work_id)  # 404 when unknown
        outcome = operator.cancel_work(workpool_app, [work_id])[work_id]
        return {
            "canceled": outcome == "canceled",
            "detail": operator.work_detail(workpool_app, work_id).to_dict(),
        }

    async def metrics(request: Request) -> Response:
        body = await run_in_threadpool(generate_latest, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def index(request: Request) -> Response:
        return FileResponse(f"{STATIC}/index.html", media_type="text/html")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sampler.start()
        try:
            yield
        finally:
            await run_in_threadpool(sampler.stop)

    routes = [
        Route("/", index),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/metrics", metrics),
        Route("/api/auth", auth),
        Route("/api/pools", blocking(pools)),
        Route("/api/pools/{pool}", blocking(pool_detail)),
        Route("/api/pools/{pool}/pause", blocking(pause, write=True), methods=["POST"]),
        Route("/api/pools/{pool}/resume", blocking(resume, write=True), methods=["POST"]),
        Route("/api/pools/{pool}/configure", blocking(configure, write=True), methods=["POST"]),
        Route("/api/pools/{pool}/cancel-all", blocking(cancel_all, write=True), methods=["POST"]),
        Route("/api/work/{work_id}", blocking(work)),
        Route("/api/work/{work_id}/cancel", blocking(cancel_work, write=True), methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(_SecurityHeaders)],
        exception_handlers={
            WorkpoolError: _library_error,
            _BadRequest: _library_error,
        },
        lifespan=lifespan,
    )
    app.state.sampler = sampler
    return app


class _BadRequest(Exception):
    """The request body is not what the endpoint takes."""


class _SecurityHeaders(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


async def _library_error(request: Request, exc: Exception) -> Response:
    status = 404 if isinstance(exc, UnknownPoolError | UnknownWorkError) else 400
    return _error(status, " ".join(str(exc).split()) or type(exc).__name__)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise _BadRequest("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    return body


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise _BadRequest(f"{name} must be an integer") from None
    if not low <= value <= high:
        raise _BadRequest(f"{name} must be in {low}..{high}")
    return value


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``localhost``: addresses other machines cannot reach."""
    host = host.strip().lower().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_loopback(host_header: str) -> bool:
    """Whether a Host header (``name[:port]``, ``[v6]:port``) names a loopback address."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return is_loopback(host)


def _pool_dict(s: PoolStats) -> dict[str, Any]:
    return {**s.to_dict(), "note": operator.pool_note(s)}


def _minute_dict(t: float, s: PoolStats) -> dict[str, Any]:
    return {
        "t": t,
        "completed": s.completed,
        "succeeded": s.succeeded,
        "failed": s.failed,
        "retries": s.retries,
        "canceled": s.canceled,
        "lag_p50": s.start_lag_p50,
        "lag_p95": s.start_lag_p95,
        "lag_p99": s.start_lag_p99,
    }
