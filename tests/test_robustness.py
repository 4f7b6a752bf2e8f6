"""Several workers at once, store conflicts, held locks, big backlogs.

PRODUCT.md §1, §3 (transient store conflicts are retried transparently) and the
lessons "one poisoned work item must never stall a pool" and "every transaction
is bounded".
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import workpool
from conftest import (
    Recorder,
    UserTable,
    WorkerThread,
    assert_pool_empty,
    background_worker,
    create_table,
    holds_for,
    pg_schema_of,
    run_until_idle,
    store_kind,
    transient_error,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)


def _register(app, rec: Recorder, table: UserTable) -> dict:
    @app.action(name="busy")
    def busy(i: int) -> int:
        rec.enter(i=i)
        time.sleep(0.02)
        rec.leave()
        return i

    @app.mutation(name="effect")
    def effect(tx, i: int) -> int:
        table.insert(tx, f"mut:{i}")
        return i

    @app.mutation(name="done")
    def done(tx, work_id, context, result):
        table.insert(tx, f"done:{work_id}", result.kind)

    return {"busy": busy, "effect": effect, "done": done}


def test_two_apps_working_one_store_share_the_limit_and_complete_once(
    app, store_url, rec: Recorder, user_table
):
    fns = _register(app, rec, user_table)
    second = workpool.App(store_url)
    _register(second, rec, user_table)
    try:
        pool = app.pool("shared", max_parallelism=4)
        actions = pool.enqueue_action_batch(
            fns["busy"], [{"i": i} for i in range(60)], on_complete=fns["done"]
        )
        mutations = pool.enqueue_mutation_batch(
            fns["effect"], [{"i": i} for i in range(30)], on_complete=fns["done"]
        )
        workers = [
            WorkerThread(a, until_idle=True, concurrency=6, lease=2.0).start()
            for a in (app, second)
        ]
        for w in workers:
            w.join(60)
    finally:
        second.close()

    assert rec.max_active <= 4
    assert rec.max_active >= 3
    assert [s.result for s in pool.status_batch(actions)] == [
        workpool.Success(i) for i in range(60)
    ]
    assert [s.result for s in pool.status_batch(mutations)] == [
        workpool.Success(i) for i in range(30)
    ]
    rows = Counter(k for k, _ in user_table.rows())
    assert {k: v for k, v in rows.items() if v != 1} == {}, "an effect happened twice"
    assert sum(1 for k in rows if k.startswith("mut:")) == 30
    assert sum(1 for k in rows if k.startswith("done:")) == 90


def test_conflicting_mutations_are_retried_transparently(app, store_url, rec: Recorder):
    """Mutations that take row locks in opposite orders: PostgreSQL aborts one side of
    each deadlock; workpool must retry it, not fail it, and still apply it once."""
    p = "?" if store_kind(store_url) == "sqlite" else "%s"
    schema = pg_schema_of(store_url)
    name = create_table(
        app, store_url, "accounts", "id INTEGER PRIMARY KEY, balance INTEGER NOT NULL"
    )
    with app.transaction() as tx:
        tx.execute(f"INSERT INTO {name} (id, balance) VALUES (1, 0)")
        tx.execute(f"INSERT INTO {name} (id, balance) VALUES (2, 0)")

    @app.mutation(name="transfer")
    def transfer(tx, first: int, second: int) -> None:
        if schema:
            tx.execute("SET LOCAL deadlock_timeout = '20ms'")
        rec.add(kind="try")
        tx.execute(f"UPDATE {name} SET balance = balance + 1 WHERE id = {p}", (first,))
        time.sleep(0.05)
        tx.execute(f"UPDATE {name} SET balance = balance + 1 WHERE id = {p}", (second,))

    pool = app.pool("bank", max_parallelism=8)
    args = [{"first": 1, "second": 2} if i % 2 else {"first": 2, "second": 1} for i in range(16)]
    wids = pool.enqueue_mutation_batch(transfer, args)
    # Deadlocks need transactions at once: a worker runs the mutations of one claim
    # in one transaction, so four workers claim one each.
    workers = [WorkerThread(app, until_idle=True, concurrency=1, lease=2.0) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)

    results = pool.status_batch(wids)
    if schema:  # the scenario must really have produced deadlocks to prove anything
        assert rec.count(kind="try") > 16
    assert [r.result.kind for r in results] == ["success"] * 16, [r.result for r in results]
    with app.transaction() as tx:
        balances = dict(tx.execute(f"SELECT id, balance FROM {name}").fetchall())
    assert balances == {1: 16, 2: 16}, "each transfer applied exactly once"


def test_worker_waits_out_a_lock_held_by_someone_else(app, store_url, rec: Recorder):
    @app.action(name="job")
    def job(i: int) -> int:
        rec.add(i=i)
        return i

    pool = app.pool("locked")
    wids = pool.enqueue_action_batch(job, [{"i": i} for i in range(5)])
    holder_ready = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:
        if store_kind(store_url) == "sqlite":
            import sqlite3

            conn = sqlite3.connect(store_url[len("sqlite:///") :], isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            holder_ready.set()
            release.wait(10)
            conn.execute("ROLLBACK")
            conn.close()
        else:
            import psycopg

            schema = pg_schema_of(store_url)
            with psycopg.connect(store_url.split("?", 1)[0]) as conn:
                conn.execute(f'LOCK TABLE "{schema}".work IN ACCESS EXCLUSIVE MODE')
                holder_ready.set()
                release.wait(10)
                conn.rollback()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert holder_ready.wait(10)
        worker = WorkerThread(app, until_idle=True, lease=5.0).start()
        holds_for(lambda: rec.calls == [], 1.0)  # nothing runs while the store is locked
    finally:
        release.set()
        holder.join(15)
    worker.join(60)
    assert [s.result for s in pool.status_batch(wids)] == [workpool.Success(i) for i in range(5)]


@pytest.mark.timeout(180)
def test_a_big_backlog_drains(app):
    @app.action(name="noop")
    def noop(i: int) -> int:
        return i

    pool = app.pool("backlog", max_parallelism=50)
    wids = pool.enqueue_action_batch(noop, [{"i": i} for i in range(10_000)])
    stats = pool.stats()
    assert stats.backlog == 10_000
    run_until_idle(app, concurrency=50, timeout=150)
    statuses = pool.status_batch(wids)
    assert sum(1 for s in statuses if s.result is not None and s.result.kind == "success") == 10_000
    assert_pool_empty(pool)
    assert pool.stats().succeeded == 10_000


def test_many_pools_are_all_served(app, rec: Recorder):
    @app.action(name="job")
    def job(p: str) -> str:
        rec.add(pool=workpool.current().pool)
        return p

    names = [f"pool_{i}" for i in range(25)]
    wids = {n: app.pool(n, max_parallelism=1).enqueue_action(job, {"p": n}) for n in names}
    run_until_idle(app, concurrency=4)
    assert sorted(rec.values("pool")) == sorted(names)
    for n, wid in wids.items():
        assert app.pool(n).status(wid).result == workpool.Success(n)


def test_work_enqueued_while_the_worker_sleeps_starts_promptly(app, rec: Recorder):
    @app.action(name="job")
    def job() -> None:
        rec.add()

    pool = app.pool("prompt")
    with_worker = WorkerThread(app, lease=2.0).start()
    try:
        pool.stats()
        holds_for(lambda: rec.calls == [], 0.3)  # the worker goes idle: nothing to do
        enqueued = time.time()
        wid = pool.enqueue_action(job)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=5)
        assert rec.calls[0]["t"] - enqueued < 1.5, "an idle worker should wake up quickly"
    finally:
        with_worker.stop()


def test_a_pool_created_after_the_worker_started_is_served(app, store_url, rec: Recorder):
    @app.action(name="job")
    def job() -> str:
        rec.add()
        return "late pool"

    worker = WorkerThread(app, lease=2.0).start()
    try:
        other = workpool.App(store_url)
        try:
            other.action(name="job")(lambda: None)
            wid = other.pool("born_later").enqueue_action("job")
            final = wait_for(
                lambda: (s := other.pool("born_later").status(wid)).state == "finished" and s,
                timeout=10,
            )
        finally:
            other.close()
    finally:
        worker.stop()
    assert final.result == workpool.Success("late pool")


def test_schema_keyword_keeps_stores_apart(store_url):
    if store_kind(store_url) != "postgres":
        pytest.skip("schemas are a PostgreSQL feature; SQLite stores are apart by file")
    import uuid

    from conftest import _drop_schema

    base = store_url.split("?", 1)[0]
    own = f"wp_test_{uuid.uuid4().hex[:12]}"
    first = workpool.App(base, schema=own)
    second = workpool.App(store_url)
    try:
        for a in (first, second):
            a.action(name="job")(lambda: None)
        wid = first.pool("p").enqueue_action("job", run_after=60)
        assert first.pool("p").status(wid).state == "pending"
        assert second.pool("p").status(wid) == workpool.Finished(None)
        assert second.pool("p").stats().scheduled == 0
    finally:
        first.close()
        second.close()
        _drop_schema(base, own)


class Poison(BaseException):
    """Not an Exception: escapes ``except Exception`` in careless code."""


@pytest.mark.parametrize("kind", ["sync-SystemExit", "async-BaseException"])
@pytest.mark.timeout(90)
def test_an_action_raising_a_base_exception_does_not_stall_the_pool(app, rec: Recorder, kind):
    @app.action(name="exits")
    def exits() -> None:
        raise SystemExit(3)

    @app.action(name="poisons_async")
    async def poisons_async() -> None:
        raise Poison("async poison")

    @app.action(name="fine")
    def fine(i: int) -> int:
        rec.add(i=i)
        return i

    fn = {"sync-SystemExit": exits, "async-BaseException": poisons_async}[kind]
    pool = app.pool("poison", max_parallelism=1)
    bad = pool.enqueue_action(fn)
    good = pool.enqueue_action_batch(fine, [{"i": i} for i in range(3)], run_after=0.05)
    worker = WorkerThread(app, lease=1.0, shutdown_grace=1.0).start()
    try:
        wait_for(
            lambda: all(s.state == "finished" for s in pool.status_batch(good)),
            timeout=5,
            message="the pool stalled behind one poisoned item",
        )
        final = wait_for(lambda: (s := pool.status(bad)).state == "finished" and s, timeout=8)
    finally:
        app.stop_workers()
        worker.thread.join(20)
    assert final.result.kind == "failed"
    assert sorted(rec.values("i")) == [0, 1, 2]


def test_an_enqueue_retried_after_an_ambiguous_commit_writes_each_item_once(app, store_url):
    """A retry of an enqueue whose COMMIT was lost with its connection must neither fail
    on the ids the first try may have committed nor write them twice (PostgreSQL's
    first try inserts without a conflict check: only ``Tx.retrying`` adds it)."""
    from workpool.core.ids import new_work_ids
    from workpool.store.base import NewWork

    app._migrate()
    store = app.store
    now = time.time()
    # Two with args over either store's INLINE_CHARS: those go to payloads as well.
    big = json.dumps({"pad": "x" * 2_100})
    items = [
        NewWork(i, "ambiguous", "action", "noop", big if k % 2 else "{}", *[None] * 4, now, now)
        for k, i in enumerate(new_work_ids(5))
    ]
    store.run(lambda tx: store.insert_work(tx, items[:3]))  # the try whose COMMIT was lost
    lost = transient_error(store_url)
    tries: list[bool] = []

    def enqueue(tx: workpool.Tx) -> None:
        tries.append(tx.retrying)
        if not tx.retrying:
            raise lost
        store.insert_work(tx, items)

    store.run(enqueue)
    assert tries == [False, True]
    with app.transaction() as tx:
        ids = [
            r[0]
            for r in tx.execute(
                f"SELECT id FROM {getattr(store, 'table_prefix', '')}work"
            ).fetchall()
        ]
    assert sorted(ids) == sorted(i.id for i in items)
    want = [json.loads(i.args) for i in items]
    assert [app.inspect(i.id).args for i in items] == want  # type: ignore[union-attr]


def test_many_apps_opening_a_new_store_at_once_all_open_it(store_url, tmp_path):
    """Processes started together (a worker and a web app, say) open and migrate a
    new store at the same moment. On SQLite, switching a new file to WAL answered
    "database is locked" at once, without waiting like any other lock, to all but
    one of them."""
    urls = [store_url]
    if store_kind(store_url) == "sqlite":  # a fresh file per round: the race is at creation
        urls += [f"sqlite:///{tmp_path / f'round{i}.db'}" for i in range(14)]
    errors: list[str] = []
    for url in urls:

        def open_and_use(url: str = url) -> None:
            app = workpool.App(url)
            try:
                app.pool("p").stats()
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                app.close()

        threads = [threading.Thread(target=open_and_use) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert errors == []


def test_stop_workers_stops_a_worker_that_is_still_starting(app, monkeypatch):
    # A worker's startup reads the store; a stop asked meanwhile (a test's teardown,
    # a shutdown hook) must not be lost, or that worker serves on forever.
    entered, go_on = threading.Event(), threading.Event()
    migrate = app._migrate

    def slow_migrate() -> None:
        entered.set()
        go_on.wait(10)
        migrate()

    monkeypatch.setattr(app, "_migrate", slow_migrate)
    worker = WorkerThread(app, lease=2.0).start()
    assert entered.wait(10)
    app.stop_workers()
    go_on.set()
    worker.join(10)


def test_until_idle_returns_soon_after_another_workers_last_work_ends(app, rec: Recorder):
    # The other worker's finish frees a slot with nothing due, which wakes nobody:
    # the worker run until idle must not wait out its one-second idle poll for it.
    release = threading.Event()

    @app.action(name="held")
    def held() -> None:
        rec.add()
        release.wait(10)

    pool = app.pool("handover")
    wid = pool.enqueue_action(held)
    with background_worker(app):
        wait_for(lambda: rec.calls, timeout=10)
        idle = WorkerThread(app, until_idle=True, lease=2.0).start()
        time.sleep(0.2)  # it found nothing to claim and sleeps
        released = time.monotonic()
        release.set()
        idle.join(10)
        returned = time.monotonic() - released
    assert pool.status(wid).state == "finished"
    assert returned < 0.6, f"returned {returned:.2f} s after the last work ended"


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_sqlite_commits_leave_the_checkpoint_to_a_workers_maintenance(app, store_url):
    """A commit that took the WAL past 1,000 pages used to copy it into the database
    file and sync it itself: inside a claim's commit, 5-10 ms on a slow disk, which
    delayed 1 start in 100. Now a worker's maintenance does it, off those threads."""

    @app.action(name="noop")
    def noop(i: int, pad: str) -> None:
        pass

    path = store_url[len("sqlite:///") :]
    pool = app.pool("wal", max_parallelism=0)  # paused: nothing is claimed
    pool.stats()  # creates the file
    before = os.path.getsize(path)
    pool.enqueue_action_batch(noop, [{"i": i, "pad": "x" * 200} for i in range(30_000)])
    assert os.path.getsize(path + "-wal") > 1_000 * 4096  # past SQLite's own threshold
    assert os.path.getsize(path) == before  # no commit copied it into the database
    with background_worker(app, pools=["wal"]):
        wait_for(lambda: os.path.getsize(path) > before + 1_000 * 4096, 10)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_sqlite_checkpoint_held_back_by_a_reader_is_finished_later(app, store_url):
    """A checkpoint cannot copy what a reader's snapshot still needs from the WAL;
    the next one must copy it even when nothing was committed in between."""
    import sqlite3

    @app.action(name="noop")
    def noop(i: int, pad: str) -> None:
        pass

    path = store_url[len("sqlite:///") :]
    pool = app.pool("wal", max_parallelism=0)
    pool.stats()
    store = app.store

    maintenance = ThreadPoolExecutor(max_workers=1)  # one thread, as a worker's

    def checkpoint() -> None:
        maintenance.submit(store.checkpoint).result(10)

    def enqueue() -> None:
        pool.enqueue_action_batch(noop, [{"i": i, "pad": "x" * 200} for i in range(5_000)])

    enqueue()
    checkpoint()
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM work").fetchone()  # pins this snapshot
        enqueue()
        checkpoint()
        held_back = os.path.getsize(path)
    finally:
        reader.execute("ROLLBACK")
        reader.close()
    checkpoint()  # nothing committed since: only what was held back is left
    maintenance.shutdown()
    assert os.path.getsize(path) > held_back
