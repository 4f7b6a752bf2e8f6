"""What `workpool status` prints: the numbers of each pool, then why its backlog waits."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table

from workpool.dashboard.operator import duration, pool_note
from workpool.observability.stats import PoolStats


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


def lag_text(seconds: float) -> str:
    return duration(seconds) if seconds else "-"


def health_table(stats: Sequence[PoolStats]) -> Table:
    """Start lag percentiles (upper bounds of histogram buckets) and the pool's state in words."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    table.add_column("pool", style="bold", no_wrap=True)
    table.add_column("start lag p50", justify="right", no_wrap=True)
    table.add_column("p95", justify="right", no_wrap=True)
    table.add_column("p99", justify="right", no_wrap=True)
    table.add_column("why the backlog waits")
    for s in stats:
        note = pool_note(s)
        style = "yellow" if s.paused or note.startswith("due work") else ""
        table.add_row(
            s.pool,
            lag_text(s.start_lag_p50),
            lag_text(s.start_lag_p95),
            lag_text(s.start_lag_p99),
            f"[{style}]{note}[/]" if style else note,
        )
    return table
