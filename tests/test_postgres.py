"""PostgreSQL only: the user's own connection, wake-ups, cut connections, migrations."""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

import workpool
from conftest import (
    background_worker,
    create_table,
    end_and_claim,
    pg_schema_of,
    record_and_claim,
    run_until_idle,
    wait_for,
)
from workpool.store.url import open_store

pytestmark = pytest.mark.parametrize("store_url", ["postgres"], indirect=True)


@pytest.fixture
def pg_url(store_url: str) -> str:
    return store_url


def _conninfo(url: str) -> str:
    return url.split("?", 1)[0]


@pytest.fixture
def pg_app(pg_url: str) -> Any:
    app = workpool.App(pg_url)
    yield app
    app.stop_workers()
    app.close()


def test_enqueue_with_the_users_own_connection_commits_and_rolls_back_with_it(
    pg_app: Any, pg_url: str
) -> None:
    schema = pg_schema_of(pg_url)
    ran: list[int] = []

    @pg_app.action
    def note(n: int) -> None:
        ran.append(n)

    pool = pg_app.pool("own")
    pool.stats()  # creates the schema
    with psycopg.connect(_conninfo(pg_url)) as conn:
        conn.execute(f'CREATE TABLE "{schema}".orders (n int)')
        conn.execute(f'INSERT INTO "{schema}".orders VALUES (1)')
        kept = pool.enqueue_action(note, {"n": 1}, tx=conn)
        assert pool.status(kept, tx=conn).state == "pending"
        conn.commit()
        conn.execute(f'INSERT INTO "{schema}".orders VALUES (2)')
        dropped = pool.enqueue_action(note, {"n": 2}, tx=conn)
        conn.rollback()
    assert pool.status(kept).state == "pending"
    assert pool.status(dropped) == workpool.Finished(None)
    run_until_idle(pg_app)
    assert ran == [1]
    with psycopg.connect(_conninfo(pg_url)) as conn:
        rows = conn.execute(f'SELECT n FROM "{schema}".orders').fetchall()
    assert rows == [(1,)]


def test_cancel_with_the_users_connection(pg_app: Any, pg_url: str) -> None:
    @pg_app.action
    def never() -> None:
        raise AssertionError("canceled work ran")

    pool = pg_app.pool("own_cancel")
    wid = pool.enqueue_action(never, {}, run_after=60)
    with psycopg.connect(_conninfo(pg_url)) as conn:
        assert pool.cancel(wid, tx=conn) is True
        conn.rollback()
    assert pool.status(wid).state == "pending"
    with psycopg.connect(_conninfo(pg_url)) as conn:
        assert pool.cancel(wid, tx=conn) is True
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())


def test_single_cancels_keep_one_generic_plan(pg_app: Any, pg_url: str) -> None:
    """Over a one-element array a statement looks cheaper planned for its values, so
    PostgreSQL planned the read of every single cancel anew. With one parameter for
    the one id it settles on one generic plan."""
    pg_app.action(name="f")(lambda: None)
    pool = pg_app.pool("planned")
    with psycopg.connect(_conninfo(pg_url)) as conn:
        if conn.info.server_version < 140000:
            pytest.skip("pg_prepared_statements counts plans from PostgreSQL 14")
        ids = pool.enqueue_action_batch("f", [{}] * 20, run_after=60)
        for wid in ids:
            assert pool.cancel(wid, tx=conn)
        plans = conn.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
        ).fetchall()
    # psycopg prepares a statement at its 6th run; the server plans it for its
    # values the next 5 times, then keeps the generic plan if that is no dearer.
    (generic, custom) = next((g, c) for sql, g, c in plans if "FOR UPDATE" in sql)
    assert (generic, custom) == (10, 5), f"{generic} generic, {custom} custom plans"


def test_idle_worker_is_woken_by_notification_not_the_fallback_poll(pg_app: Any) -> None:
    started: list[float] = []

    @pg_app.action
    def mark() -> None:
        started.append(time.time())

    pool = pg_app.pool("wake")
    pool.stats()
    lags = []
    with background_worker(pg_app):
        time.sleep(0.3)  # the worker is idle, waiting on LISTEN
        for i in range(5):
            t0 = time.time()
            pool.enqueue_action(mark, {})
            wait_for(lambda i=i: len(started) > i, timeout=5)
            lags.append(started[i] - t0)
    # The fallback poll is 1 s; a notification wakes the worker far sooner.
    assert sorted(lags)[2] < 0.5, lags


