"""`workpool demo`: run the demo application (demo_app.py) live, then check its promises.

A worker runs in a background thread (``app.run_worker(concurrency=8,
until_idle=True)``) while this thread redraws the pools' numbers about five
times a second. At the end the demo checks, from its own measurements and
tables, that the limits held, every email got exactly one on_complete, every
delivery led to exactly one report row, and canceled emails never ran.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from rich.console import Console
from rich.live import Live
from rich.table import Table

from workpool.cli import demo_app
from workpool.cli.demo_app import DemoApp
from workpool.cli.demo_view import Check, live_table, summary_table
from workpool.core.results import Canceled, Finished
from workpool.observability.stats import PoolStats

CONCURRENCY = 8  # > 4 + 2: the pools' limits, not the worker, are what holds them back
REFRESH_S = 0.2  # live view redraws ~5 times a second
CANCEL_SHARE = 200  # one email in this many is scheduled for later, then canceled
SCHEDULED_IN_S = 600.0
STATS_WINDOW_S = 3600.0


class _WorkerThread(threading.Thread):
    def __init__(self, demo: DemoApp) -> None:
        super().__init__(name="demo-worker", daemon=True)
        self.demo = demo
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.demo.app.run_worker(concurrency=CONCURRENCY, until_idle=True)
        except BaseException as exc:  # shown by the main thread
            self.error = exc


class _Collect(logging.Handler):
    """Keeps the worker's warnings and errors for after the live view."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _quiet_workpool_logger() -> Iterator[_Collect]:
    """Route the ``workpool`` logger away from the screen while the demo runs.

    With a handler of ours in place the library adds none of its own; the
    logger's previous state is restored afterwards.
    """
    logger = logging.getLogger("workpool")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    collect = _Collect()
    logger.handlers = [collect]
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    try:
        yield collect
    finally:
        logger.handlers, logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])


def run_demo(db_path: str | None, items: int, seconds_limit: float | None) -> bool:
    """Run the demo; True when every check passed."""
    console = Console(highlight=False)
    with ExitStack() as stack:
        warnings = stack.enter_context(_quiet_workpool_logger())
        if db_path is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="workpool-demo-"))
            path = os.path.join(directory, "demo.db")
        else:
            path = os.path.abspath(db_path)
        demo = demo_app.build(f"sqlite:///{path}")
        stack.callback(demo.app.close)
        return _run(console, demo, path, items, seconds_limit, warnings, keep=db_path is not None)
    raise AssertionError("unreachable")  # pragma: no cover (mypy: ExitStack may swallow)


