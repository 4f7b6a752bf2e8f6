"""PRODUCT.md §3: on_complete exactly once, in the finishing transaction; mutations; queries."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest

import workpool
from conftest import (
    Recorder,
    background_worker,
    calls_at_rest,
    counted_calls,
    run_until_idle,
    wait_for,
)
from workpool import NonRetryableError, RetryBehavior

pytestmark = pytest.mark.timeout(120)


def test_on_complete_gets_success_with_context_exactly_once(app, rec: Recorder, user_table):
    @app.action(name="add")
    def add(a: int, b: int) -> int:
        return a + b

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(work_id=work_id, context=context, result=result)
        user_table.insert(tx, work_id, result.kind)

    pool = app.pool("oc")
    wid = pool.enqueue_action(add, {"a": 2, "b": 3}, on_complete=record, context={"user": 7})
    run_until_idle(app)

    assert len(rec.calls) == 1
    call = rec.calls[0]
    assert call["work_id"] == wid
    assert call["context"] == {"user": 7}
    assert call["result"] == workpool.Success(5)
    assert call["result"].kind == "success"
    assert user_table.rows() == [(wid, "success")]
    assert pool.status(wid) == workpool.Finished(workpool.Success(5))


def test_on_complete_gets_failed_with_error(app, rec: Recorder):
    @app.action(name="explode")
    def explode() -> None:
        raise KeyError("missing thing")

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(result=result, context=context)

    pool = app.pool("oc")
    wid = pool.enqueue_action(explode, on_complete=record)
    run_until_idle(app)
    assert len(rec.calls) == 1
    result = rec.calls[0]["result"]
    assert isinstance(result, workpool.Failed)
    assert "missing thing" in result.error
    assert rec.calls[0]["context"] is None
    assert pool.status(wid).result == result


def test_on_complete_once_after_retries(app, rec: Recorder):
    @app.action(name="flaky")
    def flaky() -> int:
        if workpool.current().attempt < 3:
            raise RuntimeError("not yet")
        return workpool.current().attempt

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(result=result)

    pool = app.pool("oc")
    pool.enqueue_action(
        flaky, on_complete=record, retry=RetryBehavior(max_attempts=4, initial_backoff=0.01)
    )
    run_until_idle(app)
    assert [c["result"] for c in rec.calls] == [workpool.Success(3)]


def test_on_complete_for_every_item_of_a_batch(app, rec: Recorder):
    @app.action(name="square")
    def square(x: int) -> int:
        if x == 3:
            raise NonRetryableError("three is bad")
        return x * x

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(work_id=work_id, result=result, context=context)

    pool = app.pool("oc")
    wids = pool.enqueue_action_batch(
        square, [{"x": i} for i in range(6)], on_complete=record, context="batch-ctx"
    )
    run_until_idle(app)
    by_id = {c["work_id"]: c for c in rec.calls}
    assert len(rec.calls) == 6
    assert set(by_id) == set(wids)
    for i, wid in enumerate(wids):
        assert by_id[wid]["context"] == "batch-ctx"
        if i == 3:
            assert by_id[wid]["result"].kind == "failed"
        else:
            assert by_id[wid]["result"] == workpool.Success(i * i)


def test_status_is_running_until_on_complete_commits(app, store_url, rec: Recorder):
    seen: list[object] = []
    other = workpool.App(store_url)
    assert other.pool("oc").status("00000000-0000-0000-0000-000000000000").result is None

    @app.action(name="quick")
    def quick() -> str:
        return "done"

    @app.mutation(name="look")
    def look(tx, work_id, context, result):
        # Another connection (another thread) sees the committed state only.
        def probe() -> None:
            try:
                seen.append(other.pool("oc").status(work_id))
            except Exception as exc:
                seen.append(exc)

        t = threading.Thread(target=probe)
        t.start()
        t.join(20)
        rec.add()

    pool = app.pool("oc")
    wid = pool.enqueue_action(quick, on_complete=look)
    try:
        run_until_idle(app)
    finally:
        other.close()
    assert len(seen) == 1
    assert seen[0].state == "running", seen
    assert pool.status(wid).state == "finished"


def test_on_complete_raising_is_retried_and_commits_once(app, rec: Recorder, user_table):
    @app.action(name="value")
    def value() -> str:
        rec.add(kind="action")
        return "v"

    @app.mutation(name="shaky")
    def shaky(tx, work_id, context, result):
        user_table.insert(tx, work_id, "written")  # rolled back when we raise below
        rec.add(kind="handler")
        if rec.count(kind="handler") < 3:
            raise RuntimeError("handler hiccup")

    pool = app.pool("oc")
    wid = pool.enqueue_action(value, on_complete=shaky)
    run_until_idle(app, timeout=30)

    assert rec.count(kind="handler") == 3
    assert rec.count(kind="action") == 1, "a failing handler must not re-run the action"
    assert user_table.rows() == [(wid, "written")]
    status = pool.status(wid)
    assert status == workpool.Finished(workpool.Success("v"))
    assert status.on_complete_error is None


def test_status_is_running_while_on_complete_waits_for_retry(app, rec: Recorder):
    @app.action(name="value")
    def value() -> int:
        return 1

    release = threading.Event()

    @app.mutation(name="shaky")
    def shaky(tx, work_id, context, result):
        rec.add()
        if not release.is_set():
            raise RuntimeError("not yet")

    pool = app.pool("oc")
    wid = pool.enqueue_action(value, on_complete=shaky)
    try:
        with background_worker(app):
            wait_for(lambda: len(rec.calls) >= 1)
            status = pool.status(wid)
            assert status.state == "running"
            release.set()
            final = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s, 15)
    finally:
        release.set()
    assert final == workpool.Finished(workpool.Success(1))


@pytest.mark.timeout(60)
def test_on_complete_always_raising_gives_up_after_five_tries(app, rec: Recorder, user_table):
    @app.action(name="value")
    def value() -> str:
        rec.add(kind="action")
        return "real result"

    @app.mutation(name="broken")
    def broken(tx, work_id, context, result):
        user_table.insert(tx, work_id)
        rec.add(kind="handler", result=result)
        raise ValueError("handler is broken")

    pool = app.pool("oc")
    wid = pool.enqueue_action(value, on_complete=broken)
    # backoff 0.5 s * 2^n with jitter over 4 waits: 3.75 .. 11.25 s
    run_until_idle(app, timeout=40)

    assert rec.count(kind="handler") == 5
    assert rec.count(kind="action") == 1
    assert all(c["result"] == workpool.Success("real result") for c in rec.calls[1:])
    assert user_table.count() == 0
    status = pool.status(wid)
    assert status.state == "finished"
    assert status.result == workpool.Success("real result")
    assert status.on_complete_error is not None
    assert "handler is broken" in status.on_complete_error


def test_failing_on_complete_does_not_stall_the_pool(app, rec: Recorder):
    @app.action(name="value")
    def value(i: int) -> int:
        rec.add(kind="action", i=i)
        return i

    @app.mutation(name="broken")
    def broken(tx, work_id, context, result):
        raise RuntimeError("always")

    pool = app.pool("no_stall", max_parallelism=1)
    poisoned = pool.enqueue_action(value, {"i": 0}, on_complete=broken)
    others = pool.enqueue_action_batch(value, [{"i": i} for i in range(1, 5)], run_after=0.05)
    with background_worker(app):
        for wid in others:
            wait_for(
                lambda w=wid: pool.status(w).state == "finished",
                timeout=3,
                message="a handler in backoff must not hold the slot",
            )
        assert pool.status(poisoned).state == "running"
    pool.cancel(poisoned)  # harmless on completing work


# --- mutations ---------------------------------------------------------------------------


def test_mutation_effect_happens_exactly_once(app, user_table, rec: Recorder):
    @app.mutation(name="insert_row")
    def insert_row(tx, key: str) -> str:
        user_table.insert(tx, key, "m")
        return f"inserted {key}"

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(result=result)

    pool = app.pool("mut")
    wids = pool.enqueue_mutation_batch(
        insert_row, [{"key": f"k{i}"} for i in range(5)], on_complete=record
    )
    run_until_idle(app)
    assert user_table.rows() == [(f"k{i}", "m") for i in range(5)]
    assert [s.result for s in pool.status_batch(wids)] == [
        workpool.Success(f"inserted k{i}") for i in range(5)
    ]
    assert len(rec.calls) == 5


def test_mutation_raising_fails_rolls_back_and_is_not_retried(app, user_table, rec: Recorder):
    @app.mutation(name="half_write")
    def half_write(tx, key: str) -> None:
        rec.add(kind="mutation")
        user_table.insert(tx, key)
        raise RuntimeError("mutation blew up")

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(kind="handler", result=result)
        user_table.insert(tx, "handler-ran")

    pool = app.pool(
        "mut",
        retry_actions_by_default=True,
        default_retry=RetryBehavior(max_attempts=5, initial_backoff=0.01),
    )
    wid = pool.enqueue_mutation(half_write, {"key": "k"}, on_complete=record)
    run_until_idle(app)

    assert rec.count(kind="mutation") == 1
    assert user_table.rows() == [("handler-ran", None)], "the mutation's write rolled back"
    result = pool.status(wid).result
    assert result.kind == "failed"
    assert "mutation blew up" in result.error
    assert rec.calls[-1]["result"] == result


def test_mutation_sees_current_info(app, rec: Recorder):
    @app.mutation(name="who")
    def who(tx) -> dict:
        info = workpool.current()
        return {"pool": info.pool, "fn": info.fn_name, "attempt": info.attempt, "id": info.work_id}

    pool = app.pool("mut")
    wid = pool.enqueue_mutation(who)
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success(
        {"pool": "mut", "fn": "who", "attempt": 1, "id": wid}
    )


def test_query_result_is_delivered_to_on_complete(app, user_table, rec: Recorder):
    with app.transaction() as tx:
        for i in range(4):
            user_table.insert(tx, f"row{i}")

    @app.query(name="count_rows")
    def count_rows(tx, prefix: str) -> int:
        return user_table.count(tx)

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(result=result, context=context)

    pool = app.pool("queries")
    wid = pool.enqueue_query(count_rows, {"prefix": "row"}, on_complete=record, context=[1, 2])
    run_until_idle(app)
    assert rec.calls == [{"t": rec.calls[0]["t"], "result": workpool.Success(4), "context": [1, 2]}]
    assert pool.status(wid).result == workpool.Success(4)


def test_query_batch(app, rec: Recorder):
    @app.query(name="echo")
    def echo(tx, x: int) -> int:
        return x

    pool = app.pool("queries")
    wids = pool.enqueue_query_batch(echo, [{"x": 1}, {"x": 2}])
    run_until_idle(app)
    assert [s.result for s in pool.status_batch(wids)] == [
        workpool.Success(1),
        workpool.Success(2),
    ]


# --- the caller's own transaction ------------------------------------------------------


def test_enqueue_in_transaction_commits_with_user_writes(app, user_table, rec: Recorder):
    @app.action(name="job")
    def job() -> str:
        rec.add()
        return "ran"

    pool = app.pool("txn")
    with app.transaction() as tx:
        user_table.insert(tx, "user-row")
        wid = pool.enqueue_action(job, tx=tx)
    assert user_table.rows() == [("user-row", None)]
    assert pool.status(wid).state == "pending"
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success("ran")
    assert len(rec.calls) == 1


def test_enqueue_in_transaction_rolls_back_with_user_writes(app, user_table, rec: Recorder):
    @app.action(name="job")
    def job() -> None:
        rec.add()

    pool = app.pool("txn")
    wids: list[str] = []
    with pytest.raises(RuntimeError, match="user changed their mind"), app.transaction() as tx:
        user_table.insert(tx, "user-row")
        wids.append(pool.enqueue_action(job, tx=tx))
        wids += pool.enqueue_action_batch(job, [{}, {}], tx=tx)
        raise RuntimeError("user changed their mind")
    assert user_table.count() == 0
    assert [s for s in pool.status_batch(wids)] == [workpool.Finished(None)] * 3
    stats = pool.stats()
    assert (stats.backlog, stats.scheduled, stats.running) == (0, 0, 0)
    run_until_idle(app)
    assert rec.calls == []


def test_follow_up_work_enqueued_from_on_complete(app, rec: Recorder):
    pool = app.pool("chain")

    @app.action(name="step")
    def step(n: int) -> int:
        rec.add(kind="step", n=n)
        return n + 1

    @app.mutation(name="next_step")
    def next_step(tx, work_id, context, result):
        if result.return_value < 3:
            follow = pool.enqueue_action(
                step, {"n": result.return_value}, on_complete=next_step, tx=tx
            )
            rec.add(kind="enqueued", wid=follow)

    first = pool.enqueue_action(step, {"n": 0}, on_complete=next_step)
    run_until_idle(app)
    assert rec.values("n")[::2] == [0, 1, 2]
    assert [c["kind"] for c in rec.calls] == ["step", "enqueued"] * 2 + ["step"]
    assert pool.status(first).result == workpool.Success(1)
    for c in rec.calls:
        if c["kind"] == "enqueued":
            assert pool.status(c["wid"]).state == "finished"


def test_follow_up_from_a_failed_handler_try_is_rolled_back(app, rec: Recorder):
    pool = app.pool("chain")

    @app.action(name="first")
    def first() -> str:
        return "first"

    @app.action(name="follow")
    def follow(tag: str) -> None:
        rec.add(kind="follow", tag=tag)

    @app.mutation(name="handler")
    def handler(tx, work_id, context, result):
        tries = rec.count(kind="handler") + 1
        rec.add(kind="handler")
        pool.enqueue_action(follow, {"tag": f"try{tries}"}, tx=tx)
        if tries == 1:
            raise RuntimeError("first try fails after enqueueing")

    pool.enqueue_action(first, on_complete=handler)
    run_until_idle(app, timeout=30)
    assert rec.count(kind="handler") == 2
    assert [c["tag"] for c in rec.calls if c["kind"] == "follow"] == ["try2"]


def test_enqueue_in_another_pool_from_on_complete(app, rec: Recorder):
    a = app.pool("pool_a")
    b = app.pool("pool_b")

    @app.action(name="in_a")
    def in_a() -> int:
        return 1

    @app.action(name="in_b")
    def in_b(x: int) -> None:
        rec.add(pool=workpool.current().pool, x=x)

    @app.mutation(name="handoff")
    def handoff(tx, work_id, context, result):
        b.enqueue_action(in_b, {"x": result.return_value}, tx=tx)

    a.enqueue_action(in_a, on_complete=handoff)
    run_until_idle(app)
    assert [(c["pool"], c["x"]) for c in rec.calls] == [("pool_b", 1)]


def test_on_complete_by_registered_name(app, rec: Recorder):
    @app.action(name="named_action")
    def named_action() -> int:
        return 9

    @app.mutation(name="named_handler")
    def named_handler(tx, work_id, context, result):
        rec.add(result=result)

    pool = app.pool("names")
    pool.enqueue_action("named_action", on_complete="named_handler")
    run_until_idle(app)
    assert rec.values("result") == [workpool.Success(9)]


def test_query_raising_fails_without_retry(app, rec: Recorder):
    @app.query(name="bad_query")
    def bad_query(tx) -> int:
        rec.add(kind="query")
        raise LookupError("no such row")

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(kind="done", result=result)

    pool = app.pool("queries", retry_actions_by_default=True)
    wid = pool.enqueue_query(bad_query, on_complete=record)
    run_until_idle(app)
    assert rec.count(kind="query") == 1
    result = pool.status(wid).result
    assert result.kind == "failed" and "no such row" in result.error
    assert [c["result"] for c in rec.calls if c["kind"] == "done"] == [result]


def test_query_is_read_only(app, user_table):
    """A query's writes never persist: it either fails or its writes are discarded."""

    @app.query(name="sneaky")
    def sneaky(tx) -> str:
        user_table.insert(tx, "written-by-a-query")
        return "wrote"

    pool = app.pool("queries")
    wid = pool.enqueue_query(sneaky)
    run_until_idle(app)
    assert pool.status(wid).state == "finished"
    assert user_table.rows() == [], "a query committed a write"


