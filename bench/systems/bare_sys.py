"""The floor: a minimal hand-written claim/complete loop per store.

No limits, no retries, no leases, no events: one table, claim a batch, run it,
delete the batch (and, in the on_complete workload, insert one row per job in
the same completing transaction). A worker process is one thread:

  PostgreSQL: UPDATE jobs SET state = 1 WHERE id IN (SELECT id FROM jobs WHERE state = 0
              ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING id, task, args
              ... run ...;  DELETE FROM jobs WHERE id = ANY(ids)
  SQLite:     BEGIN IMMEDIATE; UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING ...;
              COMMIT ... run ...; BEGIN IMMEDIATE; DELETE ...; COMMIT

WAL + synchronous=NORMAL on SQLite (as workpool). Idle polling every 1 ms.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import time
from typing import Any

from common import open_record, pg_create_db, pg_drop_db, record, wait_for_go

from systems.base import System

DB = "bench_bare"
BATCH = 100
IDLE_S = 0.001


def run_task(task: str, args: dict[str, Any]) -> None:
    if task == "noop":
        record(args["i"])
    elif task == "big":
        if len(args["blob"]) < 800_000:
            raise RuntimeError("payload truncated")
        record(args["i"])
    else:
        raise RuntimeError(f"unknown task {task}")


class _Bare(System):
    na = {"limit": "no-limit", "retries": "no-retry"}
    notes = f"2 worker processes, claim batch {BATCH}, one thread each, poll 1 ms when idle"

    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        cfg = {"target": self.target(), "on_complete": bool(self.spec.get("on_complete"))}
        return (1 if self.workload == "latency" else 2), cfg

    def target(self) -> str:
        raise NotImplementedError


class BarePg(_Bare):
    name = "bare-pg"
    store = "postgresql"

    def target(self) -> str:
        return self.url

    def setup(self) -> None:
        import psycopg

        self.url = pg_create_db(self._db_name(DB))
        self.conn = psycopg.connect(self.url, autocommit=True)
        self.conn.execute(
            "CREATE TABLE jobs (id bigserial PRIMARY KEY, task text NOT NULL,"
            " args jsonb NOT NULL, state smallint NOT NULL DEFAULT 0)"
        )
        self.conn.execute("CREATE INDEX jobs_pending ON jobs (id) WHERE state = 0")
        self.conn.execute("CREATE TABLE bench_done (work_id bigint)")

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        rows = self.conn.execute(
            "INSERT INTO jobs (task, args) SELECT %s, unnest(%s::jsonb[]) RETURNING id",
            (task, [json.dumps(a) for a in args_list]),
        ).fetchall()
        return [r[0] for r in rows]

    def unfinished(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM jobs").fetchone()[0])

    def status_cost(self, ids: list[Any]) -> float:
        sample = random.Random(7).sample(ids, min(200, len(ids)))
        t = time.perf_counter()
        for jid in sample:
            self.conn.execute("SELECT state FROM jobs WHERE id = %s", (jid,)).fetchone()
        return (time.perf_counter() - t) / len(sample)

    def extra_verify(self) -> dict[str, Any]:
        if not self.spec.get("on_complete"):
            return {}
        n, d = self.conn.execute(
            "SELECT count(*), count(DISTINCT work_id) FROM bench_done"
        ).fetchone()
        return {"on_complete_rows": int(n), "on_complete_distinct": int(d)}

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        pg_drop_db(self.db)


class BareSqlite(_Bare):
    name = "bare-sqlite"
    store = "sqlite"

    def target(self) -> str:
        return self.path

    def setup(self) -> None:
        self.path = os.path.join(self.spec["tmp_dir"], "bare.db")
        self.conn = _sqlite(self.path)
        self.conn.execute(
            "CREATE TABLE jobs (id INTEGER PRIMARY KEY, task TEXT NOT NULL,"
            " args TEXT NOT NULL, state INTEGER NOT NULL DEFAULT 0)"
        )
        self.conn.execute("CREATE INDEX jobs_pending ON jobs (state, id)")
        self.conn.execute("CREATE TABLE bench_done (work_id INTEGER)")

    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            first = None
            for a in args_list:
                cur = c.execute(
                    "INSERT INTO jobs (task, args) VALUES (?, ?)", (task, json.dumps(a))
                )
                if first is None:
                    first = cur.lastrowid
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        assert first is not None
        return list(range(first, first + len(args_list)))

    def unfinished(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM jobs").fetchone()[0])

    def status_cost(self, ids: list[Any]) -> float:
        sample = random.Random(7).sample(ids, min(200, len(ids)))
        t = time.perf_counter()
        for jid in sample:
            self.conn.execute("SELECT state FROM jobs WHERE id = ?", (jid,)).fetchone()
        return (time.perf_counter() - t) / len(sample)

    def extra_verify(self) -> dict[str, Any]:
        if not self.spec.get("on_complete"):
            return {}
        n, d = self.conn.execute(
            "SELECT count(*), count(DISTINCT work_id) FROM bench_done"
        ).fetchone()
        return {"on_complete_rows": int(n), "on_complete_distinct": int(d)}

    def teardown(self) -> None:
        self.conn.close()


def _sqlite(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


# --- worker loops -----------------------------------------------------------------------------
_stop = False


def _on_term(*_: Any) -> None:
    global _stop
    _stop = True


def _loop_pg(cfg: dict[str, Any]) -> None:
    import psycopg

    conn = psycopg.connect(cfg["target"], autocommit=True)
    on_complete = cfg["on_complete"]
    wait_for_go()
    while not _stop:
        rows = conn.execute(
            "UPDATE jobs SET state = 1 WHERE id IN (SELECT id FROM jobs WHERE state = 0"
            " ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id, task, args",
            (BATCH,),
        ).fetchall()
        if not rows:
            time.sleep(IDLE_S)
            continue
        for _, task, args in rows:
            run_task(task, args)
        ids = [r[0] for r in rows]
        with conn.transaction():
            conn.execute("DELETE FROM jobs WHERE id = ANY(%s)", (ids,))
            if on_complete:
                conn.execute("INSERT INTO bench_done SELECT unnest(%s::bigint[])", (ids,))


def _loop_sqlite(cfg: dict[str, Any]) -> None:
    conn = _sqlite(cfg["target"])
    on_complete = cfg["on_complete"]
    wait_for_go()
    while not _stop:
        conn.execute("BEGIN IMMEDIATE")
        rows = conn.execute(
            "UPDATE jobs SET state = 1 WHERE id IN (SELECT id FROM jobs WHERE state = 0"
            " ORDER BY id LIMIT ?) RETURNING id, task, args",
            (BATCH,),
        ).fetchall()
        conn.execute("COMMIT")
        if not rows:
            time.sleep(IDLE_S)
            continue
        for _, task, args in rows:
            run_task(task, json.loads(args))
        ids = [r[0] for r in rows]
        marks = ",".join("?" * len(ids))
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(f"DELETE FROM jobs WHERE id IN ({marks})", ids)
        if on_complete:
            conn.executemany("INSERT INTO bench_done VALUES (?)", [(i,) for i in ids])
        conn.execute("COMMIT")


def worker_main(cfg: dict[str, Any]) -> None:
    open_record(cfg["record_dir"])
    signal.signal(signal.SIGTERM, _on_term)
    if cfg["target"].startswith("postgresql"):
        _loop_pg(cfg)
    else:
        _loop_sqlite(cfg)
