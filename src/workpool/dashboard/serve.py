"""Serve the dashboard with uvicorn on a socket bound before start-up (errors come early)."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette

from workpool.dashboard.server import is_loopback

__all__ = ["bind", "is_loopback", "serve", "url_of"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port); OSError if taken."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    app: Starlette,
    sock: socket.socket,
    *,
    announce: Callable[[], None] | None = None,
    log_level: str = "warning",
) -> None:
    """Run until SIGINT/SIGTERM; then stop gracefully and return (no exception, no signal).

    ``announce`` runs once the signals are handled, so a signal sent as soon as
    the address is printed still stops the server gracefully.
    """
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on")
    )

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True

    # uvicorn installs its own handlers while it runs and re-raises the signal that
    # stopped it when done: these handlers catch it before and after, so Ctrl-C or
    # SIGTERM ends the command normally instead of with a traceback or a signal.
    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if announce is not None:
            announce()
        server.run(sockets=[sock])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        sock.close()
