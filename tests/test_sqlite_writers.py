"""SQLite only: writers of one file queue on the lock of ``<file>-writers`` from
before ``BEGIN IMMEDIATE`` to after the COMMIT, across processes and store
objects; readers do not; a dead writer's place is freed by the kernel."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import workpool
from conftest import holds_for, wait_for
from workpool.core.results import success_json
from workpool.store.base import WouldWait

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)


def _queue_taken(path: str) -> bool:
    """Whether a writer holds the queue: tried on an open file of our own, as
    another process would."""
    fd = os.open(path + "-writers", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _job_app(url: str) -> Any:
    return _with_job(workpool.App(url))


def _with_job(app: Any) -> Any:
    @app.action(name="job")
    def job(i: int) -> int:
        return i

    return app


@contextmanager
def _writing(app: Any) -> Iterator[None]:
    """A write transaction of ``app``, held open on another thread for the block."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with app.transaction() as tx:
            app.pool("q").enqueue_action("job", {"i": 0}, tx=tx)
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        yield
    finally:
        release.set()
        holder.join(10)


def test_a_record_that_refills_its_slot_queues_only_at_its_commit(app: Any) -> None:
    """A worker's record (a success finished, a slot refilled) builds its statements
    before the lock: another process may write meanwhile. Its claim's rows are read
    after the COMMIT; asking for its connection then must not BEGIN early."""
    store = _with_job(app).store
    pool = app.pool("q", max_parallelism=1)
    first, second = pool.enqueue_action_batch("job", [{"i": 0}, {"i": 1}])
    claimed = store.run(lambda tx: store.claim_later(tx, "q", 1, "w1", time.time()))()
    assert [w.id for w in claimed] == [first]
    queued: list[bool] = []

    def record(tx: Any) -> Any:
        now = time.time()
        success = (first, 1, success_json("null"), "q", 0.0, None, "running")
        done = store.finish_succeeded(tx, [success], now, "w1")
        refill = store.claim_later(tx, "q", 1, "w1", now)
        queued.append(_queue_taken(store.path))
        return lambda: (done(), refill())

    done, refill = store.run(record)()
    assert queued == [False], "the record took the write lock before its COMMIT"
    assert done == [(first, 1)]
    assert [w.id for w in refill] == [second]
    assert [pool.status(i).state for i in (first, second)] == ["finished", "running"]


@pytest.fixture
def two_stores(store_url: str) -> Iterator[tuple[Any, Any]]:
    """Two Apps on one file, each with a store object of its own, as two processes
    have (a ``flock`` belongs to the open file, so they queue against each other):
    the first App, and a pool of the second whose config is written."""
    first, second = _job_app(store_url), _job_app(store_url)
    try:
        pool = second.pool("q")
        pool.stats()
        yield first, pool
    finally:
        first.close()
        second.close()


def test_a_write_transaction_holds_the_queue_and_a_read_does_not(app: Any) -> None:
    path = _with_job(app).store.path
    pool = app.pool("q")
    pool.enqueue_action("job", {"i": 0})
    assert not _queue_taken(path)
    with app.store.transaction(readonly=True) as tx:  # as status() and stats() read
        tx.execute("SELECT count(*) FROM sqlite_master").fetchone()
        assert not _queue_taken(path), "a read-only transaction queued"
    with app.transaction() as tx:
        pool.enqueue_action("job", {"i": 1}, tx=tx)
        assert _queue_taken(path)
    assert not _queue_taken(path)
    with pytest.raises(RuntimeError), app.transaction() as tx:
        pool.enqueue_action("job", {"i": 2}, tx=tx)
        raise RuntimeError("rolled back")
    assert not _queue_taken(path), "a rollback kept its place"
    assert pool.stats().backlog == 2


def test_a_writer_of_another_store_waits_its_turn_then_writes(
    two_stores: tuple[Any, Any],
) -> None:
    first, pool = two_stores
    ids: list[str] = []
    enqueuer = threading.Thread(target=lambda: ids.append(pool.enqueue_action("job", {"i": 1})))
    with _writing(first):
        enqueuer.start()
        holds_for(lambda: not ids, 0.5)  # it waits: no error, no write
    enqueuer.join(10)
    assert len(ids) == 1
    assert pool.status(ids[0]).state == "pending"
    assert pool.stats().backlog == 2


def test_a_killed_writer_frees_its_place_for_the_others(app: Any, store_url: str) -> None:
    pool = _with_job(app).pool("q")
    pool.stats()
    code = textwrap.dedent(
        f"""
        import time, workpool
        app = workpool.App({store_url!r})
        with app.transaction() as tx:
            tx.execute("CREATE TABLE held (x INTEGER)")
            print("holding", flush=True)
            time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        assert _queue_taken(app.store.path)
        ids: list[str] = []
        enqueuer = threading.Thread(target=lambda: ids.append(pool.enqueue_action("job", {})))
        enqueuer.start()
        holds_for(lambda: not ids, 0.3)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        enqueuer.join(10)
        assert len(ids) == 1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert pool.status(ids[0]).state == "pending"
    assert not _queue_taken(app.store.path)
    with app.transaction() as tx:
        assert tx.execute("SELECT name FROM sqlite_master WHERE name = 'held'").fetchall() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_queues_apart_from_its_parent(app: Any) -> None:
    """A lock belongs to the open file, which a fork shares: a child that used its
    parent's would find the queue free while the parent writes, and unlock it."""
    store = _with_job(app).store
    pool = app.pool("q")
    with _writing(app):
        pid = os.fork()
        if pid == 0:  # the child: may it enter while the parent's writer is inside?
            code = 1
            try:
                store._enter_queue(waits=False)
            except WouldWait:
                code = 0
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child entered the parent's place"
        assert _queue_taken(store.path)
    wait_for(lambda: not _queue_taken(store.path), 5)
    assert pool.stats().backlog == 1


def test_an_async_enqueue_goes_to_a_thread_while_another_store_writes(
    two_stores: tuple[Any, Any],
) -> None:
    first, pool = two_stores

    async def client() -> tuple[str, int]:
        with _writing(first):
            enqueue = asyncio.create_task(pool.enqueue_action_async("job", {"i": 1}))
            ticks = 0
            started = time.monotonic()
            while time.monotonic() - started < 0.3:  # the loop keeps running meanwhile
                await asyncio.sleep(0.01)
                ticks += 1
            assert not enqueue.done()
        return await asyncio.wait_for(enqueue, 10), ticks

    work_id, ticks = asyncio.run(client())
    assert ticks >= 10
    assert pool.status(work_id).state == "pending"


def test_writers_go_without_the_queue_where_the_file_system_has_no_flock(
    app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some network file systems answer ``flock`` with ENOLCK: writes must still
    work, meeting SQLite's lock alone."""
    import errno

    from workpool.store.sqlite import store as sqlite_store

    real = sqlite_store.fcntl.flock
    refused: list[int] = []

    def no_locks(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX:
            refused.append(fd)
            raise OSError(errno.ENOLCK, "No locks available")
        real(fd, operation)

    pool = _with_job(app).pool("q")
    monkeypatch.setattr(sqlite_store.fcntl, "flock", no_locks)
    ids = [pool.enqueue_action("job", {"i": i}) for i in range(3)]
    assert len(refused) == 1, "the queue was tried again after it failed"
    monkeypatch.undo()
    assert not _queue_taken(app.store.path)
    assert [pool.status(i).state for i in ids] == ["pending"] * 3
