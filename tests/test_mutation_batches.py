"""Mutations and queries of one claim run in one transaction, each call on its own terms.

A worker runs the calls it claims together in one transaction, first without
savepoints; when one raises, that transaction rolls back whole and runs again
with a savepoint per call. These tests put calls that fail in the same claim as
calls that succeed, and check that each outcome and each write is as if every
call had had a transaction of its own.
"""

from __future__ import annotations

import threading
import time

import pytest

import workpool
from conftest import (
    Recorder,
    UserTable,
    assert_pool_empty,
    background_worker,
    create_table,
    pg_schema_of,
    run_until_idle,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

N = 30


def test_a_failing_mutation_takes_back_only_its_own_writes(app, user_table: UserTable, rec):
    @app.mutation(name="write")
    def write(tx, i: int) -> int:
        rec.add(i=i)
        user_table.insert(tx, f"k{i:02d}")
        if i % 7 == 3:
            raise ValueError(f"planned {i}")
        return i

    pool = app.pool("calls")
    wids = pool.enqueue_mutation_batch(write, [{"i": i} for i in range(N)])
    run_until_idle(app, concurrency=N)  # one claim: one transaction for all of them

    failing = {i for i in range(N) if i % 7 == 3}
    results = [status.result for status in pool.status_batch(wids)]
    assert results == [
        workpool.Failed(f"ValueError: planned {i}") if i in failing else workpool.Success(i)
        for i in range(N)
    ]
    assert user_table.rows() == [(f"k{i:02d}", None) for i in range(N) if i not in failing]
    for i in failing:  # recorded from the first try: a failure is never called again
        assert rec.count(i=i) == 1, i
    assert_pool_empty(pool)


def test_a_database_error_fails_only_its_own_mutation(app, store_url, rec: Recorder):
    table = create_table(app, store_url, "uniq", "k INTEGER PRIMARY KEY")
    p = "%s" if pg_schema_of(store_url) else "?"

    @app.mutation(name="insert_key")
    def insert_key(tx, k: int) -> None:
        tx.execute(f"INSERT INTO {table} (k) VALUES ({p})", (k,))

    pool = app.pool("keys")
    keys = [0, 1, 2, 1, 3, 4, 3, 5]  # the second 1 and the second 3 collide
    wids = pool.enqueue_mutation_batch(insert_key, [{"k": k} for k in keys])
    run_until_idle(app, concurrency=len(keys))

    kinds = [status.result.kind for status in pool.status_batch(wids)]
    assert kinds == ["success"] * 3 + ["failed"] + ["success"] * 2 + ["failed", "success"]
    with app.transaction() as tx:
        stored = [r[0] for r in tx.execute(f"SELECT k FROM {table} ORDER BY k").fetchall()]
    assert stored == [0, 1, 2, 3, 4, 5]


def test_queries_beside_mutations_keep_none_of_their_writes(app, user_table: UserTable):
    @app.mutation(name="keep")
    def keep(tx, i: int) -> None:
        user_table.insert(tx, f"kept{i}")

    @app.query(name="peek")
    def peek(tx, i: int) -> int:
        user_table.insert(tx, f"peeked{i}")  # a query's writes are discarded
        return user_table.count(tx)

    pool = app.pool("mixed")
    wids = []
    for i in range(5):
        wids += pool.enqueue_mutation_batch(keep, [{"i": i}])
        wids += pool.enqueue_query_batch(peek, [{"i": i}])
    run_until_idle(app, concurrency=len(wids))

    results = [status.result for status in pool.status_batch(wids)]
    assert all(r.kind == "success" for r in results), results
    assert user_table.rows() == [(f"kept{i}", None) for i in range(5)]
    # Each query saw the mutations before it and its own write, no other query's.
    assert [r.return_value for r in results[1::2]] == [i + 2 for i in range(5)]


def test_a_batch_of_queries_sees_no_query_writes_and_fails_only_the_bad_ones(
    app, user_table: UserTable
):
    """On PostgreSQL the queries of one claim share one read-only savepoint; a query
    that writes, or whose SQL fails, sends the batch to the redo with a savepoint
    each. Either way each query sees its own writes and no other query's, and a
    failing query fails alone."""
    with app.transaction() as tx:
        user_table.insert(tx, "seed")

    @app.query(name="count")
    def count(tx, i: int) -> int:
        if i == 5:
            raise ValueError("planned")
        return user_table.count(tx)

    @app.query(name="write_and_count")
    def write_and_count(tx, i: int) -> int:
        user_table.insert(tx, f"q{i}")
        return user_table.count(tx)

    @app.query(name="bad_sql")
    def bad_sql(tx, i: int) -> int:
        tx.execute("SELECT no_such_column FROM no_such_table")
        return -1

    pool = app.pool("queries")
    readers = pool.enqueue_query_batch(count, [{"i": i} for i in range(10)])
    run_until_idle(app, concurrency=len(readers))
    assert [s.result for s in pool.status_batch(readers)] == [
        workpool.Failed("ValueError: planned") if i == 5 else workpool.Success(1) for i in range(10)
    ]

    for other in (write_and_count, bad_sql):  # in batches of their own: each sends it to the redo
        wids = []
        for i in range(4):
            wids += pool.enqueue_query_batch(other, [{"i": i}])
            wids += pool.enqueue_query_batch(count, [{"i": 10 + i}])
        run_until_idle(app, concurrency=len(wids))
        results = [s.result for s in pool.status_batch(wids)]
        assert results[1::2] == [workpool.Success(1)] * 4, results  # the seed alone
        if other is write_and_count:
            assert results[0::2] == [workpool.Success(2)] * 4, results  # the seed and its own
        else:
            assert [r.kind for r in results[0::2]] == ["failed"] * 4, results
    assert user_table.rows() == [("seed", None)]


def test_a_batch_that_cannot_commit_still_commits_the_good_calls(app, store_url, rec):
    schema = pg_schema_of(store_url)
    if schema is None:
        pytest.skip("SQLite checks UNIQUE at once; only PostgreSQL can defer it to COMMIT")
    table = create_table(
        app,
        store_url,
        "deferred",
        "k INTEGER, CONSTRAINT one_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED",
    )

    @app.mutation(name="insert_twice")
    def insert_twice(tx, k: int, twice: bool) -> None:
        tx.execute(f"INSERT INTO {table} (k) VALUES (%s)", (k,))
        if twice:  # accepted now, refused at COMMIT
            tx.execute(f"INSERT INTO {table} (k) VALUES (%s)", (k,))

    pool = app.pool("deferred")
    items = [{"k": k, "twice": k == 2} for k in range(5)]
    wids = pool.enqueue_mutation_batch(insert_twice, items)
    good = wids[:2] + wids[3:]
    with background_worker(app, concurrency=len(items)):
        wait_for(lambda: all(s.state == "finished" for s in pool.status_batch(good)), 30)
        assert [s.result.kind for s in pool.status_batch(good)] == ["success"] * 4
        assert pool.status(wids[2]).state != "finished", "it never committed"
    with app.transaction() as tx:
        stored = [r[0] for r in tx.execute(f"SELECT k FROM {table} ORDER BY k").fetchall()]
    assert stored == [0, 1, 3, 4]


def test_a_slow_mutation_leaves_the_other_slots_to_work(app, store_url, rec: Recorder):
    if pg_schema_of(store_url) is None:
        pytest.skip("SQLite has one writer: a mutation's transaction holds up every claim")
    release = threading.Event()

    @app.mutation(name="slow")
    def slow(tx) -> None:
        release.wait(20)

    @app.action(name="quick")
    def quick(i: int) -> None:
        rec.add(i=i)

    pool = app.pool("mixed")
    slow_id = pool.enqueue_mutation(slow)
    with background_worker(app, concurrency=4):
        wait_for(lambda: pool.status(slow_id).state == "running", 10)
        wids = pool.enqueue_action_batch(quick, [{"i": i} for i in range(6)])
        # Three slots are free while the mutation runs: the actions go through them.
        wait_for(lambda: all(s.state == "finished" for s in pool.status_batch(wids)), 15)
        assert not release.is_set() and pool.status(slow_id).state == "running"
        release.set()
        wait_for(lambda: pool.status(slow_id).state == "finished", 15)
    assert pool.status(slow_id).result == workpool.Success(None)


@pytest.mark.parametrize("kind", ["action", "mutation"])
def test_a_worker_running_one_call_at_a_time_starts_the_next_without_the_idle_poll(app, kind: str):
    """While every slot of a worker is busy its dispatcher is parked and the watcher
    lets commits pass: the transaction that records the call must wake it, or work
    enqueued next waits for the 1 s fallback poll."""
    started: list[float] = []

    @app.action(name="slow_action")
    def slow_action(i: int) -> None:
        started.append(time.time())
        time.sleep(0.05)

    @app.mutation(name="slow_mutation")
    def slow_mutation(tx, i: int) -> None:
        started.append(time.time())
        time.sleep(0.05)

    pool = app.pool("one_at_a_time")
    fn = slow_action if kind == "action" else slow_mutation
    enqueue = pool.enqueue_action if kind == "action" else pool.enqueue_mutation
    lags = []
    with background_worker(app, concurrency=1):
        for i in range(6):
            t0 = time.time()
            wid = enqueue(fn, {"i": i})
            wait_for(lambda wid=wid: pool.status(wid).state == "finished", timeout=10)
            lags.append(started[-1] - t0)
    # The fallback poll is 1 s; a wake-up starts each far sooner.
    assert sorted(lags)[3] < 0.5, lags