def test_enqueue_inside_a_mutation_commits_or_rolls_back_with_it(app, rec: Recorder):
    pool = app.pool("nested")

    @app.action(name="follow")
    def follow(tag: str) -> None:
        rec.add(kind="follow", tag=tag)

    @app.mutation(name="parent")
    def parent(tx, tag: str, fail: bool) -> None:
        pool.enqueue_action(follow, {"tag": tag}, tx=tx)
        if fail:
            raise RuntimeError("parent failed after enqueueing")

    ok = pool.enqueue_mutation(parent, {"tag": "kept", "fail": False})
    bad = pool.enqueue_mutation(parent, {"tag": "dropped", "fail": True})
    run_until_idle(app)
    assert pool.status(ok).result == workpool.Success(None)
    assert pool.status(bad).result.kind == "failed"
    assert [c["tag"] for c in rec.calls] == ["kept"]


def test_enqueue_from_inside_an_action(app, rec: Recorder):
    pool = app.pool("nested")

    @app.action(name="child")
    def child(n: int) -> None:
        rec.add(n=n)

    @app.action(name="spawner")
    def spawner() -> list:
        return pool.enqueue_action_batch(child, [{"n": 1}, {"n": 2}])

    wid = pool.enqueue_action(spawner)
    run_until_idle(app)
    children = pool.status(wid).result.return_value
    assert len(children) == 2
    assert sorted(rec.values("n")) == [1, 2]
    assert all(s.state == "finished" for s in pool.status_batch(children))