def test_workers_survive_their_connections_being_killed(pg_app: Any, pg_url: str) -> None:
    done: set[int] = set()
    lock = threading.Lock()

    @pg_app.action
    def work(n: int) -> int:
        time.sleep(0.005)
        with lock:
            done.add(n)
        return n

    @pg_app.mutation
    def count(tx: Any, work_id: str, context: Any, result: Any) -> None:
        schema = pg_schema_of(pg_url)
        tx.execute(f'INSERT INTO "{schema}".completions VALUES (%s, %s)', (work_id, result.kind))

    pool = pg_app.pool("cut", max_parallelism=8)
    pool.stats()
    schema = pg_schema_of(pg_url)
    with pg_app.transaction() as tx:
        tx.execute(f'CREATE TABLE "{schema}".completions (work_id text, kind text)')
    ids = pool.enqueue_action_batch(
        work, [{"n": i} for i in range(400)], on_complete=count, retry=True
    )
    with background_worker(pg_app, concurrency=8, lease=3.0):
        for mark in (50, 150, 250):
            wait_for(lambda mark=mark: len(done) > mark, timeout=20)
            with psycopg.connect(_conninfo(pg_url), autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'workpool' AND pid <> pg_backend_pid()"
                )
            time.sleep(0.2)
        wait_for(lambda: all(s.state == "finished" for s in pool.status_batch(ids)), timeout=60)
    statuses = pool.status_batch(ids)
    assert all(isinstance(s.result, workpool.Success) for s in statuses), statuses[:3]
    with pg_app.transaction() as tx:
        rows = tx.execute(
            f'SELECT count(*), count(DISTINCT work_id) FROM "{schema}".completions'
        ).fetchone()
    assert rows == (400, 400)  # on_complete exactly once each, despite the cuts


def test_migrations_are_safe_when_many_processes_start_at_once(pg_url: str) -> None:
    apps = [workpool.App(pg_url) for _ in range(6)]
    errors: list[BaseException] = []

    def start(app: Any) -> None:
        try:
            app.pool("m").stats()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(a,)) for a in apps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for app in apps:
        app.close()
    assert errors == []


def test_schema_names_are_validated(pg_url: str) -> None:
    with pytest.raises(ValueError, match="schema"):
        workpool.App("postgresql://postgres@127.0.0.1/test", schema='x"; DROP TABLE y; --')


def _prepared_after_statuses(url: str) -> int:
    """How many statements the one connection of an App on ``url`` has prepared on
    the server after 8 enqueues and 8 status reads of the same shape."""
    app = workpool.App(url)
    try:
        app.action(name="f")(lambda: None)
        pool = app.pool("prepared")
        for wid in [pool.enqueue_action("f", {}, run_after=60) for _ in range(8)]:
            assert isinstance(pool.status(wid), workpool.Pending)
        with app.transaction() as tx:
            return int(tx.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0])
    finally:
        app.close()


def test_prepare_threshold_none_leaves_no_statement_prepared_on_the_server(pg_url: str) -> None:
    """psycopg prepares a statement at its 6th run on a connection; behind a
    PgBouncer in transaction mode the next transaction may find another server
    connection, where that name is unknown. ``?prepare_threshold=none`` turns it off."""
    sep = "&" if "?" in pg_url else "?"
    assert _prepared_after_statuses(f"{pg_url}{sep}pool_size=1") > 0
    assert _prepared_after_statuses(f"{pg_url}{sep}pool_size=1&prepare_threshold=none") == 0


def test_a_client_making_one_call_at_a_time_keeps_one_connection(pg_url: str) -> None:
    """The pool's first connection is waited for before the first call takes it: a
    call that waited for it in the pool made the pool open a second connection,
    and a client making one call at a time then spread its calls over two server
    processes, each parsing and planning its first statements anew."""
    name = f"workpool-one-{uuid.uuid4().hex[:12]}"
    sep = "&" if "?" in pg_url else "?"
    app = workpool.App(f"{pg_url}{sep}application_name={name}")
    try:
        app.action(name="f")(lambda: None)
        pool = app.pool("one")
        ids = [pool.enqueue_action("f", {}, run_after=60) for _ in range(5)]
        assert all(isinstance(s, workpool.Pending) for s in pool.status_batch(ids))
        for wid in ids:
            pool.status(wid)
        with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
            (count,) = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchone()
        assert count == 1
    finally:
        app.close()


def _deadlocks(pg_url: str) -> int:
    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0])


