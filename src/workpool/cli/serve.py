"""`workpool dashboard` and the worker's `--metrics-port`: the two HTTP servers of the CLI."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import click

from workpool.app import App
from workpool.cli.loading import CliError, opened_app

APP_HELP = "APP is 'module:attribute' naming a workpool.App, imported from the current directory."
TOKEN_ENV = "WORKPOOL_DASHBOARD_TOKEN"


@click.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Off loopback, reading needs the token too.",
)
@click.option(
    "--port",
    type=click.IntRange(min=0, max=65535),
    default=8765,
    show_default=True,
    help="Port to listen on (0: any free port).",
)
@click.option(
    "--token",
    metavar="TOKEN",
    default=None,
    help=f"Access token for changes (default: ${TOKEN_ENV}, else a random one).",
)
def dashboard(app_spec: str, host: str, port: int, token: str | None) -> None:
    """Serve a web dashboard of APP's pools, with pause/resume/limit/cancel controls.

    Prints the address to open and the access token that every change needs.
    Runs until Ctrl-C.
    """
    from workpool.dashboard import create_app
    from workpool.dashboard.operator import redact
    from workpool.dashboard.serve import bind, is_loopback, serve, url_of

    token = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    with opened_app(app_spec) as app:
        app.pools()  # the store answers (and is migrated) before we print an address
        try:
            sock = bind(host, port)
        except OSError as exc:
            raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        local = is_loopback(host)
        url = url_of(sock)

        def announce() -> None:
            click.echo(f"workpool dashboard of {redact(app.url)}")
            click.echo(f"  open   {url}/#token={token}")
            click.echo(f"  token  {token}")
            if local:
                click.echo("  reads are open on this loopback address; changes need the token")
            else:
                click.echo(
                    "  listening beyond loopback: every read and change needs the token;"
                    " put TLS in front (plain HTTP shows the token to the network)"
                )
            click.echo(f"  metrics {url}/metrics   (Ctrl-C to stop)")

        serve(create_app(app, token, open_reads=local), sock, announce=announce)


def start_metrics(app: App, host: str, port: int) -> Callable[[], None]:
    """Serve ``app``'s Prometheus metrics on ``host:port`` in a thread; returns the stopper."""
    from prometheus_client import start_http_server

    from workpool.observability.metrics import registry_for

    try:
        server, thread = start_http_server(port, addr=host, registry=registry_for(app))
    except OSError as exc:
        raise CliError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    click.echo(f"workpool: metrics at http://{host}:{port}/metrics", err=True)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5.0)

    return stop
