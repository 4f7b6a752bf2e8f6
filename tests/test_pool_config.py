"""Pool config at run time: pause and resume survive the options declared in code."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

import workpool
from conftest import run_until_idle
from workpool.store.base import NewWork, PoolConfig


def test_declared_limit_does_not_undo_a_run_time_pause(app: Any, store_url: str) -> None:
    app.pool("mail", max_parallelism=4).configure()
    operator = workpool.App(store_url)
    try:
        operator.pool("mail").pause()
    finally:
        operator.close()
    # A worker or client restarting with the code's declaration keeps the pool paused...
    restarted = workpool.App(store_url)
    try:
        declared = restarted.pool("mail", max_parallelism=6)
        declared.configure(log_level="INFO")
        stats = declared.stats()
        assert (stats.paused, stats.max_parallelism) == (True, 0)
        # ... and resume() restores the declared limit.
        assert declared.resume().max_parallelism == 6
        assert declared.stats().paused is False
    finally:
        restarted.close()


def test_explicit_configure_unpauses(app: Any) -> None:
    pool = app.pool("p", max_parallelism=3)
    pool.pause()
    assert pool.stats().paused
    assert pool.configure(max_parallelism=8).max_parallelism == 8
    assert pool.resume().max_parallelism == 8  # resuming a running pool changes nothing


def test_resume_without_a_pause_uses_the_default_limit(app: Any) -> None:
    pool = app.pool("z", max_parallelism=0)  # declared paused in code
    pool.configure()
    assert pool.stats().paused
    assert pool.resume().max_parallelism == 10


def retry_thrice_elsewhere(store_url: str, pool: str) -> None:
    """Another client makes ``pool``'s actions retry (3 attempts), behind our back."""
    operator = workpool.App(store_url)
    try:
        operator.pool(pool).configure(
            retry_actions_by_default=True,
            default_retry=workpool.RetryBehavior(max_attempts=3, initial_backoff=0.001, base=1.0),
        )
    finally:
        operator.close()


@pytest.mark.parametrize("where", ["alone", "in_the_callers_transaction"])
def test_an_enqueue_follows_config_changed_by_another_client(
    app: Any, store_url: str, where: str
) -> None:
    """A Pool enqueues with the config it last saw only while the store still holds
    it: a change made elsewhere, or a deleted pool row, sends it back to read. The
    same in the caller's transaction, where the checked insert runs at once."""
    attempts: dict[str, int] = {}

    @app.action(name="fails")
    def fails() -> None:
        wid = workpool.current().work_id
        attempts[wid] = attempts.get(wid, 0) + 1
        raise RuntimeError("no")

    pool = app.pool("mail")

    def enqueue() -> str:
        if where == "alone":
            return str(pool.enqueue_action(fails))
        with app.transaction() as tx:
            wid = pool.enqueue_action(fails, tx=tx)
            assert pool.status(wid, tx=tx).state == "pending", "there for what follows"
            return str(wid)

    before = enqueue()
    retry_thrice_elsewhere(store_url, "mail")
    after = enqueue()
    store = app.store
    with app.transaction() as tx:
        tx.execute(store._sql("DELETE FROM {s}pools WHERE name = ?"), ("mail",))
    recreated = enqueue()
    run_until_idle(app)
    assert attempts == {before: 1, after: 3, recreated: 1}
    assert [c.name for c in store.run(store.load_pools)] == ["mail"]