def _run(
    console: Console,
    demo: DemoApp,
    path: str,
    items: int,
    seconds_limit: float | None,
    warnings: _Collect,
    *,
    keep: bool,
) -> bool:
    demo_app.create_tables(demo)
    later = min(max(3, items // CANCEL_SHARE), items // 2)
    now_ids = demo_app.enqueue_emails(demo, items - later)
    later_ids = demo_app.enqueue_emails(demo, later, run_after=SCHEDULED_IN_S, first=items - later)
    _intro(console, path, len(now_ids), len(later_ids))

    started = time.monotonic()
    worker = _WorkerThread(demo)
    worker.start()
    # Cancel wins over start: these were pending (scheduled) and will never run.
    canceled = sum(demo.emails.cancel(wid) for wid in later_ids)
    stopped_early = False
    try:
        with Live(_live(demo, started), console=console, refresh_per_second=5) as live:
            while worker.is_alive():
                worker.join(REFRESH_S)
                elapsed = time.monotonic() - started
                if seconds_limit is not None and elapsed > seconds_limit and not stopped_early:
                    stopped_early = True
                    demo.app.stop_workers()
                live.update(_live(demo, started))
    except KeyboardInterrupt:
        console.print("interrupted: letting running work finish…")
        demo.app.stop_workers()
        worker.join()
        raise
    wall = time.monotonic() - started

    stats = _stats(demo)
    console.print()
    console.print(summary_table(stats, demo.gauges))
    console.print(f"total wall time: {wall:.2f} s  [dim](1 worker, concurrency {CONCURRENCY})[/]")
    if worker.error is not None:
        console.print(f"[bold red]worker failed:[/] {type(worker.error).__name__}: {worker.error}")
        return False
    complete = not stopped_early
    if stopped_early:
        left = sum(s.backlog + s.scheduled + s.running + s.completing for s in stats)
        console.print(f"stopped at the {seconds_limit:g} s limit: {left} items left unfinished")
    checks = _checks(demo, stats, now_ids + later_ids, later_ids, canceled, complete)
    for check in checks:
        console.print(check.line())
    for record in warnings.records[:5]:
        console.print(f"[yellow]worker {record.levelname.lower()}:[/] {record.getMessage()}")
    if keep:
        console.print(
            f"\nthe database stays in {path}; look inside with e.g.\n"
            f"  sqlite3 {path} 'SELECT * FROM demo_domain_totals'"
        )
    return all(c.passed for c in checks)


def _intro(console: Console, path: str, now: int, later: int) -> None:
    r = demo_app.EMAIL_RETRY
    console.print(f"[bold]workpool demo[/] on SQLite [dim]{path}[/]")
    console.print(
        f"[bold]emails[/]   max_parallelism {demo_app.EMAIL_LIMIT}, send_email "
        f"actions: ~{demo_app.TRANSIENT_RATE:.0%} of attempts fail,\n"
        f"         retried up to {r.max_attempts} attempts with backoff "
        f"({r.initial_backoff:g} s x {r.base:g}^n + jitter);\n"
        f"         ~{demo_app.BOUNCE_RATE:.0%} bounce for good (NonRetryableError)"
    )
    console.print(
        f"[bold]reports[/]  max_parallelism {demo_app.REPORT_LIMIT}, log_delivery "
        "mutations writing rows,\n"
        "         enqueued by each delivered email's on_complete (SQLite runs one\n"
        "         write transaction at a time, so these mutations do too)"
    )
    console.print(
        f"enqueued {now} emails to send now, and {later} for later that are "
        "canceled while pending\n"
    )


def _stats(demo: DemoApp) -> list[PoolStats]:
    return [pool.stats(window=STATS_WINDOW_S) for pool in demo.pools]


def _live(demo: DemoApp, started: float) -> Table:
    return live_table(_stats(demo), demo.gauges, time.monotonic() - started)


def _checks(
    demo: DemoApp,
    stats: list[PoolStats],
    email_ids: list[str],
    canceled_ids: list[str],
    canceled: int,
    complete: bool,
) -> list[Check]:
    """The demo's promises, checked against its own measurements and tables."""
    by_pool = {s.pool: s for s in stats}
    emails, reports = by_pool["emails"], by_pool["reports"]
    peaks = ", ".join(f"{s.pool} {demo.gauges[s.pool].peak} of {s.max_parallelism}" for s in stats)
    checks = [
        Check(
            "limit respected",
            all(demo.gauges[s.pool].peak <= s.max_parallelism for s in stats),
            f"most running at once: {peaks}",
        )
    ]

    with demo.app.transaction() as tx:
        rows, distinct, delivered = tx.execute(
            "SELECT count(*), count(DISTINCT work_id),"
            " coalesce(sum(outcome = 'success'), 0) FROM demo_email_results"
        ).fetchone()
        logged = tx.execute("SELECT count(*) FROM demo_delivery_log").fetchone()[0]
    # Stopped early, only the finished emails must have their result row.
    expected = len(email_ids) if complete else emails.finished
    checks.append(
        Check(
            "on_complete exactly once",
            rows == distinct == emails.finished == expected,
            f"{rows} rows, {distinct} distinct, {emails.finished} emails finished",
        )
    )
    checks.append(
        Check(
            "one report per delivery",
            logged == reports.succeeded and (not complete or logged == delivered),
            f"{delivered} delivered, {logged} report rows",
        )
    )
    statuses = demo.emails.status_batch(canceled_ids)
    ran = len(set(canceled_ids) & demo.gauges["emails"].work_ids)
    saw_canceled = not complete or all(
        isinstance(s, Finished) and isinstance(s.result, Canceled) for s in statuses
    )
    checks.append(
        Check(
            "cancel",
            canceled == len(canceled_ids) and ran == 0 and saw_canceled,
            f"{canceled} pending emails canceled, none ran, status Canceled()"
            if ran == 0 and saw_canceled
            else f"{canceled}/{len(canceled_ids)} canceled, {ran} ran, status: {statuses}",
        )
    )
    return checks