def test_workers_serving_several_pools_never_deadlock_on_claims(pg_url: str) -> None:
    """Claims lock pools in one global order: two workers on two pools never deadlock."""
    apps = [workpool.App(pg_url) for _ in range(3)]
    for app in apps:

        @app.action(name="noop")
        def noop() -> None:
            return None

    ids = {
        name: apps[0].pool(name, max_parallelism=50).enqueue_action_batch("noop", [{}] * 300)
        for name in ("a", "b")
    }
    before = _deadlocks(pg_url)
    workers = [
        threading.Thread(
            target=app.run_worker, kwargs={"concurrency": 20, "until_idle": True, "lease": 3.0}
        )
        for app in apps
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(120)
    try:
        assert not any(t.is_alive() for t in workers), "workers did not drain"
        for name, wids in ids.items():
            statuses = apps[0].pool(name).status_batch(wids)
            assert all(s == workpool.Finished(workpool.Success(None)) for s in statuses)
        assert _deadlocks(pg_url) == before
    finally:
        for app in apps:
            app.stop_workers()
            app.close()


def test_user_transaction_after_idle_connections_were_cut(pg_app: Any, pg_url: str) -> None:
    pool = pg_app.pool("cut_idle")
    pool.stats()  # opens pooled connections, now idle
    with psycopg.connect(_conninfo(pg_url), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'workpool' AND pid <> pg_backend_pid()"
            " AND state = 'idle'"
        )
    with pg_app.transaction() as tx:  # begins on a live connection, not the dead one
        assert tx.execute("SELECT 1").fetchone() == (1,)


def test_own_reads_without_a_snapshot_run_outside_any_transaction(pg_app: Any) -> None:
    """``snapshot=False`` reads (status, the worker's idle checks) send no BEGIN and
    no COMMIT; a read-only transaction with a snapshot, as a query gets, keeps its
    BEGIN READ ONLY guard."""
    from psycopg.pq import TransactionStatus

    @pg_app.action(name="job")
    def job() -> None:
        pass

    pool = pg_app.pool("bare", max_parallelism=1)
    wid = pool.enqueue_action(job)
    store = pg_app.store

    def state(tx: workpool.Tx) -> tuple[TransactionStatus, str]:
        row = tx.execute("SELECT current_setting('transaction_read_only')").fetchone()
        return tx.raw.info.transaction_status, row[0]

    assert store.run(state, readonly=True, snapshot=False) == (TransactionStatus.IDLE, "off")
    assert store.run(state, readonly=True) == (TransactionStatus.INTRANS, "on")
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        store.run(lambda tx: tx.execute("CREATE TABLE nope (x int)"), readonly=True)
    # The status read runs this way and still answers.
    assert pool.status(wid).state == "pending"
    assert pool.status(wid).reason == "due"


def test_on_complete_with_copy_runs_once_and_leaves_the_pipeline(pg_app: Any, pg_url: str) -> None:
    """A handler using COPY cannot run in a pipeline: its first batch is redone with
    a savepoint per handler, and later batches of that action skip the pipeline
    rather than run their handlers twice each."""
    from workpool.core.decide import Succeeded
    from workpool.runtime.worker import Worker, WorkerOptions

    table = f'"{pg_schema_of(pg_url)}".copied'
    calls: list[str] = []

    @pg_app.action(name="job")
    def job() -> None:
        pass

    @pg_app.mutation(name="copy_it")
    def copy_it(tx: Any, work_id: str, context: Any, result: Any) -> None:
        calls.append(work_id)
        with tx.connection.cursor() as cur, cur.copy(f"COPY {table} (k) FROM STDIN") as copy:
            copy.write_row((work_id,))

    pool = pg_app.pool("copying", max_parallelism=10)
    with pg_app.transaction() as tx:
        tx.execute(f"CREATE TABLE {table} (k text)")
    worker = Worker(pg_app.store, pg_app.registry, WorkerOptions(pools=["copying"]))
    store = pg_app.store

    def one_batch() -> list[str]:
        ids = pool.enqueue_action_batch(job, [{}] * 3, on_complete=copy_it)
        now = time.time()
        claimed = store.run(lambda tx: store.claim(tx, "copying", 10, worker.info.id, now))
        assert sorted(w.id for w in claimed) == sorted(ids)
        worker._record([(work, Succeeded(None), 0.0) for work in claimed])
        return ids

    first = one_batch()
    assert len(calls) == 4  # the pipelined pass got as far as the first COPY
    second = one_batch()
    assert len(calls) == 7  # no pipelined pass this time
    with pg_app.transaction() as tx:
        rows = sorted(r[0] for r in tx.execute(f"SELECT k FROM {table}").fetchall())
    assert rows == sorted(first + second)
    for wid in first + second:
        assert pool.status(wid) == workpool.Finished(workpool.Success(None))


def test_a_worker_refreshes_statistics_that_say_the_queue_is_empty(pg_app: Any) -> None:
    """Plans of prepared statements keep the statistics they were made with. Made
    after a VACUUM met an empty queue, they scan the whole table once it fills (a
    burst after an idle minute drained at a fifth of the speed), so a maintenance
    pass checks the statistics against the table and runs ANALYZE when they are off."""
    from workpool.runtime.worker import Worker, WorkerOptions

    @pg_app.action(name="job")
    def job(i: int) -> None:
        pass

    pool = pg_app.pool("bursty")
    pool.stats()  # creates the schema
    store = pg_app.store
    table = f"{store.table_prefix}work"

    def reltuples() -> float:
        sql = "SELECT reltuples FROM pg_class WHERE oid = %s::regclass"
        return float(store.run(lambda tx: tx.execute(sql, (table,)).fetchone()[0]))

    store.tidy()  # the VACUUM (ANALYZE) of an idle queue
    assert reltuples() == 0
    assert not store.upkeep().analyze, "a near-empty table plans alike whatever they say"
    pool.enqueue_action_batch(job, [{"i": i} for i in range(5000)], run_after=600)
    assert store.upkeep().analyze
    now = time.time()
    worker = Worker(store, pg_app.registry, WorkerOptions(pools=["bursty"]), lambda: now)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}
    worker.maintenance.tick(now)
    assert reltuples() == 5000
    assert not store.upkeep().analyze


