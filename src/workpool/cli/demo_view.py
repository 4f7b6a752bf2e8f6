"""What the demo shows: the live table while workers run, then the summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich import box
from rich.progress_bar import ProgressBar
from rich.table import Table

from workpool.cli.demo_app import Gauge
from workpool.observability.stats import PoolStats

BAR_WIDTH = 10  # the live table fits 80 columns (CI logs, pipes)


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        verdict = "[green]yes[/]" if self.passed else "[bold red]NO[/]"
        return f"{self.name}: {verdict}  [dim]{self.detail}[/]"


def enqueued(stats: PoolStats) -> int:
    """Work of the pool that exists now: finished, running or waiting."""
    return stats.finished + stats.running + stats.completing + stats.backlog + stats.scheduled


def live_table(stats: Sequence[PoolStats], gauges: Mapping[str, Gauge], elapsed: float) -> Table:
    table = Table(
        title=f"running for {elapsed:4.1f} s",
        title_justify="left",
        caption="running: now / limit;  backoff: failed attempts waiting to retry",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    table.add_column("pool", style="bold")
    table.add_column("progress", width=BAR_WIDTH)
    table.add_column("done", justify="right")
    table.add_column("running", justify="right")
    table.add_column("backlog", justify="right")
    table.add_column("backoff", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("canceled", justify="right")
    for s in stats:
        total = max(enqueued(s), 1)
        limit = "paused" if s.paused else str(s.max_parallelism)
        table.add_row(
            s.pool,
            ProgressBar(total=total, completed=s.finished, width=BAR_WIDTH),
            f"{s.finished}/{enqueued(s)}",
            f"{gauges[s.pool].active}/{limit}",
            str(s.backlog),
            str(s.scheduled),
            str(s.failed),
            str(s.canceled),
        )
    return table


def summary_table(stats: Sequence[PoolStats], gauges: Mapping[str, Gauge]) -> Table:
    table = Table(
        title="summary",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    table.add_column("pool", style="bold")
    table.add_column("limit", justify="right")
    table.add_column("succeeded", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("retried", justify="right")
    table.add_column("canceled", justify="right")
    table.add_column("max running", justify="right")
    table.add_column("items/s", justify="right")
    for s in stats:
        gauge = gauges[s.pool]
        busy = gauge.busy_seconds()
        ran = s.succeeded + s.failed
        peak_style = "green" if gauge.peak <= s.max_parallelism else "bold red"
        table.add_row(
            s.pool,
            str(s.max_parallelism),
            str(s.succeeded),
            str(s.failed),
            str(s.retries),
            str(s.canceled),
            f"[{peak_style}]{gauge.peak}[/]",
            f"{ran / busy:,.0f}" if busy > 0 else "-",
        )
    return table
