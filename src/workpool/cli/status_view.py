"""The table `workpool status` prints: one row per pool."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from rich import box
from rich.table import Table

from workpool.observability.stats import PoolStats


def redact(url: str) -> str:
    """The URL without its password, for printing."""
    password = urlsplit(url).password
    return url.replace(f":{password}@", ":***@") if password else url


def limit_text(stats: PoolStats) -> str:
    return "paused" if stats.paused else str(stats.max_parallelism)


def failure_text(stats: PoolStats) -> str:
    """``12.5% of 80``: failed attempts (retried or not) over completed ones in the window."""
    if stats.completed == 0:
        return "-"
    return f"{stats.failure_rate:.1%} of {stats.completed}"


def status_table(stats: Sequence[PoolStats], title: str | None = None) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    table.add_column("pool", style="bold", no_wrap=True)
    table.add_column("limit", justify="right")
    table.add_column("running", justify="right")
    table.add_column("due\nbacklog", justify="right")
    table.add_column("scheduled\nlater", justify="right")
    table.add_column("finished", justify="right")
    table.add_column("failure rate\n(last hour)", justify="right", no_wrap=True)
    for s in stats:
        table.add_row(
            s.pool,
            limit_text(s),
            str(s.running + s.completing),
            str(s.backlog),
            str(s.scheduled),
            str(s.finished),
            failure_text(s),
        )
    return table