def test_a_worker_vacuums_the_queue_once_many_rows_have_moved_on(
    pg_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim's index scans walk every dead entry of rows that have been claimed or
    finished since the last VACUUM (a claim of 512 took 13 ms after one and 97 ms
    300,000 jobs later), and autovacuum comes at most once a minute: a maintenance
    pass vacuums ``work`` itself once it holds many dead rows."""
    import workpool.store.postgres.store as pg_store
    from workpool.runtime.worker import Worker, WorkerOptions

    monkeypatch.setattr(pg_store, "VACUUM_DEAD_ROWS", 300)

    @pg_app.action(name="job")
    def job(i: int) -> None:
        pass

    pool = pg_app.pool("churning")
    store = pg_app.store
    table = f"{store.table_prefix}work"

    def vacuums_and_dead() -> tuple[int, int]:
        sql = "SELECT pg_stat_get_vacuum_count(%s::regclass), pg_stat_get_dead_tuples(%s::regclass)"
        row = store.run(lambda tx: tx.execute(sql, (table, table)).fetchone())
        return int(row[0]), int(row[1])

    ids = pool.enqueue_action_batch(job, [{"i": i} for i in range(400)])
    with pg_app.transaction() as tx:
        # 400 deleted rows, reported to the statistics at once rather than within a second.
        tx.execute(f"DELETE FROM {table} WHERE id = ANY(%s)", (ids,))
        tx.execute("SELECT pg_stat_force_next_flush()")
    before, dead = vacuums_and_dead()
    assert dead >= 400 and store.upkeep().vacuum
    now = time.time()
    worker = Worker(store, pg_app.registry, WorkerOptions(pools=["churning"]), lambda: now)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}
    worker.maintenance.tick(now)
    after, dead = vacuums_and_dead()
    assert after == before + 1 and dead == 0
    assert not store.upkeep().vacuum


def test_a_cancel_all_page_reads_its_page_even_before_any_statistics(pg_url: str) -> None:
    """A backlog enqueued in one transaction has no statistics yet. From about 150k
    rows, a page query over both states at once (state IN ...) was then planned as a
    bitmap scan that read every pending row's index entry for each page of 64:
    cancel_all of 200k items took 89 s instead of 15. Each state's range is now read
    on its own and stops at the page."""
    app = workpool.App(pg_url)

    @app.action(name="job")
    def job(i: int) -> None:
        pass

    pool = app.pool("backlog")
    pool.enqueue_action_batch(job, [{"i": i} for i in range(150_000)], run_after=600)
    schema = pg_schema_of(pg_url) or "workpool"
    read = (
        "SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
        " WHERE schemaname = %s AND indexrelname = 'work_due'"
    )
    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        assert conn.execute(
            "SELECT reltuples FROM pg_class WHERE oid = %s::regclass", (f'"{schema}".work',)
        ).fetchone() == (-1,), "the backlog should have no statistics yet"
        before = conn.execute(read, (schema,)).fetchone()[0]
        assert pool.cancel_all(limit=64) == 64
        app.close()  # its connections end, and their backends report what they read
        after = wait_for(lambda: (n := conn.execute(read, (schema,)).fetchone()[0]) > before and n)
    assert after - before < 500, f"one page of 64 read {after - before} index entries"


def test_a_claim_stops_at_its_bytes_of_args_and_says_the_pool_may_have_more(
    pg_app: Any,
) -> None:
    """One worker that claimed every due row of a pool of big payloads read and
    decoded them alone while the others' slots stayed empty: a claim takes rows
    while their args stay within CLAIM_BYTES (always one), on one pool or many."""
    from workpool.store.postgres.store import CLAIM_BYTES

    @pg_app.action(name="big")
    def big(blob: str) -> None:
        pass

    blob = "x" * 900_000
    size = len(json.dumps({"blob": blob}))
    fits = -(-CLAIM_BYTES // size)  # rows whose args before them are under the limit
    assert 1 < fits < 10
    for name in ("heavy", "heavy2"):
        pg_app.pool(name, max_parallelism=100).enqueue_action_batch(big, [{"blob": blob}] * 10)
    store = pg_app.store
    now = time.time() + 1

    first = store.run(lambda tx: store.claim(tx, "heavy", 10, "w", now))
    assert len(first) == fits
    assert store.claim_cut(first)
    rest = store.run(lambda tx: store.claim(tx, "heavy", 10, "w", now))
    assert len(rest) == 10 - fits
    assert store.run(lambda tx: store.claim(tx, "heavy", 10, "w", now)) == []
    assert not store.claim_cut([])

    pg_app.pool("heavy", max_parallelism=100).enqueue_action_batch(big, [{"blob": "small"}] * 3)
    answer = store.run(lambda tx: store.claim_many_later(tx, {"heavy": 10, "heavy2": 10}, "w", now))
    got = answer()
    assert len(got["heavy"]) == 3  # small args: the asked limit, not the bytes, stops it
    assert not store.claim_cut(got["heavy"])
    assert len(got["heavy2"]) == fits
    assert store.claim_cut(got["heavy2"])


def test_a_claim_counts_the_contexts_it_reads_for_handlers_in_its_bytes(pg_app: Any) -> None:
    """A claim reads a handler's context with the args, so CLAIM_BYTES counts it:
    small args with big contexts stop a claim as big args do, while a big context
    without a handler (never read by the claim) does not count."""
    from workpool.store.postgres.store import CLAIM_BYTES

    @pg_app.action(name="small")
    def small() -> None:
        pass

    @pg_app.mutation(name="handler")
    def handler(tx: Any, work_id: str, context: Any, result: Any) -> None:
        pass

    blob = "c" * 900_000
    size = len(json.dumps(blob)) + len("{}")
    fits = -(-CLAIM_BYTES // size)
    assert 1 < fits < 10
    handled = pg_app.pool("handled", max_parallelism=100)
    handled.enqueue_action_batch(small, [{}] * 10, on_complete=handler, context=blob)
    unhandled = pg_app.pool("unhandled", max_parallelism=100)
    unhandled.enqueue_action_batch(small, [{}] * 10, context=blob)
    store = pg_app.store
    now = time.time() + 1

    first = store.run(lambda tx: store.claim(tx, "handled", 10, "w", now))
    assert len(first) == fits
    assert all(w.context == json.dumps(blob) for w in first)
    assert store.claim_cut(first)
    got = store.run(lambda tx: store.claim(tx, "unhandled", 10, "w", now))
    assert len(got) == 10 and all(w.context is None for w in got)
    assert not store.claim_cut(got)


def test_a_claim_reads_big_payloads_after_its_commit_with_the_claim_lock_free(
    pg_app: Any, pg_url: str
) -> None:
    """A claim returns small args and contexts itself; bigger ones (over
    CLAIM_INLINE_BYTES together) are read after its COMMIT, when the pool's claim
    lock is free for other workers' claims, and arrive whole."""
    from workpool.store.postgres.store import CLAIM_INLINE_BYTES

    @pg_app.action(name="job")
    def job(blob: str) -> None:
        pass

    @pg_app.mutation(name="handler")
    def handler(tx: Any, work_id: str, context: Any, result: Any) -> None:
        pass

    big, small = "b" * (CLAIM_INLINE_BYTES + 1), "s" * 100
    pool = pg_app.pool("payloads", max_parallelism=100)
    pool.enqueue_action(job, {"blob": big}, on_complete=handler, context=big)
    pool.enqueue_action(job, {"blob": big})
    pool.enqueue_action(job, {"blob": small}, on_complete=handler, context=small)
    pool.enqueue_action(job, {"blob": small}, context=big)  # no handler: no context
    store = pg_app.store
    answer = store.run(lambda tx: store.claim_later(tx, "payloads", 10, "w", time.time() + 1))

    lock_free: list[bool] = []
    run = store.run

    def watched(fn: Any, **kw: Any) -> Any:
        with psycopg.connect(_conninfo(pg_url), autocommit=True) as other:
            got = other.execute(
                "SELECT pg_try_advisory_lock(hashtext(%s), hashtext(%s))",
                (store.schema, "payloads"),
            ).fetchone()
            lock_free.append(bool(got and got[0]))
            other.execute("SELECT pg_advisory_unlock_all()")
        return run(fn, **kw)

    store.run = watched
    try:
        claimed = answer()
    finally:
        del store.run
    assert lock_free == [True]  # one read, after the COMMIT, for the two big rows
    got = sorted((json.loads(w.args)["blob"], w.context or "") for w in claimed)
    want = [(big, json.dumps(big)), (big, ""), (small, json.dumps(small)), (small, "")]
    assert got == sorted(want)


def test_payloads_are_compressed_with_lz4_where_the_server_has_it(pg_app: Any) -> None:
    """pglz compressed 800 KB of args in 6.5 ms, lz4 in 1.1 ms (and reads back faster):
    the migrations set lz4 on the payload columns when the server supports it."""
    pg_app.pool("any").stats()  # creates the schema
    store = pg_app.store
    try:
        store.run(lambda tx: tx.execute("CREATE TEMP TABLE probe (x text COMPRESSION lz4)"))
    except Exception:
        pytest.skip("this PostgreSQL server was built without lz4")
    sql = (
        "SELECT attrelid::regclass::text, attname, attcompression FROM pg_attribute"
        " WHERE attrelid IN (%s::regclass, %s::regclass, %s::regclass)"
        " AND attname IN ('args', 'context', 'result')"
    )
    tables = [f"{store.table_prefix}{t}" for t in ("work", "finished", "payloads")]
    rows = store.run(lambda tx: tx.execute(sql, tables).fetchall())
    work = [("args", "l"), ("context", "l"), ("result", "l")]
    finished, payloads = [("args", "l"), ("result", "l")], [("args", "l"), ("context", "l")]
    assert sorted((name, c) for _, name, c in rows) == sorted([*work, *finished, *payloads])


def test_args_over_inline_chars_are_written_once_and_pruned_with_their_finished_row(
    pg_app: Any,
) -> None:
    """Args and context over INLINE_CHARS go to payloads at enqueue, the work row
    keeping their size for a claim's budget; the job and its handler get them, the
    finished row does not copy them (it reads them there), and the pool's cleanup
    deletes them with it. Smaller ones stay in the rows as before."""
    from workpool.store.postgres.store import INLINE_CHARS

    ran: list[Any] = []

    @pg_app.action(name="job")
    def job(blob: str) -> str:
        ran.append(blob)
        return "ok"

    @pg_app.mutation(name="handler")
    def handler(tx: Any, work_id: str, context: Any, result: Any) -> None:
        ran.append(context)

    store = pg_app.store
    s = store.table_prefix
    big_args, context = {"blob": "b" * INLINE_CHARS}, {"c": "c" * 100}
    pool = pg_app.pool("apart", max_parallelism=10)
    big = pool.enqueue_action(job, big_args, on_complete=handler, context=context)
    small = pool.enqueue_action(job, {"blob": "s"})
    size = len(json.dumps(big_args, separators=(",", ":"))) + len(
        json.dumps(context, separators=(",", ":"))
    )

    def rows(sql: str) -> list[Any]:
        return store.run(lambda tx: tx.execute(sql.format(s=s)).fetchall())

    work = dict((r[0], r[1:]) for r in rows("SELECT id, args IS NULL, payload_bytes FROM {s}work"))
    assert work == {big: (True, size), small: (False, None)}
    assert [r[0] for r in rows("SELECT id FROM {s}payloads")] == [big]
    assert pg_app.inspect(big).args == big_args
    pg_app.run_worker(pools=["apart"], until_idle=True)
    assert sorted(map(str, ran)) == sorted(["b" * INLINE_CHARS, "s", str(context)])
    finished = dict(rows("SELECT id, args IS NULL FROM {s}finished"))
    assert finished == {big: True, small: False}
    assert pg_app.inspect(big).args == big_args
    assert pg_app.inspect(small).args == {"blob": "s"}
    assert store.run(lambda tx: store.prune(tx, "apart", time.time() + 1, 10)) == 2
    assert rows("SELECT id FROM {s}finished") == rows("SELECT id FROM {s}payloads") == []


def test_a_statement_held_in_a_pipeline_is_not_sent_after_its_transaction(
    pg_app: Any,
) -> None:
    """A cursor of a statement that ``tx.execute`` held back and whose transaction
    rolled back says so when used, and the statement never runs."""
    store = pg_app.store
    kept: list[Any] = []

    def body(tx: Any) -> None:
        with store.pipeline(tx):
            with tx.execute("SELECT 2") as cur:  # a psycopg cursor's context manager
                assert cur.fetchone() == (2,)
            kept.append(tx.execute("SELECT 1"))
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError, match="roll back"):
        store.run(body)
    with pytest.raises(RuntimeError, match="transaction ended before the cursor was used"):
        kept[0].fetchone()


