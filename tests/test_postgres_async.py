"""PostgreSQL only: single ``_async`` enqueues sent from the event loop on connections
of their own; lost connections, ambiguous commits, bounds, closing."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import workpool
from conftest import pg_schema_of, run_until_idle, wait_for

pytestmark = pytest.mark.parametrize("store_url", ["postgres"], indirect=True)


def _pool(app: Any) -> Any:
    @app.action(name="job")
    def job(i: int) -> int:
        return i

    pool = app.pool("pga")
    pool.enqueue_action("job", {"i": -1})  # the config is known: one statement each
    return pool


def _conninfo(url: str) -> str:
    return url.split("?", 1)[0]


def _rows(url: str, work_id: str) -> int:
    schema = pg_schema_of(url)
    with psycopg.connect(_conninfo(url), autocommit=True) as conn:
        work = conn.execute(f'SELECT count(*) FROM "{schema}".work WHERE id = %s', (work_id,))
        return int(work.fetchone()[0])


def _backend_pids(app: Any) -> list[int]:
    return [conn.info.backend_pid for conn in app.store._idle_async]


def test_async_enqueues_from_several_loops_and_tasks_each_land_once(
    app: Any, store_url: str
) -> None:
    pool = _pool(app)

    async def produce(tasks: int) -> list[str]:
        async def one(k: int) -> list[str]:
            return [await pool.enqueue_action_async("job", {"i": k * 10 + i}) for i in range(10)]

        return [i for ids in await asyncio.gather(*(one(k) for k in range(tasks))) for i in ids]

    # One asyncio.run after another: connections left idle by the first loop serve
    # the second.
    ids = asyncio.run(produce(1)) + asyncio.run(produce(8))
    assert len(set(ids)) == 90
    assert 1 <= len(app.store._idle_async) <= 8
    run_until_idle(app)
    results = [s.result for s in pool.status_batch(ids)]
    assert sorted(r.return_value for r in results) == sorted(
        list(range(10)) + [k * 10 + i for k in range(8) for i in range(10)]
    )


def test_a_connection_the_server_closed_while_idle_is_replaced(app: Any, store_url: str) -> None:
    pool = _pool(app)
    first = asyncio.run(pool.enqueue_action_async("job", {"i": 1}))
    [pid] = _backend_pids(app)
    with psycopg.connect(_conninfo(store_url), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_for(lambda: _gone(store_url, pid))
    second = asyncio.run(pool.enqueue_action_async("job", {"i": 2}))
    assert _backend_pids(app) != [pid]
    assert _rows(store_url, first) == 1 and _rows(store_url, second) == 1


def _gone(url: str, pid: int) -> bool:
    with psycopg.connect(_conninfo(url), autocommit=True) as conn:
        found = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
        return int(found.fetchone()[0]) == 0


def test_a_connection_lost_after_the_commit_retries_without_a_second_row(
    app: Any, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool(app)
    store = app.store
    send = store._send_alone
    lost: list[str] = []

    async def committed_then_lost(sql: str, params: Any, keep: bool) -> list[Any]:
        await send(sql, params, keep)  # the server commits the insert...
        lost.append(sql)
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(store, "_send_alone", committed_then_lost)
    work_id = asyncio.run(pool.enqueue_action_async("job", {"i": 7}))
    assert lost  # the statement went from the loop, and its answer was lost
    # ...and the retry on a thread finds the row there instead of failing on it.
    assert _rows(store_url, work_id) == 1
    assert pool.stats().backlog == 2
    run_until_idle(app)
    assert pool.status(work_id).result == workpool.Success(7)


def test_close_closes_the_loops_connections(app: Any, store_url: str) -> None:
    pool = _pool(app)
    asyncio.run(pool.enqueue_action_async("job", {"i": 1}))
    [pid] = _backend_pids(app)
    app.close()
    assert app.store._idle_async == []
    wait_for(lambda: _gone(store_url, pid))


def test_a_canceled_async_enqueue_leaves_no_connection_behind(app: Any, store_url: str) -> None:
    pool = _pool(app)

    async def client() -> tuple[int, str]:
        await pool.enqueue_action_async("job", {"i": 1})
        [pid] = _backend_pids(app)
        task = asyncio.create_task(pool.enqueue_action_async("job", {"i": 2}))
        await asyncio.sleep(0)  # the task sent its statement and waits for the answer
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid, await pool.enqueue_action_async("job", {"i": 3})

    pid, work_id = asyncio.run(client())
    assert _rows(store_url, work_id) == 1
    # The canceled call's connection, in an unknown state, was closed, not kept.
    assert _backend_pids(app) != [pid]
    wait_for(lambda: _gone(store_url, pid))


def test_async_enqueues_open_at_most_pool_size_connections(store_url: str) -> None:
    # Beyond pool_size busy connections, a call goes to a thread (and waits in the
    # threads' pool) instead of opening one more: a burst of tasks cannot take the
    # server's every connection.
    sep = "&" if "?" in store_url else "?"
    app = workpool.App(f"{store_url}{sep}pool_size=2")
    try:
        pool = _pool(app)
        handed: list[int] = []

        async def client() -> list[str]:
            loop = asyncio.get_running_loop()
            run_in_executor = loop.run_in_executor

            def counted(executor: Any, fn: Any, *args: Any) -> Any:
                handed.append(1)
                return run_in_executor(executor, fn, *args)

            loop.run_in_executor = counted  # type: ignore[method-assign]

            async def one(k: int) -> list[str]:
                return [await pool.enqueue_action_async("job", {"i": k * 5 + i}) for i in range(5)]

            return [i for ids in await asyncio.gather(*(one(k) for k in range(8))) for i in ids]

        ids = asyncio.run(client())
        assert len(set(ids)) == 40
        assert handed  # the tasks beyond the first two went to threads
        assert app.store._async_open == len(app.store._idle_async) <= 2
        run_until_idle(app)
        results = [s.result for s in pool.status_batch(ids)]
        assert sorted(r.return_value for r in results) == list(range(40))
    finally:
        app.close()


def test_an_event_loop_psycopg_cannot_use_sends_the_enqueue_from_a_thread(
    app: Any, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # psycopg refuses some loops (Windows' proactor loop) with an InterfaceError.
    pool = _pool(app)

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise psycopg.InterfaceError("Psycopg cannot use the 'ProactorEventLoop'")

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", refuse)
    work_id = asyncio.run(pool.enqueue_action_async("job", {"i": 3}))
    assert _rows(store_url, work_id) == 1
    assert app.store._async_open == 0