def test_work_enqueued_in_an_open_transaction_is_visible_in_it(app, rec: Recorder):
    """An enqueue that opens its own transaction may send its insert with the COMMIT
    (PostgreSQL); one inside the caller's transaction, given or nested (a mutation),
    must write at once, because what follows in that transaction may read it."""

    @app.action(name="job")
    def job() -> None:
        rec.add()

    pool = app.pool("visible")
    seen: list[object] = []

    @app.mutation(name="enqueue_and_look")
    def enqueue_and_look(tx: workpool.Tx) -> None:
        wid = pool.enqueue_action(job)  # no tx: joins this mutation's transaction
        seen.append(pool.status(wid))

    with app.transaction() as tx:
        wid = pool.enqueue_action(job, tx=tx)
        assert pool.status(wid, tx=tx).state == "pending"
    alone = pool.enqueue_action(job)
    assert pool.status(alone).state == "pending"
    pool.enqueue_mutation(enqueue_and_look)
    run_until_idle(app)
    assert [getattr(s, "state", s) for s in seen] == ["pending"]
    assert len(rec.calls) == 3


def test_statements_deferred_to_commit_follow_their_transaction(app):
    """``Tx.defer``: a deferred write lands with the COMMIT; one made in a savepoint
    that rolls back, or in a transaction that fails, never lands."""
    store = app.store
    table = store._sql("{s}deferred_probe")
    insert = store._sql(f"INSERT INTO {table} VALUES (?)")
    with app.transaction() as tx:
        tx.execute(f"CREATE TABLE {table} (x integer)")

    def body(tx: workpool.Tx) -> None:
        tx.defer(insert, (1,))
        with pytest.raises(RuntimeError), store.transaction() as inner:  # a savepoint
            inner.defer(insert, (2,))
            raise RuntimeError("rolled back")
        with store.transaction() as inner:
            inner.defer(insert, (3,))

    store.run(body)
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.defer(insert, (4,))
        raise RuntimeError("the whole transaction fails")
    with app.transaction() as tx:
        assert tx.execute(f"SELECT x FROM {table} ORDER BY x").fetchall() == [(1,), (3,)]


