"""PRODUCT.md §4 and the fencing lesson, tested *as data*: seed the rows a dead (or late)
worker leaves behind, then let a real worker deal with them.

These tests write the store's own tables (``work``, ``workers``) with plain SQL
through ``app.transaction()``, so they know the column names of the schema
(``state``, ``attempt``, ``worker_id``, ``started_at``, ``expires_at``): when the
schema changes, update ``seed_running`` / ``set_worker``.  The process-level
twins are in test_processes.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import workpool
from conftest import (
    Recorder,
    background_worker,
    finished,
    holds_for,
    pg_schema_of,
    ph,
    run_until_idle,
    transient_error,
    wait_for,
)
from workpool import RetryBehavior

pytestmark = pytest.mark.timeout(60)

FAST = RetryBehavior(max_attempts=3, initial_backoff=0.01)


def table(store_url: str, name: str) -> str:
    schema = pg_schema_of(store_url)
    return f'"{schema}".{name}' if schema else name


def set_worker(app, store_url: str, worker_id: str, expires_in: float) -> None:
    """Insert or update a worker row whose lease ends ``expires_in`` s from now."""
    p = ph(store_url)
    now = time.time()
    workers = table(store_url, "workers")
    with app.transaction() as tx:
        tx.execute(f"DELETE FROM {workers} WHERE id = {p}", (worker_id,))
        tx.execute(
            f"INSERT INTO {workers} (id, host, pid, pools, started_at, heartbeat_at, expires_at)"
            f" VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p})",
            (worker_id, "ghost-host", 999_999, "", now - 60, now - 60, now + expires_in),
        )


def seed_running(app, store_url: str, wid: str, attempt: int, worker_id: str) -> None:
    """Make ``wid`` look claimed (attempt ``attempt``) by ``worker_id``."""
    p = ph(store_url)
    with app.transaction() as tx:
        cur = tx.execute(
            f"UPDATE {table(store_url, 'work')} SET state = 'running', attempt = {p},"
            f" worker_id = {p}, started_at = {p} WHERE id = {p}",
            (attempt, worker_id, time.time() - 5, wid),
        )
        assert cur.rowcount == 1


@pytest.fixture
def fns(app, rec: Recorder, user_table):
    @app.action(name="job")
    def job(i: int = 0) -> int:
        rec.add(kind="job", attempt=workpool.current().attempt, i=i)
        return i

    @app.mutation(name="write")
    def write(tx, key: str) -> str:
        rec.add(kind="write", attempt=workpool.current().attempt)
        user_table.insert(tx, key)
        return key

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(kind="done", work_id=work_id, result=result)
        user_table.insert(tx, f"done:{work_id}")

    return {"job": job, "write": write, "record": record}


def test_lost_action_attempt_counts_as_failed_and_is_retried(app, store_url, fns, rec):
    pool = app.pool("crash")
    wid = pool.enqueue_action(fns["job"], {"i": 1}, retry=FAST, on_complete=fns["record"])
    set_worker(app, store_url, "dead-worker", expires_in=-10)
    seed_running(app, store_url, wid, 1, "dead-worker")
    assert pool.status(wid).state == "running"

    run_until_idle(app, lease=1.0)
    assert [(c["kind"], c.get("attempt")) for c in rec.calls] == [("job", 2), ("done", None)]
    status = pool.status(wid)
    assert status == workpool.Finished(workpool.Success(1))


def test_lost_action_without_retry_fails_with_on_complete_once(app, store_url, fns, rec):
    pool = app.pool("crash")
    wid = pool.enqueue_action(fns["job"], on_complete=fns["record"])
    # no worker row at all: a vanished worker
    seed_running(app, store_url, wid, 1, "vanished-worker")
    run_until_idle(app, lease=1.0)
    assert rec.count(kind="job") == 0
    done = [c for c in rec.calls if c["kind"] == "done"]
    assert len(done) == 1
    assert done[0]["result"].kind == "failed"
    assert pool.status(wid).result == done[0]["result"]


def test_lost_mutation_runs_again_with_effect_once(app, store_url, fns, rec, user_table):
    pool = app.pool("crash")
    wid = pool.enqueue_mutation(fns["write"], {"key": "k"}, on_complete=fns["record"])
    seed_running(app, store_url, wid, 1, "vanished-worker")
    run_until_idle(app, lease=1.0)
    assert [c["attempt"] for c in rec.calls if c["kind"] == "write"] == [2]
    assert user_table.rows() == [("done:" + wid, None), ("k", None)]
    assert pool.status(wid) == workpool.Finished(workpool.Success("k"))


def test_live_lease_is_respected_then_expiry_rescues(app, store_url, fns, rec):
    pool = app.pool("crash")
    wid = pool.enqueue_action(fns["job"], retry=FAST)
    set_worker(app, store_url, "slow-but-alive", expires_in=600)
    seed_running(app, store_url, wid, 1, "slow-but-alive")
    with background_worker(app, lease=1.0):
        holds_for(lambda: pool.status(wid).state == "running", 1.5)
        assert rec.calls == []
        set_worker(app, store_url, "slow-but-alive", expires_in=-1)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=10)
    assert pool.status(wid).result == workpool.Success(0)
    assert [c["attempt"] for c in rec.calls] == [2]


def test_lost_work_waits_for_a_free_slot(app, store_url, fns, rec):
    pool = app.pool("crash", max_parallelism=1)
    lost = pool.enqueue_action(fns["job"], {"i": 1}, retry=FAST)
    other = pool.enqueue_action(fns["job"], {"i": 2})
    seed_running(app, store_url, lost, 1, "vanished-worker")
    # The lost attempt holds the only slot until it is detected.
    assert pool.status(other).reason == "waiting_for_slot"
    run_until_idle(app, lease=1.0)
    assert sorted(c["i"] for c in rec.calls) == [1, 2]


@pytest.mark.parametrize("handler", [True, False], ids=["on_complete", "plain"])
def test_stale_completion_of_an_old_attempt_changes_nothing(app, store_url, rec, handler):
    """A worker finishing attempt 1 after its work was re-claimed as attempt 2 is fenced.
    ``plain``: a success without on_complete is finished without reading the row first
    (the fast path), and is fenced by attempt number all the same."""
    started = threading.Event()
    release = threading.Event()

    @app.action(name="late")
    def late() -> str:
        attempt = workpool.current().attempt
        rec.add(kind="late", attempt=attempt)
        if attempt == 1:
            started.set()
            release.wait(20)
            return "stale result"
        return "fresh result"

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(kind="done", result=result)

    pool = app.pool("fence")
    wid = pool.enqueue_action(
        late,
        retry=RetryBehavior(max_attempts=5, initial_backoff=0.01),
        on_complete=record if handler else None,
    )
    try:
        with background_worker(app, lease=1.0):
            assert started.wait(10)
            # Meanwhile "another worker" took over: attempt 2, alive.
            set_worker(app, store_url, "new-owner", expires_in=600)
            seed_running(app, store_url, wid, 2, "new-owner")
            release.set()
            holds_for(lambda: pool.status(wid).state == "running", 1.0)
            status = pool.status(wid)
            assert status.attempt == 2, status
            assert rec.count(kind="done") == 0, "the stale completion ran on_complete"
            assert pool.stats().completed == 0, "the stale completion was counted"
            # The new owner dies: its attempt 2 is lost, attempt 3 runs here.
            set_worker(app, store_url, "new-owner", expires_in=-1)
            final = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s, 10)
    finally:
        release.set()
    assert final.result == workpool.Success("fresh result")
    assert [c["attempt"] for c in rec.calls if c["kind"] == "late"] == [1, 3]
    assert [c["result"] for c in rec.calls if c["kind"] == "done"] == (
        [workpool.Success("fresh result")] if handler else []
    )
    assert pool.stats().succeeded == 1


def attempts_counted(app: Any) -> tuple[list[int], Any]:
    """An action "once" returning "ran", and the attempts of it that ran, in order."""
    runs: list[int] = []

    @app.action(name="once")
    def once() -> str:
        runs.append(workpool.current().attempt)
        return "ran"

    return runs, once


def claimed_long_ago(app: Any, pool: str, wid: str, worker_id: str) -> list[Any]:
    """``wid`` made due and claimed by ``worker_id`` a minute ago, in a transaction of
    the test's: what a claim whose COMMIT's reply was lost leaves to that worker."""
    store = app.store
    past = time.time() - 60
    with app.transaction() as tx:
        tx.execute(store._sql("UPDATE {s}work SET due_at = ? WHERE id = ?"), (past, wid))
        claimed: list[Any] = store.claim(tx, pool, 1, worker_id, past)
    return claimed


def test_a_live_workers_claim_it_never_heard_of_is_adopted_and_runs_once(app):
    """A claim that committed while its reply was lost leaves a row running under a live
    worker that does not know it: no lease will ever expire. The worker finds its own
    orphan and puts it back, without counting a failed attempt, and it runs once."""
    runs, once = attempts_counted(app)
    pool = app.pool("orphans")
    with background_worker(app, lease=30.0):
        worker = wait_for(lambda: next(iter(app._workers), None), timeout=10)
        wid = pool.enqueue_action(once, run_after=3600)  # not claimable by the worker
        claimed = claimed_long_ago(app, "orphans", wid, worker.info.id)  # the lost claim
        assert [c.id for c in claimed] == [wid]
        wait_for(lambda: pool.status(wid).state == "finished", timeout=20)
    assert pool.status(wid) == workpool.Finished(workpool.Success("ran"))
    assert len(runs) == 1, runs


@pytest.mark.parametrize("lost", ["retried", "given_up"])
def test_an_action_whose_hand_over_lost_its_commit_reply_is_recorded_and_runs_once(
    app, store_url, monkeypatch, lost
):
    """A hand-over (the attempt ended and the next one claimed, in one transaction)
    whose COMMIT went through while its reply was lost: the worker cannot tell that
    the row is ended. Its record must find out, not miss the row: an ended row that
    nobody records was given back by the orphan check as a claim that never ran,
    and an action promised one attempt ran twice (found by the chaos run).

    ``retried``: the store retries the transaction, whose end then finds the row
    not running; ``given_up``: the hand-over fails and the outcome goes on alone."""
    from workpool.runtime.worker import Worker

    runs: list[int] = []
    handled: list[object] = []

    @app.action(name="once")
    def once() -> str:
        runs.append(workpool.current().attempt)
        time.sleep(0.1)  # the dispatcher's claim has let its slot go: a slot to hand on
        return "ran"

    @app.mutation(name="handled")
    def on_done(tx, work_id, context, result):
        handled.append(result)

    error: Exception = transient_error(store_url)
    if lost == "given_up":
        error = RuntimeError("the reply of the COMMIT was lost")
    end_in = Worker._end_in
    replies_lost: list[str] = []

    def end_in_losing_the_reply(self: Worker, tx: workpool.Tx, *, work: Any, free: int) -> Any:
        if not replies_lost:
            # The first try's COMMIT: the row is ended for good, and its reply lost.
            # (On another thread: this one's transaction would take the end in.)
            ended: list[object] = []
            store = self.store
            end = threading.Thread(
                target=lambda: ended.append(store.run(lambda t: store.end_attempt(t, work))())
            )
            end.start()
            end.join()
            replies_lost.append(f"{work.id} ended: {ended[0] is not None}")
            raise error
        return end_in(self, tx, work=work, free=free)

    monkeypatch.setattr(Worker, "_hands_over", lambda self, work: work.fn_name == "once")
    monkeypatch.setattr(Worker, "_end_in", end_in_losing_the_reply)
    pool = app.pool("handing", max_parallelism=1)
    wid = pool.enqueue_action(once, retry=False, on_complete=on_done)
    with background_worker(app, concurrency=1):
        final = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s, timeout=20)
    assert replies_lost == [f"{wid} ended: True"]
    assert final == workpool.Finished(workpool.Success("ran"))
    assert runs == [1], f"attempts that ran: {runs}"
    assert handled == [workpool.Success("ran")]
    assert (pool.stats().succeeded, pool.stats().failed) == (1, 0)


def test_an_ended_attempt_its_live_worker_lost_is_a_failed_attempt_not_an_orphan(app):
    """A row ended (its action returned and gave its slot on) under a live worker that
    no longer knows it: the attempt ran and its outcome is lost. The orphan check
    must count it as a failed attempt, as a rescuer would if the worker had died;
    giving it back as a claim that never ran would run it again beyond its retry
    policy (here: once)."""
    from workpool.store.base import ClaimedWork

    runs, once = attempts_counted(app)
    pool = app.pool("lost_outcomes")
    with background_worker(app, lease=30.0):
        worker = wait_for(lambda: next(iter(app._workers), None), timeout=10)
        wid = pool.enqueue_action(once, retry=False, run_after=3600)
        [claimed] = claimed_long_ago(app, "lost_outcomes", wid, worker.info.id)
        assert isinstance(claimed, ClaimedWork) and claimed.id == wid
        store = app.store
        assert store.run(lambda tx: store.end_attempt(tx, claimed))() is not None
        final = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s, timeout=20)
    assert final.result.kind == "failed", final
    assert "lost" in str(final.result.error), final
    assert runs == [], f"an attempt that ran was run again: {runs}"


def test_work_longer_than_the_lease_is_not_rescued_while_its_worker_lives(app, rec):
    """Leases are renewed while the attempt runs: a job four times the lease long,
    watched by a second worker that would rescue it on expiry, runs once."""

    @app.action(name="long")
    def long() -> str:
        rec.add(attempt=workpool.current().attempt)
        time.sleep(4.0)
        return "done"

    pool = app.pool("long")
    wid = pool.enqueue_action(long, retry=FAST)
    with background_worker(app, lease=1.0, concurrency=1):
        wait_for(lambda: rec.calls, timeout=10)
        with background_worker(app, lease=1.0, concurrency=1):
            wait_for(lambda: finished(pool, wid), timeout=20)
    assert pool.status(wid) == workpool.Finished(workpool.Success("done"))
    assert rec.values("attempt") == [1]