@pytest.mark.parametrize(
    ("sql", "form"),
    [
        ("INSERT INTO t (k) VALUES (%s)", ("INSERT INTO t (k) VALUES ", "(%s)", 1)),
        (
            'insert into "s".t(k, v, at) values (%s, coalesce(%s, 1), now());',
            ('insert into "s".t(k, v, at) values ', "(%s, coalesce(%s, 1), now())", 2),
        ),
        ("INSERT INTO t VALUES (%b, %t)", ("INSERT INTO t VALUES ", "(%b, %t)", 2)),
        ("INSERT INTO t (k) VALUES (%s) RETURNING k", None),
        ("INSERT INTO t (k) VALUES (%s) ON CONFLICT DO NOTHING", None),
        ("INSERT INTO t (k) VALUES (%s), (%s)", None),
        ("INSERT INTO t (k) VALUES (%s)) , ((%s)", None),
        ("INSERT INTO t (k) VALUES (%(k)s)", None),
        ("INSERT INTO t (k) VALUES ('%s')", None),
        ("INSERT INTO t (k) VALUES (%s -- note\n)", None),
        ("INSERT INTO t (k) VALUES (%s); DELETE FROM t", None),
        ("INSERT INTO t (k) VALUES (%s || '%%')", None),
        ("INSERT INTO t (k) SELECT %s", None),
        ("UPDATE t SET k = %s", None),
    ],
)
def test_only_a_plain_one_row_insert_is_sent_as_rows_of_one_statement(
    pg_url: str, sql: str, form: tuple[str, str, int] | None
) -> None:
    from workpool.store.postgres.store import insert_rows_form

    assert insert_rows_form(sql) == form


