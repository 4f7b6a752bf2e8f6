"""Commands that look at one item or steer a pool: inspect, pause, resume, set, cancel.

Each prints a short human answer, or with ``--json`` one JSON document for
scripts. Pools are named as stored (``workpool status`` lists them); an unknown
pool or work id is a one-line error with exit status 1.
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from workpool.cli.loading import opened_app
from workpool.dashboard import operator
from workpool.pool import Pool

APP_HELP = "APP is 'module:attribute' naming a workpool.App, imported from the current directory."
CANCEL_CHUNK = 500  # items per cancel_all call: progress updates about every half second

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document instead of text."
)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.argument("work_id")
@json_option
def inspect(app_spec: str, work_id: str, as_json: bool) -> None:
    """Everything about one work item, and why it is (not) running."""
    from workpool.cli.inspect_view import detail_table

    with opened_app(app_spec) as app:
        detail = operator.work_detail(app, work_id)
        now = app.clock()
    if as_json:
        _echo_json(detail.to_dict())
        return
    Console().print(detail_table(detail, now))


def _config_dict(pool: Pool, before: int | None = None) -> dict[str, Any]:
    s = pool.stats()
    data: dict[str, Any] = {"pool": s.pool, "max_parallelism": s.max_parallelism}
    data["paused"] = s.paused
    if before is not None:
        data["previous_max_parallelism"] = before
    return data


@click.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.argument("pool_name", metavar="POOL")
@json_option
def pause(app_spec: str, pool_name: str, as_json: bool) -> None:
    """Stop starting POOL's work, in every worker (running work finishes)."""
    with opened_app(app_spec) as app:
        pool = operator.pool(app, pool_name)
        before = pool.stats().max_parallelism
        pool.pause()
        data = _config_dict(pool, before)
    if as_json:
        _echo_json(data)
    elif before == 0:
        click.echo(f"pool {pool_name!r} was already paused")
    else:
        click.echo(
            f"pool {pool_name!r} paused (max_parallelism was {before}; `workpool resume`"
            " restores it). Running work finishes; nothing new starts."
        )


@click.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.argument("pool_name", metavar="POOL")
@json_option
def resume(app_spec: str, pool_name: str, as_json: bool) -> None:
    """Start POOL's work again, with the limit it had before it was paused."""
    with opened_app(app_spec) as app:
        pool = operator.pool(app, pool_name)
        before = pool.stats().max_parallelism
        pool.resume()
        data = _config_dict(pool, before)
    if as_json:
        _echo_json(data)
    elif before > 0:
        click.echo(f"pool {pool_name!r} was not paused (max_parallelism {before})")
    else:
        click.echo(f"pool {pool_name!r} resumed: max_parallelism {data['max_parallelism']}")


@click.command("set", epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.argument("pool_name", metavar="POOL")
@click.option(
    "--max-parallelism",
    type=click.IntRange(min=0),
    metavar="N",
    default=None,
    help="Attempts of POOL running at once, across all workers (0 pauses).",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "TRACE", "INFO", "REPORT", "WARN", "ERROR"], case_sensitive=False),
    default=None,
    help="Which of POOL's events workers log (INFO and below: every start and completion).",
)
@json_option
def set_(
    app_spec: str,
    pool_name: str,
    max_parallelism: int | None,
    log_level: str | None,
    as_json: bool,
) -> None:
    """Change POOL's stored config at run time; every worker follows at once."""
    options: dict[str, Any] = {}
    if max_parallelism is not None:
        options["max_parallelism"] = max_parallelism
    if log_level is not None:
        options["log_level"] = log_level
    if not options:
        raise click.UsageError("nothing to set: give --max-parallelism N and/or --log-level L")
    with opened_app(app_spec) as app:
        pool = operator.pool(app, pool_name)
        before = pool.stats().max_parallelism
        config = pool.configure(**options)
        data = {**_config_dict(pool, before), "log_level": config.log_level}
    if as_json:
        _echo_json(data)
        return
    changes = []
    if max_parallelism is not None:
        changes.append(f"max_parallelism {before} -> {config.max_parallelism}")
    if log_level is not None:
        changes.append(f"log_level {config.log_level}")
    click.echo(f"pool {pool_name!r}: " + ", ".join(changes))


@click.command(epilog=APP_HELP)
@click.argument("app_spec", metavar="APP")
@click.argument("work_ids", metavar="[WORK_ID]...", nargs=-1)
@click.option("--pool", "pool_name", metavar="POOL", help="With --all: the pool to cancel.")
@click.option(
    "--all", "cancel_all", is_flag=True, help="Cancel every pending and running item of --pool."
)
@json_option
def cancel(
    app_spec: str,
    work_ids: tuple[str, ...],
    pool_name: str | None,
    cancel_all: bool,
    as_json: bool,
) -> None:
    """Cancel work: the WORK_IDs given, or every item of a pool (--pool POOL --all).

    Pending work never starts; running work finishes and is not retried. Each
    canceled item's on_complete sees Canceled() (unless its running attempt
    succeeds or fails for good first).
    """
    if work_ids and (pool_name or cancel_all):
        raise click.UsageError("give WORK_IDs or --pool POOL --all, not both")
    if not work_ids and not (pool_name and cancel_all):
        raise click.UsageError(
            "give WORK_IDs to cancel, or --pool POOL --all to cancel a whole pool"
        )
    if work_ids:
        with opened_app(app_spec) as app:
            outcome = operator.cancel_work(app, list(work_ids))
        _print_outcome(outcome, as_json)
        return
    assert pool_name is not None
    with opened_app(app_spec) as app:
        total = _cancel_pool(operator.pool(app, pool_name), as_json)
    if as_json:
        _echo_json({"pool": pool_name, "canceled": total})
    else:
        click.echo(f"canceled {total} work items of pool {pool_name!r}")


def _print_outcome(outcome: dict[str, str], as_json: bool) -> None:
    if as_json:
        _echo_json(outcome)
        return
    canceled = sum(1 for what in outcome.values() if what == "canceled")
    click.echo(f"canceled {canceled} of {len(outcome)} work items")
    for work_id, what in outcome.items():
        if what == "unknown":
            click.echo(f"  {work_id}: unknown or expired")
        elif what != "canceled":
            click.echo(f"  {work_id}: not changed (finished, or its cancel was already requested)")


def _cancel_pool(pool: Pool, quiet: bool) -> int:
    """``cancel_all`` in chunks, with a progress bar on a terminal's stderr."""
    s = pool.stats()
    estimate = s.backlog + s.scheduled + s.running
    cutoff = pool.app.clock()  # work enqueued from now on is left alone
    console = Console(stderr=True)
    quiet = quiet or not console.is_terminal
    columns = (TextColumn("canceling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    total = 0
    with Progress(*columns, console=console, transient=True, disable=quiet) as progress:
        task = progress.add_task("cancel", total=max(estimate, 1))
        while True:
            done = pool.cancel_all(before=cutoff, limit=CANCEL_CHUNK)
            total += done
            progress.update(task, completed=total, total=max(estimate, total, 1))
            if done == 0:
                return total
