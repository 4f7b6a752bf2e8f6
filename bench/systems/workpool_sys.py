"""workpool on SQLite and on PostgreSQL.

Workers are `app.run_worker(pools=["bench"], concurrency=C)` in separate processes,
stopped with SIGTERM. The pool's config (max_parallelism, retries) is written by
the client at the first enqueue, as an application would; the workers read it
from the database. workpool's own stderr events are silenced in every process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from typing import Any

from common import open_record, pg_create_db, pg_drop_db, record, wait_for_go

from systems.base import System, flaky_should_fail

POOL = "bench"
UNLIMITED = 100_000  # max_parallelism for workloads without a limit


def _silence() -> None:
    log = logging.getLogger("workpool")
    log.addHandler(logging.NullHandler())
    log.propagate = False


def build_app(url: str, store: str) -> Any:
    """The App with the benchmark's functions; the same in the client and the workers."""
    import workpool

    _silence()
    app = workpool.App(url)
    mark = "?" if store == "sqlite" else "%s"
    table = "bench_done" if store == "sqlite" else "public.bench_done"

    @app.action(name="noop")
    def noop(i: int, pad: str = "") -> None:
        record(i)

    @app.action(name="sleep")
    def sleep(i: int, ms: float) -> None:
        t0 = time.time()
        time.sleep(ms / 1000.0)
        record(i, 1, 1, t0, time.time())

    @app.action(name="flaky")
    def flaky(i: int) -> None:
        attempt = workpool.current().attempt
        if flaky_should_fail(attempt):
            record(i, attempt, 0)
            raise RuntimeError(f"planned failure {attempt}")
        record(i, attempt, 1)

    @app.action(name="big")
    def big(i: int, blob: str) -> None:
        if len(blob) < 800_000:
            raise RuntimeError("payload truncated")
        record(i)

    @app.mutation(name="on_done")
    def on_done(tx: Any, work_id: str, context: Any, result: Any) -> None:
        tx.execute(f"INSERT INTO {table} (work_id) VALUES ({mark})", (work_id,))

    return app


class _Workpool(System):
    has_on_complete = True
    notes = (
        "2 worker processes (`app.run_worker`, thread executor), concurrency 800 per process "
        "on SQLite, 1600 on PostgreSQL (SQLite: the best of 200/400/800, as 800 drained 3-25 % "
        "faster in round 18, on_complete and retries too in round 19; PostgreSQL: room for its "
        "claims of 1,024, round 35), max_parallelism 100000 unless the workload sets a limit; "
        "batches via enqueue_action_batch"
    )

    def url(self) -> str:
        raise NotImplementedError

    @property
    def table(self) -> str:
        return "bench_done" if self.store == "sqlite" else "public.bench_done"

    def setup(self) -> None:
        self.app = build_app(self.url(), self.store)
        import workpool

        retry = self.spec.get("retry")
        behavior = (
            workpool.RetryBehavior(
                max_attempts=retry["max_attempts"], initial_backoff=retry["backoff"], base=1.0
            )
            if retry
            else None
        )
        self.retry = behavior
        limit = self.spec.get("limit") or UNLIMITED
        self.pool = self.app.pool(POOL, max_parallelism=limit)
        with self.app.transaction() as tx:
            tx.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (work_id TEXT)")

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        kw: dict[str, Any] = {}
        if self.spec.get("on_complete"):
            kw["on_complete"] = "on_done"
            kw["context"] = self.spec.get("context")
        if task == "flaky":
            kw["retry"] = self.retry
        return self.pool.enqueue_action_batch(task, args_list, **kw)

    def enqueue_one(self, task: str, args: dict[str, Any]) -> Any:
        return self.pool.enqueue_action(task, args)

    def unfinished(self) -> int:
        store = self.app.store
        return int(self.app.run(lambda tx: store.active_count(tx, [POOL]), readonly=True))

    def status_cost(self, ids: list[Any]) -> float:
        sample = random.Random(7).sample(ids, min(200, len(ids)))
        t = time.perf_counter()
        for wid in sample:
            self.pool.status(wid)
        return (time.perf_counter() - t) / len(sample)

    def extra_verify(self) -> dict[str, Any]:
        if not self.spec.get("on_complete"):
            return {}
        with self.app.transaction() as tx:
            n, d = tx.execute(
                f"SELECT count(*), count(DISTINCT work_id) FROM {self.table}"
            ).fetchone()
        return {"on_complete_rows": int(n), "on_complete_distinct": int(d)}

    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        w = self.workload
        cfg: dict[str, Any] = {"url": self.url(), "store": self.store}
        if w == "latency":
            return 1, dict(cfg, concurrency=10)
        if w == "limit":
            return 2, dict(cfg, concurrency=self.spec["limit"])
        procs = int(os.environ.get("BENCH_WP_PROCS", "2"))
        # Room for PostgreSQL's claims of 1,024 (Store.worker_batch), SQLite's of 512.
        best = "1600" if self.store == "postgresql" else "800"
        return procs, dict(cfg, concurrency=int(os.environ.get("BENCH_WP_CONCURRENCY", best)))

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.app.close()


class WorkpoolSqlite(_Workpool):
    name = "workpool-sqlite"
    store = "sqlite"

    def url(self) -> str:
        return "sqlite:///" + os.path.join(self.spec["tmp_dir"], "workpool.db")


class WorkpoolPg(_Workpool):
    name = "workpool-pg"
    store = "postgresql"

    def url(self) -> str:
        return self._url

    def setup(self) -> None:
        self._url = pg_create_db(self._db_name("bench_workpool"))
        super().setup()

    def teardown(self) -> None:
        super().teardown()
        pg_drop_db(self.db)


def worker_main(cfg: dict[str, Any]) -> None:
    open_record(cfg["record_dir"])
    app = build_app(cfg["url"], cfg["store"])
    app._migrate()  # connect and check the schema before READY
    wait_for_go()
    app.run_worker(pools=[POOL], concurrency=cfg["concurrency"], until_idle=False)