def test_rows_of_one_insert_keep_their_values_types_and_order(pg_app: Any, pg_url: str) -> None:
    """Held INSERTs sent as rows of statements of 2**k rows (3 parameters a row, so
    300 = 18 * 16 + 8 + 4): every row once, in order, each value cast to its own
    column as a one-row INSERT would (integers of every size, NULLs, JSON)."""
    store = pg_app.store
    table = create_table(pg_app, pg_url, "rows_t", "n serial, k bigint, v text, j jsonb")
    values = [
        (i * 10_000_000 if i % 7 == 0 else i, None if i % 5 == 0 else f"v{i}") for i in range(300)
    ]

    def body(tx: workpool.Tx) -> None:
        with store.pipeline(tx):
            for k, v in values:
                tx.execute(
                    f"INSERT INTO {table} (k, v, j) VALUES (%s, %s, %s::jsonb)",
                    (k, v, json.dumps({"k": k})),
                )

    store.run(body)
    with pg_app.transaction() as tx:
        rows = tx.execute(f"SELECT k, v, j FROM {table} ORDER BY n").fetchall()
    assert [(r[0], r[1]) for r in rows] == values
    assert [r[2] for r in rows] == [{"k": k} for k, _ in values]


def test_rows_of_one_insert_go_in_statements_psycopg_parses_once(pg_app: Any, pg_url: str) -> None:
    """Each statement of rows has at most 50 parameters, the most psycopg keeps the
    parsing of in its cache (a statement of 512 rows was parsed anew at every call):
    100 rows of one column go as 32 + 32 + 32 + 4, rows of 60 columns one at a time,
    and every row arrives."""
    store = pg_app.store
    narrow = create_table(pg_app, pg_url, "rows_narrow", "n serial, k bigint")
    wide = create_table(
        pg_app, pg_url, "rows_wide", "n serial, " + ", ".join(f"c{i} int" for i in range(60))
    )
    sent: list[int] = []

    class Counting:
        """The driver's connection, counting each statement's parameters."""

        def __init__(self, conn: Any) -> None:
            self.conn = conn

        def execute(self, sql: str, params: Any) -> Any:
            sent.append(len(params))
            return self.conn.execute(sql, params)

    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        store.send_rows(
            Counting(conn), f"INSERT INTO {narrow} (k) VALUES (%s)", [(i,) for i in range(100)]
        )
        assert sent == [32, 32, 32, 4]
        sent.clear()
        columns = ", ".join(f"c{i}" for i in range(60))
        marks = ", ".join(["%s"] * 60)
        store.send_rows(
            Counting(conn),
            f"INSERT INTO {wide} ({columns}) VALUES ({marks})",
            [tuple(range(r, r + 60)) for r in range(3)],
        )
        assert sent == [60, 60, 60]
        assert [r[0] for r in conn.execute(f"SELECT k FROM {narrow} ORDER BY n")] == list(
            range(100)
        )
        assert conn.execute(f"SELECT c0, c59 FROM {wide} ORDER BY n").fetchall() == [
            (r, r + 59) for r in range(3)
        ]


