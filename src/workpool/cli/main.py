"""The ``workpool`` command: ``worker``, ``status``, ``demo``, plus the operator commands
(``inspect``, ``pause``, ``resume``, ``set``, ``cancel`` in ops.py; ``dashboard`` in serve.py).

Errors users can fix are one line on stderr, never a traceback: a bad APP exits
with 2 (like click's own usage errors), a WorkpoolError from the library with 1.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click

from workpool import __version__
from workpool.cli import ops, serve, supervisor
from workpool.cli.loading import CliError, load_app, opened_app
from workpool.core.errors import WorkpoolError

STATUS_WINDOW_S = 3600.0  # `status` shows completions over the last hour

APP_HELP = "APP is 'module:attribute' naming a workpool.App, imported from the current directory."


class _Group(click.Group):
    """Turns library errors raised by any command into one-line messages (exit 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except WorkpoolError as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise CliError(message) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="workpool")
def main() -> None:
    """workpool: a durable work pool on SQLite or PostgreSQL.

    The database URL comes from the App (default: $WORKPOOL_DATABASE_URL, else
    sqlite:///workpool.db). Try `workpool demo` to see it run.
    """


@main.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.option(
    "--pool",
    "pools",
    multiple=True,
    metavar="NAME",
    help="Serve only this pool (repeat for several). Default: every pool.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    metavar="N",
    default=None,
    help="Attempts run at once by each worker process (default 10).",
)
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    metavar="N",
    default=1,
    show_default=True,
    help="Worker processes to run, each restarted if it crashes. Sync actions that"
    " use the CPU need one per core.",
)
@click.option(
    "--until-idle", is_flag=True, help="Exit once the served pools hold no pending or running work."
)
@click.option(
    "--lease",
    type=click.FloatRange(min=0.1),
    metavar="SECONDS",
    default=15.0,
    show_default=True,
    help="Seconds without a heartbeat after which this worker counts as lost.",
)
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(min=0.0),
    metavar="SECONDS",
    default=30.0,
    show_default=True,
    help="Seconds running work may take to finish after SIGTERM/SIGINT.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    metavar="PORT",
    default=None,
    help="Serve Prometheus metrics of every pool at http://HOST:PORT/metrics.",
)
@click.option(
    "--metrics-host",
    metavar="HOST",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics server listens on (0.0.0.0: every interface).",
)
@click.option("--supervised-by", type=int, default=None, hidden=True)
def worker(
    app_spec: str,
    pools: tuple[str, ...],
    concurrency: int | None,
    processes: int,
    until_idle: bool,
    lease: float,
    shutdown_grace: float,
    metrics_port: int | None,
    metrics_host: str,
    supervised_by: int | None,
) -> None:
    """Run APP's work until SIGTERM/SIGINT (or, with --until-idle, until idle).

    Start as many workers as you like, on one machine or many: the pools'
    parallelism limits hold across all of them. --processes N runs N here.
    """
    app = load_app(app_spec)
    if supervised_by is not None and not supervisor.watch_supervisor(
        supervised_by, app.stop_workers
    ):
        return
    stop_metrics = None
    try:
        if metrics_port is not None:
            stop_metrics = serve.start_metrics(app, metrics_host, metrics_port)
        if processes > 1:
            options = [f"--pool={pool}" for pool in pools]
            if concurrency is not None:
                options.append(f"--concurrency={concurrency}")
            if until_idle:
                options.append("--until-idle")
            options += [f"--lease={lease!r}", f"--shutdown-grace={shutdown_grace!r}"]
            argv = supervisor.child_argv(app_spec, options)
            status = supervisor.Supervisor(argv, processes).run()
            if status:
                raise click.exceptions.Exit(status)
            return
        app.run_worker(
            pools=list(pools) or None,
            concurrency=concurrency,
            until_idle=until_idle,
            lease=lease,
            shutdown_grace=shutdown_grace,
        )
    finally:
        if stop_metrics is not None:
            stop_metrics()
        app.close()


@main.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the numbers of every pool as a JSON list (with --watch: one line per refresh).",
)
@click.option("--watch", is_flag=True, help="Keep the table on screen, refreshed, until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    metavar="SECONDS",
    default=1.0,
    show_default=True,
    help="With --watch: seconds between refreshes.",
)
def status(app_spec: str, as_json: bool, watch: bool, interval: float) -> None:
    """Show APP's pools: limit, running, backlog, failure rate, start lag, and why work waits."""
    with opened_app(app_spec) as app:
        if not watch:
            _print_status(app, as_json)
            return
        try:
            if as_json:
                while True:
                    stats = _stats(app)
                    click.echo(json.dumps({"time": app.clock(), "pools": stats}))
                    time.sleep(interval)
            _watch(app, interval)
        except KeyboardInterrupt:
            return


def _stats(app: Any) -> list[dict[str, Any]]:
    from workpool.dashboard import operator

    return [s.to_dict() for s in operator.stats(app, STATUS_WINDOW_S)]


def _print_status(app: Any, as_json: bool) -> None:
    from rich.console import Console

    from workpool.cli.status_view import health_table, status_table
    from workpool.dashboard import operator

    stats = operator.stats(app, STATUS_WINDOW_S)
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in stats], indent=2))
        return
    console = Console()
    if not stats:
        console.print(f"no pools yet in {operator.redact(app.url)}")
        return
    console.print(status_table(stats, title=operator.redact(app.url)))
    console.print()
    console.print(health_table(stats))


def _watch(app: Any, interval: float) -> None:
    """A live table until Ctrl-C; on a pipe rich prints only the last one."""
    from datetime import datetime

    from rich.console import Console, Group
    from rich.live import Live

    from workpool.cli.status_view import health_table, status_table
    from workpool.dashboard import operator

    def render() -> Group:
        stats = operator.stats(app, STATUS_WINDOW_S)
        title = f"{operator.redact(app.url)}  {datetime.now():%H:%M:%S}  (Ctrl-C to stop)"
        if not stats:
            return Group(f"no pools yet  {title}")
        return Group(status_table(stats, title=title), "", health_table(stats))

    with Live(render(), console=Console(), auto_refresh=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(), refresh=True)


def _fresh_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and os.path.exists(value):
        raise click.BadParameter(
            f"{value!r} exists; the demo needs a new file (it will not touch an existing database)",
            ctx,
            param,
        )
    return value


@main.command()
@click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False),
    default=None,
    callback=_fresh_file,
    help="SQLite file to create (must not exist). Default: a temporary file.",
)
@click.option(
    "--items",
    type=click.IntRange(min=1, max=1_000_000),
    metavar="N",
    default=2000,
    show_default=True,
    help="How many emails to send.",
)
@click.option(
    "--seconds-limit",
    type=click.FloatRange(min=0.1),
    metavar="SECONDS",
    default=None,
    help="Stop the workers after this many seconds even if work is left.",
)
def demo(db_path: str | None, items: int, seconds_limit: float | None) -> None:
    """Send flaky emails through two limited pools and watch it live.

    Shows the global parallelism limits, retries with backoff, cancelation and
    exactly-once on_complete handlers, then checks them. Takes a few seconds.
    """
    from workpool.cli.demo import run_demo

    ok = run_demo(db_path=db_path, items=items, seconds_limit=seconds_limit)
    if not ok:
        raise click.exceptions.Exit(1)


for command in (ops.inspect, ops.pause, ops.resume, ops.set_, ops.cancel, serve.dashboard):
    main.add_command(command)
