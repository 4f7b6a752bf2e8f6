"""huey on SQLite (SqliteHuey), a fresh file per trial.

Storage: WAL with `synchronous=NORMAL`, the same durability workpool's SQLite store
uses (huey itself offers only FULL or OFF). `results=False`: the benchmark tasks
return nothing. Enqueue: one INSERT + commit per task (huey has no batch enqueue).
Workers: one consumer process with 2 worker processes (`worker_type="process"`),
polling delay 1 ms growing to 10 ms when idle (2 ms in the latency workload;
huey's default grows to 10 s). Retries: `retries=2, retry_delay=0.01`; a delayed
retry goes through huey's scheduler, which runs at most once per second.
No global limit, no completion hook, no status of pending work.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from common import open_record, record, wait_for_go

from systems.base import System, flaky_should_fail


def build_huey(path: str, retry: dict[str, Any] | None = None) -> Any:
    from huey import SqliteHuey
    from huey.storage import SqliteStorage

    class NormalSyncStorage(SqliteStorage):  # type: ignore[misc]
        def _create_connection(self) -> Any:
            conn = super()._create_connection()
            conn.execute("pragma synchronous=1")  # NORMAL, as workpool
            return conn

    class BenchHuey(SqliteHuey):  # type: ignore[misc]
        storage_class = NormalSyncStorage

    huey = BenchHuey("bench", filename=path, results=False)
    retry = retry or {"max_attempts": 3, "backoff": 0.01}

    @huey.task(name="noop")
    def noop(i: int, pad: str = "") -> None:
        record(i)

    @huey.task(name="sleep")
    def sleep(i: int, ms: float) -> None:
        t0 = time.time()
        time.sleep(ms / 1000.0)
        record(i, 1, 1, t0, time.time())

    retries = retry["max_attempts"] - 1

    @huey.task(name="flaky", retries=retries, retry_delay=retry["backoff"], context=True)
    def flaky(i: int, task: Any = None) -> None:
        attempt = retries - task.retries + 1
        if flaky_should_fail(attempt):
            record(i, attempt, 0)
            raise RuntimeError(f"planned failure {attempt}")
        record(i, attempt, 1)

    @huey.task(name="big")
    def big(i: int, blob: str, ctx: str | None = None) -> None:
        if len(blob) < 800_000:
            raise RuntimeError("payload truncated")
        record(i)

    return huey, {"noop": noop, "sleep": sleep, "flaky": flaky, "big": big}


class HueySystem(System):
    name = "huey"
    store = "sqlite"
    na = {"limit": "no-limit", "on_complete": "no-hook", "scale": "no-status"}
    notes = (
        "one consumer with 2 worker processes, WAL + synchronous=NORMAL, results off, poll 1->10 ms"
    )

    def setup(self) -> None:
        self.path = os.path.join(self.spec["tmp_dir"], "huey.db")
        self.huey, self.tasks = build_huey(self.path, self.spec.get("retry"))

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        fn = self.tasks[task]
        return [fn(**a) for a in args_list]

    def unfinished(self) -> int:
        return int(self.huey.pending_count()) + int(self.huey.scheduled_count())

    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        cfg: dict[str, Any] = {"path": self.path, "retry": self.spec.get("retry")}
        workers = int(os.environ.get("BENCH_HUEY_WORKERS", "2"))
        if self.workload == "latency":
            return 1, dict(cfg, workers=1, worker_type="thread", max_delay=0.002)
        kind = os.environ.get("BENCH_HUEY_TYPE", "process")
        return 1, dict(cfg, workers=workers, worker_type=kind, max_delay=0.01)


def worker_main(cfg: dict[str, Any]) -> None:
    open_record(cfg["record_dir"])
    huey, _ = build_huey(cfg["path"], cfg.get("retry"))
    logging.getLogger("huey").setLevel(logging.CRITICAL)
    consumer = huey.create_consumer(
        workers=int(cfg["workers"]),
        worker_type=cfg["worker_type"],
        initial_delay=0.001,
        backoff=1.15,
        max_delay=float(cfg["max_delay"]),
        periodic=False,
        scheduler_interval=1,
        check_worker_health=False,
    )
    wait_for_go()
    consumer.run()
