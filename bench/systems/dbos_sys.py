"""DBOS Transact queues (PostgreSQL system database), fresh database per trial.

Each job is a workflow on the queue "bench". Client side: DBOSClient; a batch is
one SQLAlchemy transaction of `enqueue_in_transaction` calls (DBOS has no bulk
enqueue). Workers: separate processes, each `DBOS(config).launch()` after GO
(launch starts the queue threads), stopped with SIGTERM -> DBOS.destroy().
Queue polling interval 10 ms (default 1 s) and worker_concurrency 100 so that one
poll does not claim the whole backlog into one process. Global limit:
`global_concurrency=5`. Retries: a step with retries_allowed, interval 10 ms,
backoff_rate 1 (DBOS retries steps inside the running workflow).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
import time
from typing import Any

from common import open_record, pg_create_db, pg_drop_db, record, wait_for_go

from systems.base import System, flaky_should_fail

DB = "bench_dbos"
QUEUE = "bench"
APP = "bench"


class DbosSystem(System):
    name = "dbos"
    store = "postgresql"
    na = {"on_complete": "no-hook", "scale": "fill-time"}
    notes = (
        "2 worker processes; queue polling 10 ms, worker_concurrency 100; "
        "batch = one transaction of DBOSClient.enqueue_in_transaction"
    )

    def setup(self) -> None:
        import sqlalchemy as sa
        from dbos import DBOS, DBOSClient

        self.url = pg_create_db(self._db_name(DB))
        DBOS.migrate(self.url)
        self.client = DBOSClient(system_database_url=self.url, application_name=APP)
        limit = self.spec.get("limit")
        poll = float(os.environ.get("BENCH_DBOS_POLL", "0.01"))
        self.client.register_queue(
            QUEUE,
            global_concurrency=limit,
            worker_concurrency=limit or int(os.environ.get("BENCH_DBOS_WORKER_CONC", "100")),
            polling_interval_sec=poll,
            application_name=APP,
        )
        self.engine = sa.create_engine(self.url.replace("postgresql://", "postgresql+psycopg://"))
        self.sa = sa

    def _options(self, task: str) -> Any:
        return {"queue_name": QUEUE, "workflow_name": task}

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        opts = self._options(task)
        with self.engine.begin() as conn:
            return [
                self.client.enqueue_in_transaction(conn, opts, **a).get_workflow_id()  # type: ignore[arg-type]
                for a in args_list
            ]

    def enqueue_one(self, task: str, args: dict[str, Any]) -> Any:
        return self.client.enqueue(self._options(task), **args).get_workflow_id()  # type: ignore[arg-type]

    def unfinished(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    self.sa.text(
                        "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = :q"
                        " AND status IN ('ENQUEUED', 'PENDING', 'DELAYED')"
                    ),
                    {"q": QUEUE},
                ).scalar()
            )

    def status_cost(self, ids: list[Any]) -> float:
        sample = random.Random(7).sample(ids, min(200, len(ids)))
        t = time.perf_counter()
        for wid in sample:
            self.client.retrieve_workflow(wid).get_status()
        return (time.perf_counter() - t) / len(sample)

    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        cfg: dict[str, Any] = {"url": self.url, "retry": self.spec.get("retry")}
        if self.workload == "latency":
            return 1, cfg
        return 2, cfg

    def teardown(self) -> None:
        for closer in (self.client.destroy, self.engine.dispose):
            with contextlib.suppress(Exception):
                closer()
        pg_drop_db(self.db)


def worker_main(cfg: dict[str, Any]) -> None:
    from dbos import DBOS

    open_record(cfg["record_dir"])
    retry = cfg.get("retry") or {"max_attempts": 3, "backoff": 0.01}
    DBOS(
        config={
            "name": APP,
            "system_database_url": cfg["url"],
            "application_version": "bench",
            "executor_id": f"bench-{cfg['worker_index']}",
            "log_level": "ERROR",
        }
    )

    @DBOS.workflow(name="noop")
    def noop(i: int, pad: str = "") -> None:
        record(i)

    @DBOS.workflow(name="sleep")
    def sleep(i: int, ms: float) -> None:
        t0 = time.time()
        time.sleep(ms / 1000.0)
        record(i, 1, 1, t0, time.time())

    @DBOS.step(
        retries_allowed=True,
        max_attempts=retry["max_attempts"],
        interval_seconds=retry["backoff"],
        backoff_rate=1.0,
    )
    def flaky_step(i: int) -> None:
        status = DBOS.step_status
        attempt = (status.current_attempt or 0) + 1 if status else 1
        if flaky_should_fail(attempt):
            record(i, attempt, 0)
            raise RuntimeError(f"planned failure {attempt}")
        record(i, attempt, 1)

    @DBOS.workflow(name="flaky")
    def flaky(i: int) -> None:
        flaky_step(i)

    @DBOS.workflow(name="big")
    def big(i: int, blob: str, ctx: str | None = None) -> None:
        if len(blob) < 800_000:
            raise RuntimeError("payload truncated")
        record(i)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    wait_for_go()
    DBOS.launch()
    for name in ("dbos", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    stop.wait()
    DBOS.destroy(workflow_completion_timeout_sec=0)
