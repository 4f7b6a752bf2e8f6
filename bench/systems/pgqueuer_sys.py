"""pgqueuer (PostgreSQL, asyncpg), in its own fresh database per trial.

Workers: QueueManager.run in separate processes (2 for throughput workloads),
async entrypoints, stopped with SIGTERM -> qm.shutdown. Batch enqueue: one
`Queries.enqueue(list, list, list)` call per batch (one INSERT ... unnest).
Global limit: `entrypoint(concurrency_limit=5)`, enforced in SQL across workers.
Retries: DatabaseRetryEntrypointExecutor (re-queued with execute_after).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from datetime import timedelta
from typing import Any

from common import open_record, pg_create_db, pg_drop_db, record, wait_for_go

from systems.base import System, flaky_should_fail

DB = "bench_pgqueuer"


class PgQueuerSystem(System):
    name = "pgqueuer"
    store = "postgresql"
    na = {"on_complete": "no-hook"}
    notes = (
        "2 worker processes, QueueManager.run(batch_size=100) (best of 10/50/100/200), "
        "durable mode (default), asyncpg driver, async no-op entrypoints"
    )

    def setup(self) -> None:
        import asyncpg
        from pgqueuer import Queries
        from pgqueuer.db import AsyncpgDriver

        self.url = pg_create_db(self._db_name(DB))
        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(asyncpg.connect(self.url))
        self.queries = Queries(AsyncpgDriver(self.conn))
        self.loop.run_until_complete(self.queries.install())

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        n = len(args_list)
        return self._run(
            self.queries.enqueue([task] * n, [json.dumps(a).encode() for a in args_list], [0] * n)
        )

    def enqueue_one(self, task: str, args: dict[str, Any]) -> Any:
        return self._run(self.queries.enqueue(task, json.dumps(args).encode()))[0]

    def unfinished(self) -> int:
        return int(self._run(self.conn.fetchval("SELECT count(*) FROM pgqueuer")))

    def status_cost(self, ids: list[Any]) -> float:
        sample = random.Random(7).sample(ids, min(200, len(ids)))
        t = time.perf_counter()
        for jid in sample:
            self._run(self.queries.job_status([jid]))
        return (time.perf_counter() - t) / len(sample)

    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        cfg: dict[str, Any] = {"url": self.url, "workload": self.workload}
        batch = int(os.environ.get("BENCH_PGQ_BATCH", "100"))
        if self.workload == "latency":
            return 1, dict(cfg, batch=10, max_tasks=0)
        if self.workload == "limit":
            return 2, dict(cfg, batch=10, max_tasks=0, limit=self.spec["limit"])
        if self.workload == "retries":
            return 2, dict(cfg, batch=batch, max_tasks=0, retry=self.spec["retry"])
        return 2, dict(cfg, batch=batch, max_tasks=0)

    def teardown(self) -> None:
        try:
            self._run(self.conn.close())
            self.loop.close()
        except Exception:
            pass
        pg_drop_db(self.db)


async def _worker(cfg: dict[str, Any]) -> None:
    import asyncpg
    from pgqueuer import Queries, QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.executors import DatabaseRetryEntrypointExecutor

    conn = await asyncpg.connect(cfg["url"])
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("noop")
    async def noop(job: Any) -> None:
        record(json.loads(job.payload)["i"])

    @qm.entrypoint("sleep", concurrency_limit=int(cfg.get("limit") or 0))
    async def sleep(job: Any) -> None:
        a = json.loads(job.payload)
        t0 = time.time()
        await asyncio.sleep(a["ms"] / 1000.0)
        record(a["i"], 1, 1, t0, time.time())

    retry = cfg.get("retry") or {"max_attempts": 3, "backoff": 0.01}

    def retrying(params: Any) -> Any:
        return DatabaseRetryEntrypointExecutor(
            parameters=params,
            max_attempts=retry["max_attempts"],
            initial_delay=timedelta(seconds=retry["backoff"]),
            backoff_multiplier=1.0,
        )

    @qm.entrypoint("flaky", executor_factory=retrying)
    async def flaky(job: Any) -> None:
        i = json.loads(job.payload)["i"]
        attempt = job.attempts + 1
        if flaky_should_fail(attempt):
            record(i, attempt, 0)
            raise RuntimeError(f"planned failure {attempt}")
        record(i, attempt, 1)

    @qm.entrypoint("big")
    async def big(job: Any) -> None:
        a = json.loads(job.payload)
        if len(a["blob"]) < 800_000:
            raise RuntimeError("payload truncated")
        record(a["i"])

    wait_for_go()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, qm.shutdown.set)
    await qm.run(
        batch_size=int(cfg["batch"]),
        max_concurrent_tasks=int(cfg["max_tasks"]) or None,
        dequeue_timeout=timedelta(seconds=30),
    )


def worker_main(cfg: dict[str, Any]) -> None:
    import logging

    logging.getLogger("pgqueuer").setLevel(logging.CRITICAL)
    open_record(cfg["record_dir"])
    asyncio.run(_worker(cfg))