def test_each_claim_definition_gets_its_own_function_and_both_claim(pg_url: str) -> None:
    """The claim function is named by a hash of its definition: a process whose
    claim SQL differs (another workpool version) creates its own beside the first
    at migrate, replaces nothing, and both claim; migrating again adds nothing."""
    from workpool.store.postgres import PostgresStore

    schema = pg_schema_of(pg_url)
    first = open_store(pg_url)
    first.migrate()
    other = PostgresStore(pg_url, schema=schema or "workpool")
    other._RETURNED = first._RETURNED.replace("8192", "8191")  # a later version's SQL
    assert other._claim_function[0] != first._claim_function[0]

    def functions() -> dict[str, str]:
        with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p"
                " JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = %s AND p.proname LIKE 'claim\\_%%'",
                (schema,),
            ).fetchall()
        return dict(rows)

    before = functions()
    assert len(before) == 1
    other.migrate()
    open_store(pg_url).migrate()
    after = functions()
    assert len(after) == 2
    assert {k: v for k, v in after.items() if k in before} == before, "the first one is kept"
    assert "8191" in after[other._claim_function[0].split(".")[1]]

    app = workpool.App(pg_url)
    app.action(name="nap")(lambda: None)
    try:
        app.pool("both", max_parallelism=10).enqueue_action_batch("nap", [{} for _ in range(4)])
    finally:
        app.close()
    now = time.time() + 1
    got = [
        store.run(lambda tx, store=store, w=w: store.claim(tx, "both", 2, w, now))
        for store, w in ((first, "w1"), (other, "w2"))
    ]
    assert [len(g) for g in got] == [2, 2]
    assert len({w.id for g in got for w in g}) == 4
    for store in (first, other):
        store.close()