def test_handlers_of_one_batch_see_their_rowcounts_and_a_failing_one_is_found(
    app, rec: Recorder, user_table, caplog
):
    """The completer's first pass runs a batch's handlers without savepoints, on
    PostgreSQL in one pipeline: a handler must still read its own rowcount, and a
    handler whose statement fails (its error surfacing at a later read) must be the
    one recorded as failed, while the others commit once."""
    from workpool.core.decide import Succeeded
    from workpool.runtime.worker import Worker, WorkerOptions

    p, table, prefix = user_table.p, user_table.name, app.store.table_prefix

    @app.action(name="job")
    def job() -> None:
        pass

    @app.mutation(name="count")
    def count(tx, work_id, context, result):
        if context["bad"]:
            user_table.insert(tx, None)  # violates NOT NULL; the result is never read
            return
        user_table.insert(tx, work_id, "new")
        cur = tx.execute(f"UPDATE {table} SET v = 'counted' WHERE k = {p}", (work_id,))
        rec.add(work_id=work_id, rowcount=cur.rowcount)

    pool = app.pool("batch", max_parallelism=10)
    ids = [pool.enqueue_action(job, on_complete=count, context={"bad": i == 2}) for i in range(6)]
    bad = ids[2]
    worker = Worker(app.store, app.registry, WorkerOptions(pools=["batch"]), clock=app.clock)
    now = app.clock()
    claimed = app.store.run(lambda tx: app.store.claim(tx, "batch", 10, worker.info.id, now))
    assert len(claimed) == 6
    worker._record([(work, Succeeded(None), 0.0) for work in claimed])  # one batch

    good = sorted(wid for wid in ids if wid != bad)
    # A pass that failed ran some handlers before it rolled back: calls may repeat,
    # committed effects may not.
    assert {c["work_id"] for c in rec.calls} == set(good)
    assert {c["rowcount"] for c in rec.calls} == {1}
    assert user_table.rows() == [(wid, "counted") for wid in good]
    for wid in good:
        assert pool.status(wid) == workpool.Finished(workpool.Success(None)), wid
    assert pool.status(bad).state == "running", "the failed handler waits for its retry"
    with app.transaction() as tx:
        failures, error = tx.execute(
            f"SELECT handler_failures, last_error FROM {prefix}work WHERE id = {p}", (bad,)
        ).fetchone()
    assert failures == 1
    assert "null" in error.lower()
    # The aborted pass is ended quietly: the handler's failure is reported once, by us.
    assert [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")] == []


def test_one_batch_of_mixed_outcomes_runs_each_live_handler_once(app, rec: Recorder):
    """One completer batch: successes with and without on_complete, a failure with
    one, and the success of an attempt that is no longer the row's. Each live handler
    runs once with its own context and result, the stale one's not at all, and each
    outcome is recorded and counted."""
    import dataclasses

    from workpool.core.decide import Raised, Succeeded
    from workpool.runtime.worker import Worker, WorkerOptions

    @app.action(name="job")
    def job() -> None:
        pass

    @app.mutation(name="note")
    def note(tx, work_id, context, result):
        rec.add(work_id=work_id, context=context, result=result)

    pool = app.pool("mixed", max_parallelism=10)
    handled = [pool.enqueue_action(job, on_complete=note, context={"n": i}) for i in range(3)]
    plain = pool.enqueue_action(job)
    failing = pool.enqueue_action(job, on_complete=note, context={"n": "f"})
    stale = pool.enqueue_action(job, on_complete=note, context={"n": "s"})
    worker = Worker(app.store, app.registry, WorkerOptions(pools=["mixed"]), clock=app.clock)
    now = app.clock()
    claimed = app.store.run(lambda tx: app.store.claim(tx, "mixed", 10, worker.info.id, now))
    by_id = {work.id: work for work in claimed}
    assert len(by_id) == 6
    batch = [(by_id[wid], Succeeded(None), 0.0) for wid in [*handled, plain]]
    batch.append((by_id[failing], Raised("boom", retryable=False), 0.0))
    batch.append((dataclasses.replace(by_id[stale], attempt=2), Succeeded(None), 0.0))
    worker._record(batch)

    assert sorted((c["work_id"], c["context"], c["result"]) for c in rec.calls) == sorted(
        [(wid, {"n": i}, workpool.Success(None)) for i, wid in enumerate(handled)]
        + [(failing, {"n": "f"}, workpool.Failed("boom"))]
    )
    for wid in [*handled, plain]:
        assert pool.status(wid) == workpool.Finished(workpool.Success(None)), wid
    assert pool.status(failing) == workpool.Finished(workpool.Failed("boom"))
    status = pool.status(stale)
    assert (status.state, status.attempt) == ("running", 1), status
    stats = pool.stats()
    assert (stats.succeeded, stats.failed, stats.completed) == (4, 1, 5)


def test_statements_of_handlers_in_the_pipelined_pass_keep_their_order_and_cursors(app, user_table):
    """In the completer's optimistic pass (a pipeline on PostgreSQL) ``tx.execute``
    holds statements back and sends many as one ``executemany``: each still runs once,
    in order, and a cursor kept or read later gives its own statement's answer."""
    store, t, p = app.store, user_table.name, user_table.p

    def body(tx: workpool.Tx) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        with store.pipeline(tx):  # as the worker's optimistic pass
            for i in range(5):  # nobody keeps these cursors: one executemany on PostgreSQL
                user_table.insert(tx, f"a{i}")
            kept = tx.execute(f"SELECT count(*) FROM {t}")  # read only after later writes
            for i in range(3):
                user_table.insert(tx, f"b{i}")
            updated = tx.execute(f"UPDATE {t} SET v = 'x' WHERE k LIKE {p}", ("b%",))
            seen["updated"] = updated.rowcount
            seen["kept"] = kept.fetchone()[0]
            seen["iterated"] = sorted(row[0] for row in tx.execute(f"SELECT k FROM {t}"))
            with contextlib.closing(tx.execute(f"SELECT v FROM {t} WHERE k = {p}", ("b0",))) as c:
                seen["with"] = c.fetchall()
            user_table.insert(tx, "c")  # sent when the pipeline ends
        return seen

    seen = store.run(body)
    assert seen["updated"] == 3
    assert seen["kept"] == 5, "the SELECT ran after the first five inserts, before the rest"
    assert seen["iterated"] == [*(f"a{i}" for i in range(5)), "b0", "b1", "b2"]
    assert [tuple(r) for r in seen["with"]] == [("x",)]
    assert user_table.rows() == [
        *((f"a{i}", None) for i in range(5)),
        *((f"b{i}", "x") for i in range(3)),
        ("c", None),
    ]


def test_handlers_that_each_insert_one_row_commit_once_and_a_bad_row_fails_alone(
    app, rec: Recorder, user_table
):
    """A batch whose handlers each run the same one-row INSERT (on PostgreSQL they go
    as the rows of a few statements): every good row lands once, in order, with its
    own values, NULLs included; the handler whose row breaks a constraint is the one
    recorded as failed, and the others commit once."""
    from workpool.core.decide import Succeeded
    from workpool.runtime.worker import Worker, WorkerOptions

    @app.action(name="job")
    def job() -> None:
        pass

    @app.mutation(name="insert_one")
    def insert_one(tx, work_id, context, result):
        user_table.insert(tx, None if context["bad"] else work_id, context["v"])

    pool = app.pool("rows", max_parallelism=100)
    ids = [
        pool.enqueue_action(
            job, on_complete=insert_one, context={"bad": i == 17, "v": None if i % 3 else str(i)}
        )
        for i in range(40)
    ]
    worker = Worker(app.store, app.registry, WorkerOptions(pools=["rows"]), clock=app.clock)
    now = app.clock()
    claimed = app.store.run(lambda tx: app.store.claim(tx, "rows", 100, worker.info.id, now))
    assert len(claimed) == 40
    worker._record([(work, Succeeded(None), 0.0) for work in claimed])  # one batch

    good = [(wid, None if i % 3 else str(i)) for i, wid in enumerate(ids) if i != 17]
    assert user_table.rows() == sorted(good, key=lambda r: (r[0], r[1] or ""))
    for wid, _ in good:
        assert pool.status(wid) == workpool.Finished(workpool.Success(None)), wid
    status = pool.status(ids[17])
    assert status.state == "running", "the failed handler waits for its retry"
    with app.transaction() as tx:
        failures = tx.execute(
            f"SELECT handler_failures FROM {app.store.table_prefix}work WHERE id = {user_table.p}",
            (ids[17],),
        ).fetchone()[0]
    assert failures == 1


def test_a_quiet_worker_looks_for_handler_retries_less_often_yet_runs_them_on_time(
    app, monkeypatch
):
    """A worker with nothing happening in its pools looked for handler retries ten
    times a second (on PostgreSQL, a round trip each: most of an idle worker's CPU).
    Quiet, it looks every HANDLERS_QUIET_S, and a retry due before its next look is
    known from the last one and retried when due. A handler that fails once is
    retried after its backoff, and the handler of a pending item canceled while the
    worker is quiet runs."""
    from workpool.runtime.maintenance import HANDLERS_QUIET_S, QUIET_S

    looks = counted_calls(monkeypatch, app.store, "maintenance_due_later")
    handled: list[str] = []
    failures = [1]

    @app.action(name="quick")
    def quick() -> str:
        return "ok"

    @app.mutation(name="flaky_handler")
    def flaky_handler(tx, work_id, context, result):
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("the handler fails once")
        handled.append(result.kind)

    pool = app.pool("quiet")
    with background_worker(app, lease=15.0):  # heartbeats (SQLite: commits) 5 s apart
        quiet_looks = calls_at_rest(looks, QUIET_S + 0.5)
        wid = pool.enqueue_action(quick, on_complete=flaky_handler)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=10)
        time.sleep(QUIET_S + 0.5)  # quiet again
        later = pool.enqueue_action(quick, run_after=3600, on_complete=flaky_handler)
        assert pool.cancel(later)
        wait_for(lambda: pool.status(later).state == "finished", timeout=10)
    assert quiet_looks <= 2.0 / HANDLERS_QUIET_S + 1, f"{quiet_looks} looks in 2 s of quiet"
    assert handled == ["success", "canceled"]
    assert pool.status(wid) == workpool.Finished(workpool.Success("ok"))