@pytest.mark.parametrize("where", ["alone", "in_the_callers_transaction"])
def test_a_batch_of_several_chunks_is_enqueued_whole_with_the_stored_config(
    app: Any, store_url: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big batch builds and inserts its rows a chunk at a time, in one transaction:
    all of them or none, in order, and all made with the config the store holds,
    also when it changed elsewhere since this Pool last saw it."""
    monkeypatch.setattr("workpool.pool.ENQUEUE_CHUNK", 2)
    attempts: dict[str, int] = {}

    @app.action(name="fails")
    def fails(i: int) -> None:
        wid = workpool.current().work_id
        attempts[wid] = attempts.get(wid, 0) + 1
        raise RuntimeError("no")

    pool = app.pool("bulk")

    def enqueue(n: int = 5) -> list[str]:
        args = [{"i": i} for i in range(n)]
        if where == "alone":
            return list(pool.enqueue_action_batch(fails, args))
        with app.transaction() as tx:
            return list(pool.enqueue_action_batch(fails, args, tx=tx))

    before = enqueue()
    retry_thrice_elsewhere(store_url, "bulk")
    after = enqueue()  # the check fails: read the config, then insert
    again = enqueue()  # the check passes
    with pytest.raises(RuntimeError, match="rolled back"), app.transaction() as tx:
        dropped = pool.enqueue_action_batch(fails, [{"i": i} for i in range(5)], tx=tx)
        raise RuntimeError("rolled back")
    assert len(set(before + after + again + dropped)) == 20
    assert all(s == workpool.Finished(None) for s in pool.status_batch(dropped))
    run_until_idle(app)
    assert attempts == {**dict.fromkeys(before, 1), **dict.fromkeys(after + again, 3)}
    args = [app.inspect(wid).args for wid in before + after + again]
    assert args == [{"i": i} for i in range(5)] * 3


def test_insert_work_if_inserts_only_while_the_config_is_the_stored_one(app: Any) -> None:
    """Every option set, with floats that do not round: the config a Pool keeps must
    pass the check, or every enqueue would quietly take two transactions."""
    store = app.store
    pool = app.pool("q")
    config = pool.configure(
        max_parallelism=4,
        retry_actions_by_default=True,
        default_retry=workpool.RetryBehavior(max_attempts=5, initial_backoff=0.3, base=1.7),
        log_level="DEBUG",
        status_ttl=3600.1,
    )
    now = time.time()

    def item(wid: str) -> NewWork:
        return NewWork(wid, "q", "action", "f", "{}", None, None, None, None, now, now)

    def insert(ids: list[str], config: PoolConfig) -> bool:
        return store.run(lambda tx: store.insert_work_if(tx, [item(i) for i in ids], config))()

    assert insert(["a1", "a2"], config)
    assert insert(["a3"], pool.pause()), "a paused pool: paused_from set"
    assert not insert(["b1"], replace(config, max_parallelism=5)), "a changed config"
    assert not insert(["c1"], replace(config, name="x")), "a pool with no row"
    known = store.run(lambda tx: store.statuses(tx, ["a1", "a2", "a3", "b1", "c1"]))
    assert sorted(known) == ["a1", "a2", "a3"]


def test_insert_work_if_wakes_the_pools_workers_only_when_it_inserts(app: Any) -> None:
    """An enqueue is one statement on PostgreSQL: the check, the insert and the
    notification. A worker of the pool must hear of what it inserted, and nothing
    is announced when the check fails."""
    store = app.store
    config = app.pool("woken").configure(max_parallelism=3)
    now = time.time()

    def insert(wid: str, config: PoolConfig) -> bool:
        item = NewWork(wid, "woken", "action", "f", "{}", None, None, None, None, now, now)
        return store.run(lambda tx: store.insert_work_if(tx, [item], config, notify=True))()

    watcher = store.watcher()
    try:
        watcher.wait(0.1)  # connects (PostgreSQL: LISTEN) and forgets what it saw
        while watcher.wait(0.1):
            pass
        assert not insert("stale", replace(config, max_parallelism=4))
        assert not watcher.wait(0.5), "a failed check announced work"
        assert insert("fresh", config)
        assert watcher.wait(5.0), "the insert did not wake the pool's workers"
    finally:
        watcher.close()
    assert sorted(store.run(lambda tx: store.statuses(tx, ["fresh", "stale"]))) == ["fresh"]