def test_a_record_of_successes_that_claims_is_one_call_of_the_record_claim_function(
    pg_app: Any, pg_url: str
) -> None:
    """A transaction of a finish of successes and a claim, and nothing else, runs as
    one call of the record-and-claim function (what it does is checked on both
    stores in test_commit_batching): with the function dropped, it fails."""
    from workpool.core.results import success_json

    @pg_app.action
    def noop() -> None:
        pass

    pool = pg_app.pool("fused", max_parallelism=1)
    ids = pool.enqueue_action_batch(noop, [{}, {}])
    store = pg_app.store
    (first,) = store.run(lambda tx: store.claim(tx, "fused", 1, "w1", time.time()))
    done, claimed, roles = record_and_claim(store, "fused", first.id, success_json("7"))
    assert roles == ["finish", "claim"]
    assert done == [(first.id, 1)] and [w.id for w in claimed] == [ids[1]]

    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        conn.execute(f"DROP FUNCTION {store._record_claim_function[0]}")
    with pytest.raises(psycopg.errors.UndefinedFunction):
        record_and_claim(store, "fused", ids[1], success_json("7"))
    assert pool.status(ids[1]).state == "running", "the failed call changed nothing"


def test_an_end_and_a_claim_are_one_call_of_the_end_claim_function(
    pg_app: Any, pg_url: str
) -> None:
    """A transaction of ``end_attempt`` and a claim, and nothing else (a hand-over at
    a pool's limit), runs as one call of the end-and-claim function (what it does is
    checked on both stores in test_commit_batching): with the function dropped, it
    fails and changes nothing."""

    @pg_app.action
    def noop() -> None:
        pass

    pool = pg_app.pool("handed", max_parallelism=1)
    ids = pool.enqueue_action_batch(noop, [{}, {}, {}])
    store = pg_app.store

    (first,) = store.run(lambda tx: store.claim(tx, "handed", 1, "w1", time.time()))
    ended, claimed, roles = end_and_claim(store, first, "handed")
    assert roles == ["end", "claim"]
    assert ended is not None and ended.state == "ended" and ended.place != first.place
    assert [w.id for w in claimed] == [ids[1]]

    with psycopg.connect(_conninfo(pg_url), autocommit=True) as conn:
        conn.execute(f"DROP FUNCTION {store._end_claim_function[0]}")
    with pytest.raises(psycopg.errors.UndefinedFunction):
        end_and_claim(store, claimed[0], "handed")
    assert pool.status(ids[1]).state == "running", "the failed call changed nothing"
    assert pool.status(ids[2]).state == "pending"
