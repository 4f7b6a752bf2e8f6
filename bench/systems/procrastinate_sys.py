"""procrastinate (PostgreSQL, psycopg 3), in its own fresh database per trial.

Workers: `app.run_worker_async(concurrency=C)` in separate processes, async tasks,
LISTEN/NOTIFY on (default), SIGTERM handled by procrastinate. Batch enqueue:
`task.batch_defer(*kwargs)` (one INSERT per batch). Retries: a retry strategy
with a 10 ms wait; the worker's fetch polling interval is lowered to 20 ms in that
workload so that the scheduled retries are picked up (they send no notification).
No global limit (only `lock`, i.e. a limit of 1) and no completion hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from typing import Any

from common import open_record, pg_create_db, pg_drop_db, record, wait_for_go

from systems.base import System, flaky_should_fail

DB = "bench_procrastinate"


def build_app(url: str, retry: dict[str, Any] | None = None) -> Any:
    import procrastinate
    from procrastinate.retry import BaseRetryStrategy, RetryDecision

    retry = retry or {"max_attempts": 3, "backoff": 0.01}

    class FixedRetry(BaseRetryStrategy):
        def get_retry_decision(self, *, exception: BaseException, job: Any) -> Any:
            if job.attempts + 1 >= retry["max_attempts"]:
                return None
            return RetryDecision(retry_in={"microseconds": int(retry["backoff"] * 1e6)})

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name="noop")
    async def noop(i: int, pad: str = "") -> None:
        record(i)

    @app.task(name="sleep")
    async def sleep(i: int, ms: float) -> None:
        t0 = time.time()
        await asyncio.sleep(ms / 1000.0)
        record(i, 1, 1, t0, time.time())

    @app.task(name="flaky", pass_context=True, retry=FixedRetry())
    async def flaky(context: Any, i: int) -> None:
        attempt = context.job.attempts + 1
        if flaky_should_fail(attempt):
            record(i, attempt, 0)
            raise RuntimeError(f"planned failure {attempt}")
        record(i, attempt, 1)

    @app.task(name="big")
    async def big(i: int, blob: str, ctx: str | None = None) -> None:
        if len(blob) < 800_000:
            raise RuntimeError("payload truncated")
        record(i)

    return app


class ProcrastinateSystem(System):
    name = "procrastinate"
    store = "postgresql"
    na = {"limit": "no-limit", "on_complete": "no-hook", "scale": "fill-time"}
    notes = (
        "2 worker processes, run_worker_async(concurrency=20) (5/20/100 all ~400/s), "
        "async tasks, batch_defer"
    )

    def setup(self) -> None:
        self.url = pg_create_db(self._db_name(DB))
        self.app = build_app(self.url, self.spec.get("retry"))
        self.app.open()
        self.app.schema_manager.apply_schema()
        self.tasks = {t.name: t for t in self.app.tasks.values()}
        import psycopg

        self.pg = psycopg.connect(self.url, autocommit=True)

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        return self.tasks[task].batch_defer(*args_list)

    def enqueue_one(self, task: str, args: dict[str, Any]) -> Any:
        return self.tasks[task].defer(**args)

    def unfinished(self) -> int:
        row = self.pg.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
        ).fetchone()
        return int(row[0])

    def status_cost(self, ids: list[Any]) -> float:
        sample = random.Random(7).sample(ids, min(200, len(ids)))
        t = time.perf_counter()
        for jid in sample:
            self.app.job_manager.get_job_status(jid)
        return (time.perf_counter() - t) / len(sample)

    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        conc = int(os.environ.get("BENCH_PROC_CONCURRENCY", "20"))
        cfg: dict[str, Any] = {"url": self.url, "retry": self.spec.get("retry")}
        if self.workload == "latency":
            return 1, dict(cfg, concurrency=10, poll=5.0)
        if self.workload == "retries":
            return 2, dict(cfg, concurrency=conc, poll=0.02)
        return 2, dict(cfg, concurrency=conc, poll=5.0)

    def teardown(self) -> None:
        for closer in (self.app.close, self.pg.close):
            with contextlib.suppress(Exception):
                closer()
        pg_drop_db(self.db)


async def _worker(cfg: dict[str, Any]) -> None:
    app = build_app(cfg["url"], cfg.get("retry"))
    async with app.open_async():
        wait_for_go()
        await app.run_worker_async(
            concurrency=int(cfg["concurrency"]),
            fetch_job_polling_interval=float(cfg["poll"]),
            install_signal_handlers=True,
            shutdown_graceful_timeout=5.0,
        )


def worker_main(cfg: dict[str, Any]) -> None:
    logging.getLogger("procrastinate").setLevel(logging.CRITICAL)
    open_record(cfg["record_dir"])
    asyncio.run(_worker(cfg))
