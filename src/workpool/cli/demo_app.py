"""The demo's application: flaky emails and the report rows they lead to.

Written the way a user would write it, with the public API only. Each run
builds its own App (the database is a fresh file), so the functions are
registered inside ``build``.

    emails   max_parallelism=4   send_email: an action; a few ms of "SMTP", ~25% of
                                 attempts raise a transient error (retried with
                                 backoff), ~2% of recipients bounce for good
                                 (NonRetryableError)
    reports  max_parallelism=2   log_delivery: a mutation writing rows in the
                                 store's own transaction

The emails are enqueued in the demo's own transaction together with their
outbox rows. record_email, the on_complete of every email, stores the result
and, for a delivered email, enqueues its report mutation in the same
transaction: the result row and the follow-up work commit together or not at all.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import workpool

EMAIL_LIMIT = 4
REPORT_LIMIT = 2
EMAIL_RETRY = workpool.RetryBehavior(max_attempts=4, initial_backoff=0.05, base=2.0)
TRANSIENT_RATE = 0.25  # share of attempts that hit a "try again later"
BOUNCE_RATE = 0.02  # share of recipients whose mailbox does not exist
DOMAINS = ("example.org", "example.com", "example.net", "mail.test")

SCHEMA = (
    # Written by the demo itself, in the transaction that enqueues the emails.
    "CREATE TABLE IF NOT EXISTS demo_outbox (work_id TEXT PRIMARY KEY, recipient TEXT NOT NULL)",
    # Written by record_email (on_complete): one row per finished email. No primary
    # key on purpose, so the demo can check that no handler ran twice.
    "CREATE TABLE IF NOT EXISTS demo_email_results"
    " (work_id TEXT NOT NULL, recipient TEXT NOT NULL, outcome TEXT NOT NULL, detail TEXT)",
    # Written by log_delivery (a reports mutation): one row per delivered email...
    "CREATE TABLE IF NOT EXISTS demo_delivery_log"
    " (recipient TEXT NOT NULL, message_id TEXT NOT NULL)",
    # ...and a running total per domain.
    "CREATE TABLE IF NOT EXISTS demo_domain_totals"
    " (domain TEXT PRIMARY KEY, delivered INTEGER NOT NULL)",
)


class TransientSmtpError(Exception):
    """421: the server asks to try again later."""


class Gauge:
    """How many calls of one pool run at once, measured by the calls themselves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.runs = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.work_ids: set[str] = set()  # every work item that started at least once

    @contextmanager
    def running(self) -> Iterator[None]:
        work_id = workpool.current().work_id
        with self._lock:
            self.work_ids.add(work_id)
            self.active += 1
            self.runs += 1
            self.peak = max(self.peak, self.active)
            if self.first_start is None:
                self.first_start = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1
                self.last_end = time.monotonic()

    def busy_seconds(self) -> float:
        """From the first start to the last end: the span the pool was working."""
        if self.first_start is None or self.last_end is None:
            return 0.0
        return max(self.last_end - self.first_start, 1e-9)


@dataclass(frozen=True)
class DemoApp:
    app: workpool.App
    emails: workpool.Pool
    reports: workpool.Pool
    gauges: dict[str, Gauge]  # per pool name
    send_email: Callable[..., Any]
    record_email: Callable[..., Any]

    @property
    def pools(self) -> list[workpool.Pool]:
        return [self.emails, self.reports]


def recipient(i: int) -> str:
    return f"user{i:05d}@{DOMAINS[i % len(DOMAINS)]}"


def build(url: str) -> DemoApp:
    app = workpool.App(url)
    emails = app.pool(
        "emails",
        max_parallelism=EMAIL_LIMIT,
        retry_actions_by_default=True,
        default_retry=EMAIL_RETRY,
    )
    reports = app.pool("reports", max_parallelism=REPORT_LIMIT)
    gauges = {"emails": Gauge(), "reports": Gauge()}

    @app.action(name="send_email")
    def send_email(to: str, subject: str) -> dict[str, str]:
        attempt = workpool.current().attempt
        with gauges["emails"].running():
            time.sleep(random.uniform(0.002, 0.008))
            # Seeded by recipient and attempt: every run of the demo tells the same story.
            if random.Random(to).random() < BOUNCE_RATE:
                raise workpool.NonRetryableError(f"550 mailbox unavailable: {to}")
            if random.Random(f"{to}/{attempt}").random() < TRANSIENT_RATE:
                raise TransientSmtpError(f"421 try again later ({to}, attempt {attempt})")
            return {"message_id": f"<{workpool.current().work_id[:8]}.{attempt}@demo>"}

    @app.mutation(name="log_delivery")
    def log_delivery(tx: workpool.Tx, to: str, message_id: str) -> None:
        with gauges["reports"].running():
            tx.execute(
                "INSERT INTO demo_delivery_log (recipient, message_id) VALUES (?, ?)",
                (to, message_id),
            )
            tx.execute(
                "INSERT INTO demo_domain_totals (domain, delivered) VALUES (?, 1)"
                " ON CONFLICT (domain) DO UPDATE SET delivered = delivered + 1",
                (to.split("@", 1)[1],),
            )

    @app.mutation(name="record_email")
    def record_email(
        tx: workpool.Tx, work_id: str, context: dict[str, Any], result: workpool.Result
    ) -> None:
        row = tx.execute(
            "SELECT recipient FROM demo_outbox WHERE work_id = ?", (work_id,)
        ).fetchone()
        to = str(row[0])
        detail: str | None
        match result:
            case workpool.Success(value):
                detail = str(value["message_id"])
                reports.enqueue_mutation(log_delivery, {"to": to, "message_id": detail}, tx=tx)
            case workpool.Failed(error):
                detail = error
            case workpool.Canceled():
                detail = None
        tx.execute(
            "INSERT INTO demo_email_results (work_id, recipient, outcome, detail)"
            " VALUES (?, ?, ?, ?)",
            (work_id, to, result.kind, detail),
        )

    return DemoApp(app, emails, reports, gauges, send_email, record_email)


def create_tables(demo: DemoApp) -> None:
    with demo.app.transaction() as tx:
        for statement in SCHEMA:
            tx.execute(statement)


def enqueue_emails(
    demo: DemoApp, count: int, *, run_after: float | None = None, first: int = 0, chunk: int = 500
) -> list[str]:
    """Enqueue ``count`` emails and their outbox rows, one transaction per ``chunk``."""
    ids: list[str] = []
    for start in range(first, first + count, chunk):
        recipients = [recipient(i) for i in range(start, min(start + chunk, first + count))]
        with demo.app.transaction() as tx:
            batch = demo.emails.enqueue_action_batch(
                demo.send_email,
                [{"to": to, "subject": "Your order has shipped"} for to in recipients],
                on_complete=demo.record_email,
                run_after=run_after,
                tx=tx,
            )
            tx.connection.executemany(
                "INSERT INTO demo_outbox (work_id, recipient) VALUES (?, ?)",
                list(zip(batch, recipients, strict=True)),
            )
        ids += batch
    return ids
