"""The ``_async`` single enqueues: on the event loop's own thread, where the store's
writes end without waiting (SQLite) and their lock is free, or where the store
sends them from the loop (PostgreSQL), else on a worker thread; a lock held
elsewhere never stops the loop."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import workpool
from conftest import run_until_idle, store_kind


class CountingExecutor(ThreadPoolExecutor):
    """The loop's default executor, counting what ``asyncio.to_thread`` hands it."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.calls = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


def _app_with_jobs(app: Any) -> tuple[Any, Any, Any, Any]:
    @app.action(name="job")
    def job(i: int) -> int:
        return i

    @app.mutation(name="mut")
    def mut(tx: Any, i: int) -> int:
        return i

    @app.query(name="qry")
    def qry(tx: Any, i: int) -> int:
        return i

    pool = app.pool("asy")
    pool.stats()  # the schema exists: the first write needs no migration
    return pool, job, mut, qry


def test_single_async_enqueues_run_on_the_loop_where_writes_never_wait(
    app: Any, store_url: str
) -> None:
    pool, job, mut, qry = _app_with_jobs(app)

    async def client() -> tuple[int, list[str]]:
        executor = CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        ids = [await pool.enqueue_action_async(job, {"i": i}) for i in range(5)]
        ids.append(await pool.enqueue_mutation_async(mut, {"i": 5}))
        ids.append(await pool.enqueue_query_async(qry, {"i": 6}))
        return executor.calls, ids

    calls, ids = asyncio.run(client())
    # SQLite: no hand-off at all. PostgreSQL: only the first, which reads the pool's
    # config (a statement at once) before its insert; the others are one statement.
    assert calls == (0 if store_kind(store_url) == "sqlite" else 1)
    assert len(set(ids)) == 7
    run_until_idle(app)
    assert [s.result for s in pool.status_batch(ids)] == [workpool.Success(i) for i in range(7)]


def test_an_async_enqueue_follows_a_config_changed_by_another_client(
    app: Any, store_url: str
) -> None:
    pool, _, _, _ = _app_with_jobs(app)
    first = asyncio.run(pool.enqueue_action_async("job", {"i": 1}))  # the config is known
    other = workpool.App(store_url)
    try:
        other.pool("asy").configure(max_parallelism=3)
    finally:
        other.close()
    # The insert made with the config this Pool knew finds it changed, inserts
    # nothing, and the enqueue reads the new one and inserts with it.
    second = asyncio.run(pool.enqueue_action_async("job", {"i": 2}))
    assert pool._known.max_parallelism == 3
    assert pool.stats().backlog == 2
    run_until_idle(app)
    results = [s.result for s in pool.status_batch([first, second])]
    assert results == [workpool.Success(1), workpool.Success(2)]


def test_bad_input_to_an_async_enqueue_fails_at_the_call_and_writes_nothing(app: Any) -> None:
    pool, job, _, _ = _app_with_jobs(app)

    async def client() -> None:
        with pytest.raises(TypeError):
            await pool.enqueue_action_async(job, {"x": {1, 2}})
        with pytest.raises(workpool.InvalidArgumentError):
            await pool.enqueue_action_async(job, {}, run_at=1.0, run_after=1.0)

    asyncio.run(client())
    assert pool.stats().backlog == 0


def _enqueue_beside(
    pool: Any, hold: Callable[[threading.Event, threading.Event], None]
) -> tuple[str, int, int]:
    """Runs ``hold(holding, release)`` on a thread (it sets ``holding`` once it holds
    a write lock, and keeps the lock until ``release`` is set) and meanwhile an
    ``enqueue_action_async`` and a ticker on the loop: the enqueue's id, the ticks
    while the lock was held, and the loop's hand-offs to a thread."""
    holding, release = threading.Event(), threading.Event()

    async def client() -> tuple[str, int, int]:
        executor = CountingExecutor()
        asyncio.get_running_loop().set_default_executor(executor)
        thread = threading.Thread(target=hold, args=(holding, release))
        thread.start()
        assert holding.wait(10)
        enqueue = asyncio.create_task(pool.enqueue_action_async("job", {"i": 1}))
        ticks = 0
        for _ in range(20):  # 0.2 s in which the loop must keep running
            await asyncio.sleep(0.01)
            ticks += 1
        assert not enqueue.done() or store_kind(pool.app.store.url) == "postgres"
        release.set()
        work_id = await asyncio.wait_for(enqueue, 30)
        calls = executor.calls
        await asyncio.to_thread(thread.join)
        return work_id, ticks, calls

    return asyncio.run(client())


def test_an_async_enqueue_behind_another_threads_write_leaves_the_loop_running(
    app: Any, store_url: str
) -> None:
    pool, _, _, _ = _app_with_jobs(app)

    def hold(holding: threading.Event, release: threading.Event) -> None:
        with app.transaction() as tx:
            # A write: on SQLite the process's writer lock and the file's.
            pool.enqueue_action("job", {"i": 0}, tx=tx)
            holding.set()
            release.wait(10)

    work_id, ticks, calls = _enqueue_beside(pool, hold)
    assert ticks == 20
    if store_kind(store_url) == "sqlite":
        assert calls >= 1  # waited on a thread (the ticker's sleep is not a hand-off)
    assert pool.status(work_id).state == "pending"
    assert pool.stats().backlog == 2


def test_an_async_enqueue_behind_another_processs_write_leaves_the_loop_running(
    app: Any, store_url: str
) -> None:
    if store_kind(store_url) != "sqlite":
        pytest.skip("another connection's write blocks no enqueue on PostgreSQL")
    pool, _, _, _ = _app_with_jobs(app)
    path = app.store.path

    def hold(holding: threading.Event, release: threading.Event) -> None:
        # A connection of its own, as another process has: only the file's lock.
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            holding.set()
            release.wait(10)
            other.execute("COMMIT")
        finally:
            other.close()

    work_id, ticks, calls = _enqueue_beside(pool, hold)
    assert ticks == 20
    assert calls == 1
    assert pool.status(work_id).state == "pending"
    assert pool.stats().backlog == 1
