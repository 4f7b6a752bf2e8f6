"""PRODUCT.md §5: cancel wins over start; running work finishes without retry; cancel_all.

Lesson: duplicate cancels of one work item are harmless.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

import workpool
from conftest import Recorder, assert_pool_empty, background_worker, run_until_idle, wait_for
from workpool import NonRetryableError, RetryBehavior
from workpool.pool import CANCEL_PAGE

pytestmark = pytest.mark.timeout(120)

RETRYING = RetryBehavior(max_attempts=5, initial_backoff=0.01)


def _register(app, rec: Recorder):
    @app.action(name="job")
    def job(i: int = 0) -> int:
        rec.add(kind="job", i=i)
        return i

    @app.mutation(name="record")
    def record(tx, work_id, context, result):
        rec.add(kind="done", work_id=work_id, result=result, context=context)

    return job, record


def test_cancel_pending_without_on_complete_finishes_at_once(app, rec: Recorder):
    job, _ = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(job, {"i": 1}, run_after=30)
    pool.cancel(wid)
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())
    assert pool.status(wid).result.kind == "canceled"
    run_until_idle(app)
    assert rec.count(kind="job") == 0
    assert_pool_empty(pool)


def test_cancel_due_work_before_any_worker_never_starts(app, rec: Recorder):
    job, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(job, {"i": 1}, on_complete=record, context={"c": 1})
    keep = pool.enqueue_action(job, {"i": 2}, on_complete=record)
    pool.cancel(wid)
    run_until_idle(app)

    assert [c["i"] for c in rec.calls if c["kind"] == "job"] == [2]
    done = {c["work_id"]: c for c in rec.calls if c["kind"] == "done"}
    assert done[wid]["result"] == workpool.Canceled()
    assert done[wid]["context"] == {"c": 1}
    assert done[keep]["result"] == workpool.Success(2)
    assert rec.count(kind="done") == 2
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())


def test_canceled_pending_with_on_complete_is_running_until_handler_ran(app, rec: Recorder):
    job, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(job, on_complete=record, run_after=60)
    pool.cancel(wid)
    # The handler runs in a worker; until then the work is not Finished.
    assert pool.status(wid).state == "running"
    run_until_idle(app)
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())
    assert rec.count(kind="done") == 1
    assert rec.count(kind="job") == 0


def test_cancel_running_work_is_not_retried(app, rec: Recorder):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="slow_fail")
    def slow_fail() -> None:
        rec.add(kind="job", attempt=workpool.current().attempt)
        started.set()
        release.wait(20)
        raise RuntimeError("failed after cancel")

    _, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(slow_fail, retry=RETRYING, on_complete=record)
    try:
        with background_worker(app):
            assert started.wait(10)
            pool.cancel(wid)
            assert pool.status(wid).state == "running"
            release.set()
            status = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s)
    finally:
        release.set()
    assert status.result == workpool.Canceled()
    assert rec.count(kind="job") == 1
    assert [c["result"] for c in rec.calls if c["kind"] == "done"] == [workpool.Canceled()]


def test_cancel_running_work_that_succeeds_reports_success(app, rec: Recorder):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="slow_ok")
    def slow_ok() -> str:
        started.set()
        release.wait(20)
        return "made it"

    _, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(slow_ok, retry=RETRYING, on_complete=record)
    try:
        with background_worker(app):
            assert started.wait(10)
            pool.cancel(wid)
            release.set()
            status = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s)
    finally:
        release.set()
    assert status.result == workpool.Success("made it")
    assert [c["result"] for c in rec.calls if c["kind"] == "done"] == [workpool.Success("made it")]


def test_cancel_running_work_that_fails_for_good_reports_failed(app, rec: Recorder):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="slow_fatal")
    def slow_fatal() -> None:
        started.set()
        release.wait(20)
        raise NonRetryableError("fatal anyway")

    _, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(slow_fatal, retry=RETRYING, on_complete=record)
    try:
        with background_worker(app):
            assert started.wait(10)
            pool.cancel(wid)
            release.set()
            status = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s)
    finally:
        release.set()
    assert status.result.kind == "failed"
    assert "fatal anyway" in status.result.error
    assert rec.count(kind="done") == 1


def test_cancel_work_waiting_for_retry(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add(kind="job")
        raise RuntimeError("again")

    _, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(
        fails, retry=RetryBehavior(max_attempts=5, initial_backoff=30.0), on_complete=record
    )
    with background_worker(app):
        wait_for(lambda: (s := pool.status(wid)).state == "pending" and s.reason == "backoff")
        pool.cancel(wid)
        status = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s)
    assert status.result == workpool.Canceled()
    assert rec.count(kind="job") == 1
    assert [c["result"] for c in rec.calls if c["kind"] == "done"] == [workpool.Canceled()]


def test_duplicate_cancels_are_harmless(app, rec: Recorder):
    job, record = _register(app, rec)
    pool = app.pool("cancel")
    wid = pool.enqueue_action(job, on_complete=record, run_after=60)
    done_id = pool.enqueue_action(job, {"i": 5})
    for _ in range(3):
        pool.cancel(wid)
    pool.cancel(str(uuid.uuid4()))  # unknown id
    run_until_idle(app)
    pool.cancel(wid)  # already finished
    pool.cancel(done_id)  # finished with success
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())
    assert pool.status(done_id) == workpool.Finished(workpool.Success(5))
    assert [c["result"] for c in rec.calls if c["kind"] == "done"] == [workpool.Canceled()]
    stats = pool.stats()
    assert stats.canceled == 1


def test_concurrent_duplicate_cancels_run_on_complete_once(app, store_url, rec: Recorder):
    job, record = _register(app, rec)
    pool = app.pool("cancel")
    wids = pool.enqueue_action_batch(
        job, [{"i": i} for i in range(5)], on_complete=record, run_after=60
    )
    others = [workpool.App(store_url) for _ in range(3)]
    try:
        for other in others:  # migrate before racing
            other.pool("cancel").status(wids[0])
        barrier = threading.Barrier(len(others))
        errors: list[BaseException] = []

        def cancel_all_of(other) -> None:
            try:
                barrier.wait(10)
                for wid in wids:
                    other.pool("cancel").cancel(wid)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=cancel_all_of, args=(o,)) for o in others]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
    finally:
        for other in others:
            other.close()
    run_until_idle(app)
    done = [c["work_id"] for c in rec.calls if c["kind"] == "done"]
    assert sorted(done) == sorted(wids)
    assert rec.count(kind="job") == 0


def test_cancel_all_cancels_pending_work(app, rec: Recorder):
    job, record = _register(app, rec)
    pool = app.pool("cancel_all")
    scheduled = pool.enqueue_action_batch(job, [{"i": i} for i in range(5)], run_after=60)
    with_handler = pool.enqueue_action(job, {"i": 9}, on_complete=record, run_after=60)
    other_pool = app.pool("untouched")
    untouched = other_pool.enqueue_action(job, {"i": 100}, run_after=60)

    assert pool.cancel_all() == 6
    assert pool.status_batch(scheduled) == [workpool.Finished(workpool.Canceled())] * 5
    assert other_pool.status(untouched).state == "pending"
    assert pool.cancel_all() == 0  # nothing left: harmless
    other_pool.cancel(untouched)
    run_until_idle(app)
    assert pool.status(with_handler) == workpool.Finished(workpool.Canceled())
    assert rec.count(kind="job") == 0
    assert rec.count(kind="done") == 1


def test_cancel_all_limit_counts_items_in_total(app):
    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("cancel_all")
    # The limit ends inside the second page; the rest takes a full page and part of one.
    total, limit = 2 * CANCEL_PAGE + 22, CANCEL_PAGE + 6
    wids = pool.enqueue_action_batch(job, [{}] * total, run_after=60)
    assert pool.cancel_all(limit=limit) == limit
    statuses = pool.status_batch(wids)
    assert sum(s.state == "finished" for s in statuses) == limit
    assert sum(s.state == "pending" for s in statuses) == total - limit
    assert pool.cancel_all(limit=10 * total) == total - limit
    assert all(s.state == "finished" for s in pool.status_batch(wids))


def test_cancel_all_before_keeps_newer_work(app):
    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("cancel_all")
    old = pool.enqueue_action_batch(job, [{}] * 3, run_after=60)
    cutoff = time.time()
    wait_for(lambda: time.time() > cutoff + 0.01)
    new = pool.enqueue_action_batch(job, [{}] * 2, run_after=60)
    assert pool.cancel_all(before=cutoff) == 3
    assert all(s.result == workpool.Canceled() for s in pool.status_batch(old))
    assert all(s.state == "pending" for s in pool.status_batch(new))


def test_cancel_all_handles_a_large_backlog(app):
    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("big")
    wids = pool.enqueue_action_batch(job, [{}] * 1200, run_after=60)
    assert len(set(wids)) == 1200
    assert pool.stats().scheduled == 1200
    assert pool.cancel_all() == 1200
    statuses = pool.status_batch(wids)
    assert len(statuses) == 1200
    assert all(s == workpool.Finished(workpool.Canceled()) for s in statuses)
    assert_pool_empty(pool)


def test_cancel_all_includes_running_work(app, rec: Recorder):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="slow_fail")
    def slow_fail() -> None:
        rec.add(kind="job")
        started.set()
        release.wait(20)
        raise RuntimeError("x")

    pool = app.pool("cancel_all")
    wid = pool.enqueue_action(slow_fail, retry=RETRYING)
    try:
        with background_worker(app):
            assert started.wait(10)
            assert pool.cancel_all() == 1
            release.set()
            status = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s)
    finally:
        release.set()
    assert status.result == workpool.Canceled()
    assert rec.count(kind="job") == 1


def test_cancel_all_with_a_limit_takes_running_work_then_the_next_to_start(app, rec: Recorder):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="held")
    def held() -> None:
        started.set()
        release.wait(20)
        raise RuntimeError("x")  # retried, unless cancel_all flagged it

    @app.action(name="later")
    def later(i: int) -> None:
        rec.add(i=i)

    pool = app.pool("cancel_order", max_parallelism=1)
    running = pool.enqueue_action(held, retry=RETRYING)
    # Enqueued out of due order: the ones due first are canceled first.
    due_in = {0: 300, 1: 100, 2: 200, 3: 400}
    wids = {i: pool.enqueue_action(later, {"i": i}, run_after=s) for i, s in due_in.items()}
    try:
        with background_worker(app):
            assert started.wait(10)
            assert pool.cancel_all(limit=3) == 3
            release.set()
            wait_for(lambda: pool.status(running).state == "finished")
    finally:
        release.set()
    assert pool.status(running).result == workpool.Canceled()
    canceled = {i for i, wid in wids.items() if pool.status(wid).state == "finished"}
    assert canceled == {1, 2}
    assert all(pool.status(wids[i]).state == "pending" for i in (0, 3))


def test_cancel_all_before_accepts_an_aware_datetime(app):
    from datetime import UTC, datetime, timedelta

    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("cancel_all")
    wids = pool.enqueue_action_batch(job, [{}] * 3, run_after=60)
    assert pool.cancel_all(before=datetime.now(UTC) - timedelta(hours=1)) == 0
    assert pool.cancel_all(before=datetime.now(UTC) + timedelta(seconds=1)) == 3
    assert all(s.result == workpool.Canceled() for s in pool.status_batch(wids))


def test_cancel_is_scoped_to_its_pool(app, rec: Recorder):
    job, _ = _register(app, rec)
    a = app.pool("cancel_a")
    b = app.pool("cancel_b")
    wid = a.enqueue_action(job, run_after=60)
    b.cancel(wid)  # the wrong pool: changes nothing
    assert a.status(wid).state == "pending"
    a.cancel(wid)
    assert a.status(wid) == workpool.Finished(workpool.Canceled())


@pytest.mark.parametrize("odd", ["", "a\x1eb", "x,y", "nul\x00", "'; --", "\u2028"])
def test_cancel_of_an_odd_id_changes_nothing(app, odd: str):
    """Ids go to the database as one array (PostgreSQL: a joined string split on the
    server); an id that holds the separator, a comma or a NUL is just unknown."""

    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("odd", max_parallelism=0)
    wid = pool.enqueue_action(job)
    assert pool.cancel(odd) is False
    assert pool.status(wid).state == "pending"
    assert pool.cancel(wid) is True
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())
