"""PRODUCT.md §1: parallelism is global and exact; raising it takes effect; 0 pauses.

Lessons: pausing stops *starting* work, never recording completions or cancels;
work waiting to retry holds no slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

import pytest

import workpool
from conftest import (
    Recorder,
    _app_url,
    assert_pool_empty,
    background_worker,
    finished,
    holds_for,
    run_until_idle,
    wait_for,
)
from workpool.core.results import success_json
from workpool.runtime.worker import Worker, WorkerOptions, _InFlight
from workpool.store.base import ClaimedWork, PoolConfig, WorkerInfo
from workpool.store.sql import CLAIM_SPLIT_MIN

pytestmark = pytest.mark.timeout(120)


def test_sync_actions_never_exceed_limit_and_reach_it(app, rec: Recorder):
    @app.action(name="busy")
    def busy(i: int) -> int:
        rec.enter(i=i)
        time.sleep(0.08)
        rec.leave()
        return i

    pool = app.pool("limited", max_parallelism=3)
    wids = pool.enqueue_action_batch(busy, [{"i": i} for i in range(15)])
    run_until_idle(app, concurrency=8)

    assert rec.max_active <= 3
    assert rec.max_active == 3, "with 15 items and concurrency 8 the limit must be reached"
    statuses = pool.status_batch(wids)
    assert [s.result for s in statuses] == [workpool.Success(i) for i in range(15)]


def test_async_actions_never_exceed_limit_and_reach_it(app, rec: Recorder):
    @app.action(name="busy_async")
    async def busy_async(i: int) -> int:
        rec.enter(i=i)
        await asyncio.sleep(0.08)
        rec.leave()
        return i * 2

    pool = app.pool("limited_async", max_parallelism=2)
    wids = pool.enqueue_action_batch(busy_async, [{"i": i} for i in range(10)])
    run_until_idle(app, concurrency=10)

    assert rec.max_active == 2
    assert [s.result for s in pool.status_batch(wids)] == [
        workpool.Success(i * 2) for i in range(10)
    ]


def test_at_its_limit_a_freed_slot_is_refilled_on_the_thread_that_freed_it(app, rec: Recorder):
    """With the completer idle, the thread whose sync action ended gives its slot to
    the next attempt and runs it: no hand-off to the completer and back to an
    executor thread while the pool waits. The outcome (and its on_complete) is
    recorded after, once per item."""
    threads: dict[int, str] = {}

    @app.action(name="step")
    def step(i: int) -> int:
        rec.enter(i=i)
        threads[i] = threading.current_thread().name
        time.sleep(0.01)
        rec.leave()
        return i

    @app.mutation(name="noted")
    def noted(tx, work_id, context, result):
        rec.add(i=context, thread=threading.current_thread().name)

    pool = app.pool("one_at_a_time", max_parallelism=1)
    wids = [pool.enqueue_action(step, {"i": i}, on_complete=noted, context=i) for i in range(5)]
    run_until_idle(app, concurrency=4)

    assert rec.max_active == 1
    handled = [c for c in rec.calls if "thread" in c]
    assert sorted(c["i"] for c in handled) == list(range(5)), "on_complete once per item"
    assert len(set(threads.values())) == 1, threads
    assert [s.result for s in pool.status_batch(wids)] == [workpool.Success(i) for i in range(5)]


def test_limit_is_per_pool(app, rec: Recorder):
    per_pool: dict[str, Recorder] = {"a": Recorder(), "b": Recorder()}

    @app.action(name="busy")
    def busy(pool_name: str) -> None:
        per_pool[pool_name].enter()
        rec.enter()
        time.sleep(0.08)
        rec.leave()
        per_pool[pool_name].leave()

    a = app.pool("a", max_parallelism=1)
    b = app.pool("b", max_parallelism=2)
    a.enqueue_action_batch(busy, [{"pool_name": "a"}] * 5)
    b.enqueue_action_batch(busy, [{"pool_name": "b"}] * 6)
    run_until_idle(app, concurrency=10)

    assert per_pool["a"].max_active == 1
    assert per_pool["b"].max_active == 2
    assert rec.max_active <= 3


def test_mutations_count_against_the_limit(app, user_table):
    lock = threading.Lock()
    state = {"active": 0, "max": 0}

    @app.mutation(name="slow_write")
    def slow_write(tx, i: int) -> None:
        with lock:
            state["active"] += 1
            state["max"] = max(state["max"], state["active"])
        time.sleep(0.03)
        user_table.insert(tx, str(i))
        with lock:
            state["active"] -= 1

    pool = app.pool("mutations", max_parallelism=1)
    pool.enqueue_mutation_batch(slow_write, [{"i": i} for i in range(6)])
    run_until_idle(app, concurrency=6)
    assert state["max"] == 1
    assert user_table.count() == 6


def test_raising_max_parallelism_takes_effect_at_once(app, rec: Recorder):
    release = threading.Event()

    @app.action(name="blocked")
    def blocked(i: int) -> None:
        rec.enter(i=i)
        try:
            assert release.wait(30), "never released"
        finally:
            rec.leave()

    pool = app.pool("grow", max_parallelism=1)
    wids = pool.enqueue_action_batch(blocked, [{"i": i} for i in range(6)])
    try:
        with background_worker(app, concurrency=8):
            wait_for(lambda: rec.active == 1)
            holds_for(lambda: rec.active == 1, 0.3)  # the limit holds while work is due
            assert pool.stats().running == 1
            pool.configure(max_parallelism=4)
            wait_for(lambda: rec.active == 4, timeout=5, message="raised limit not used")
            holds_for(lambda: rec.active <= 4, 0.2)
            assert pool.stats().max_parallelism == 4
            release.set()
            wait_for(lambda: all(finished(pool, w) for w in wids), timeout=15)
    finally:
        release.set()
    assert rec.max_active == 4


def test_lowering_max_parallelism_stops_new_starts_beyond_it(app, rec: Recorder):
    release = threading.Event()

    @app.action(name="blocked")
    def blocked(i: int) -> None:
        rec.enter(i=i)
        try:
            release.wait(30)
        finally:
            rec.leave()

    pool = app.pool("shrink", max_parallelism=3)
    wids = pool.enqueue_action_batch(blocked, [{"i": i} for i in range(8)])
    try:
        with background_worker(app, concurrency=8):
            wait_for(lambda: rec.active == 3)
            pool.configure(max_parallelism=1)
            started_before = len(rec.calls)
            release.set()
            wait_for(lambda: all(finished(pool, w) for w in wids), timeout=20)
    finally:
        release.set()
    # After lowering, the remaining 5 ran one at a time.
    later = rec.calls[started_before:]
    assert len(later) == 5
    assert rec.max_active == 3


def test_zero_pauses_running_work_finishes_and_nothing_new_starts(app, store_url, rec: Recorder):
    release = threading.Event()

    @app.action(name="blocked")
    def blocked(i: int) -> int:
        rec.enter(i=i)
        try:
            release.wait(30)
        finally:
            rec.leave()
        return i

    pool = app.pool("pausable", max_parallelism=2)
    first = pool.enqueue_action_batch(blocked, [{"i": 0}, {"i": 1}])
    try:
        with background_worker(app, concurrency=5):
            wait_for(lambda: rec.active == 2)
            pool.configure(max_parallelism=0)
            later = pool.enqueue_action_batch(blocked, [{"i": 2}, {"i": 3}])
            release.set()
            # Pausing never stops completions: the running work is recorded.
            for wid, i in zip(first, (0, 1), strict=True):
                status = wait_for(lambda w=wid: finished(pool, w), timeout=10)
                assert status.result == workpool.Success(i)
            holds_for(lambda: len(rec.calls) == 2, 0.5)
            for wid in later:
                status = pool.status(wid)
                assert status.state == "pending"
                assert status.reason == "paused"
            stats = pool.stats()
            assert stats.paused is True
            assert stats.max_parallelism == 0
            assert stats.running == 0
    finally:
        release.set()

    # A paused pool counts as idle: run_worker(until_idle=True) returns.
    run_until_idle(app, timeout=15)
    assert len(rec.calls) == 2

    # Unpausing (persisted, seen by a new App too) lets the rest run.
    other = workpool.App(store_url)
    try:
        assert other.pool("pausable").stats().paused is True
        other.pool("pausable").configure(max_parallelism=2)
    finally:
        other.close()
    run_until_idle(app)
    assert [s.result for s in pool.status_batch(later)] == [
        workpool.Success(2),
        workpool.Success(3),
    ]


def test_paused_pool_still_records_cancels_and_runs_their_on_complete(app, rec: Recorder):
    @app.action(name="never")
    def never(i: int) -> None:
        rec.add(kind="action", i=i)

    @app.mutation(name="done")
    def done(tx, work_id, context, result):
        rec.add(kind="done", work_id=work_id, result=result)

    pool = app.pool("paused_cancels", max_parallelism=0)
    with_handler = pool.enqueue_action(never, {"i": 1}, on_complete=done)
    without = pool.enqueue_action(never, {"i": 2})
    assert pool.status(with_handler).reason == "paused"
    pool.cancel(with_handler)
    pool.cancel(without)
    assert pool.status(without) == workpool.Finished(workpool.Canceled())
    with background_worker(app):
        status = wait_for(lambda: finished(pool, with_handler), timeout=10)
    assert status.result == workpool.Canceled()
    assert rec.count(kind="action") == 0
    assert rec.count(kind="done") == 1
    assert_pool_empty(pool)


def test_work_waiting_to_retry_holds_no_slot(app, rec: Recorder):
    @app.action(name="flaky")
    def flaky() -> str:
        rec.add(fn="flaky", attempt=workpool.current().attempt)
        if workpool.current().attempt == 1:
            raise RuntimeError("first attempt fails")
        return "ok"

    @app.action(name="other")
    def other(i: int) -> int:
        rec.add(fn="other", i=i)
        return i

    pool = app.pool("retry_slot", max_parallelism=1)
    retrying = pool.enqueue_action(
        flaky, retry=workpool.RetryBehavior(max_attempts=2, initial_backoff=1.0, base=2.0)
    )
    others = pool.enqueue_action_batch(other, [{"i": i} for i in range(3)], run_after=0.05)
    run_until_idle(app, concurrency=4)

    order = [c["fn"] for c in rec.calls]
    assert order[0] == "flaky"
    # While flaky waits >= 0.5 s for its retry, the single slot serves the others.
    assert order[1:4] == ["other", "other", "other"], order
    assert order[4] == "flaky"
    assert pool.status(retrying).result == workpool.Success("ok")
    assert all(s.result.kind == "success" for s in pool.status_batch(others))


def test_large_max_parallelism_is_accepted(app):
    pool = app.pool("wide", max_parallelism=5000)
    assert pool.stats().max_parallelism == 5000
    pool.configure(max_parallelism=100_000)
    assert pool.stats().max_parallelism == 100_000


def test_claimable_is_false_only_when_a_claim_would_get_nothing(app):
    """The look a worker takes before claiming (after an empty claim) must never hide
    work a claim would get: full, paused, empty and not-yet-due pools say no."""

    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store
    now = time.time()

    def claimable(pools):
        return store.run(lambda tx: store.claimable(tx, pools, time.time()))

    full = app.pool("full", max_parallelism=1)
    full.enqueue_action_batch(nap, [{}, {}])
    later = app.pool("later", max_parallelism=5)
    later.enqueue_action(nap, run_after=3600)
    assert claimable(["full"]) and claimable(None)
    assert not claimable(["later"]), "work due in an hour is not claimable now"
    assert not claimable(["nobody"]) and not claimable([])
    got = store.run(lambda tx: store.claim(tx, "full", 10, "w", now + 1))
    assert len(got) == 1
    assert not claimable(["full"]), "the pool is at its limit"
    full.configure(max_parallelism=2)
    assert claimable(["full"])
    full.pause()
    assert not claimable(["full", "later"]) and not claimable(None)


def test_a_claim_reads_the_stored_limit_under_its_lock(app):
    """A claim takes its pool's max_parallelism from the store, not from the worker's
    copy: a limit set a moment ago applies to the very next claim, and a pool with
    no stored config (its row gone) claims nothing. PostgreSQL's LEAST and GREATEST
    skip NULLs, so without the coalesce a missing row would mean no limit at all."""

    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store
    now = time.time() + 1
    pool = app.pool("stored", max_parallelism=1)
    pool.enqueue_action_batch(nap, [{} for _ in range(6)])

    def claim(limit: int) -> int:
        return len(store.run(lambda tx: store.claim(tx, "stored", limit, "w", now)))

    assert claim(10) == 1
    pool.configure(max_parallelism=3)
    assert claim(10) == 2
    with app.transaction() as tx:
        tx.execute(store._sql("DELETE FROM {s}pools WHERE name = ?"), ("stored",))
    assert claim(10) == 0


def test_a_claim_that_waited_for_the_claim_lock_counts_the_claim_before_it(app):
    """Two claims of one pool at once, with room for one: the second waits for the
    first's claim lock and, once the first commits, counts its row and takes none.
    (On PostgreSQL the claim function counts in a statement of its own, whose
    snapshot is taken after the lock was granted: one taken with the call would
    not see the first claim, and both would start a job under a limit of 1.)"""

    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store
    now = time.time() + 1
    app.pool("once", max_parallelism=1).enqueue_action_batch(nap, [{} for _ in range(4)])
    holding, release = threading.Event(), threading.Event()
    got: dict[str, int] = {}

    def first(tx):
        claimed = store.claim(tx, "once", 5, "w1", now)
        holding.set()
        assert release.wait(10)
        return claimed

    def run(name, body):
        got[name] = len(store.run(body))

    one = threading.Thread(target=run, args=("first", first))
    two = threading.Thread(
        target=run, args=("second", lambda tx: store.claim(tx, "once", 5, "w2", now))
    )
    one.start()
    try:
        assert holding.wait(10)
        two.start()
        two.join(0.5)
        assert two.is_alive(), "the second claim did not wait for the first's lock"
    finally:
        release.set()  # a failed check must not leave the first claim holding the lock
        one.join(10)
        if two.ident is not None:  # started
            two.join(10)
    assert got == {"first": 1, "second": 0}
    assert app.pool("once").stats().running == 1


@pytest.mark.parametrize("blocked_by", ["pause", "limit"])
def test_due_work_that_cannot_start_does_not_keep_the_worker_busy(app, blocked_by):
    """Due work held back by a pause or a full limit waits for a wake-up: the worker
    must not poll the store (claim, then look for the next due time) every millisecond."""
    gate = threading.Event()

    @app.action(name="held")
    def held() -> None:
        gate.wait(30)

    pool = app.pool("held", max_parallelism=1)
    pool.enqueue_action_batch(held, [{} for _ in range(20)])
    if blocked_by == "pause":
        pool.pause()
    transactions = []
    real_run = app.store.run

    def counting_run(fn, **kwargs):
        transactions.append(threading.current_thread().name)
        return real_run(fn, **kwargs)

    app.store.run = counting_run
    try:
        with background_worker(app, concurrency=4):
            if blocked_by == "limit":
                wait_for(lambda: pool.stats().running == 1, 10, message="nothing started")
            transactions.clear()
            time.sleep(1.5)
            seen = len(transactions)
            gate.set()
    finally:
        gate.set()
        app.store.run = real_run
    # Maintenance reads about ten times a second; polling would be ~1,500 here.
    assert seen < 150, f"{seen} store transactions in 1.5 s while nothing could start"


def test_a_worker_at_its_limit_hands_slots_over_without_waking_its_dispatcher(
    app, rec: Recorder, monkeypatch
):
    """Each end of an attempt at the limit is recorded with the claim of the next
    one, in one transaction: the dispatcher, parked with every local slot busy,
    has nothing to do. It used to be woken by every record (about one pass per
    job), only to park again."""
    from workpool.runtime.worker import Worker

    passes = [0]
    dispatch_once = Worker._dispatch_once

    def counted(self: Worker) -> float | None:
        passes[0] += 1
        return dispatch_once(self)

    monkeypatch.setattr(Worker, "_dispatch_once", counted)

    @app.action(name="nap")
    def nap(i: int) -> None:
        rec.add(i=i)
        time.sleep(0.01)

    pool = app.pool("handover", max_parallelism=2)
    ids = pool.enqueue_action_batch(nap, [{"i": i} for i in range(40)])
    with background_worker(app, concurrency=2, pools=["handover"]):
        wait_for(lambda: all(finished(pool, wid) for wid in ids), timeout=30)
    assert sorted(rec.values("i")) == list(range(40))
    assert passes[0] < 20, f"{passes[0]} dispatcher passes for 40 hand-overs"


def _count_hand_overs(monkeypatch) -> list[int]:
    """[hand-overs that gave a slot on, all hand-overs] of every worker from now on."""
    counts = [0, 0]
    hand_over = Worker._hand_over

    def counted(self: Worker, item: Any) -> Any:
        kept = hand_over(self, item)
        counts[0] += kept is not None
        counts[1] += 1
        return kept

    monkeypatch.setattr(Worker, "_hand_over", counted)
    return counts


def test_slots_at_the_limit_go_on_before_the_records_and_the_limit_holds(
    app, rec: Recorder, monkeypatch
):
    """Actions that end far apart (50 ms asleep, two slots): most slots go to the
    next attempt before the ended one is recorded, never more than the limit run
    at once, and every item finishes with its own result and on_complete once."""
    counts = _count_hand_overs(monkeypatch)

    @app.action(name="doze")
    def doze(i: int) -> int:
        rec.enter(i=i)
        time.sleep(0.05)
        rec.leave()
        return i * 3

    @app.mutation(name="noted")
    def noted(tx, work_id, context, result):
        rec.add(noted=context, value=result.return_value)

    pool = app.pool("dozing", max_parallelism=2)
    ids = [pool.enqueue_action(doze, {"i": i}, on_complete=noted, context=i) for i in range(30)]
    run_until_idle(app, concurrency=2)

    assert rec.max_active == 2
    assert [s.result for s in pool.status_batch(ids)] == [
        workpool.Success(i * 3) for i in range(30)
    ]
    assert sorted((c["noted"], c["value"]) for c in rec.calls if "noted" in c) == [
        (i, i * 3) for i in range(30)
    ]
    assert counts[0] >= 15, f"{counts} hand-overs for 30 items"
    stats = pool.stats()
    assert (stats.running, stats.completing, stats.backlog) == (0, 0, 0)


def test_actions_that_end_close_together_go_through_batched_records(
    app, rec: Recorder, monkeypatch
):
    """A hand-over is a transaction per attempt: where actions end closer together
    than two hand-overs take (no-ops at a limit of 4), their outcomes and the
    claims for their slots go through the completer's batches instead."""
    counts = _count_hand_overs(monkeypatch)

    @app.action(name="blip")
    def blip(i: int) -> None:
        rec.enter(i=i)
        rec.leave()

    pool = app.pool("blips", max_parallelism=4)
    pool.enqueue_action_batch(blip, [{"i": i} for i in range(400)])
    run_until_idle(app, concurrency=4)

    assert rec.max_active <= 4
    assert sorted(rec.values("i")) == list(range(400))
    assert counts[1] < 100, f"{counts[1]} hand-overs for 400 no-ops"


def _labelled_app(url: str, label: str, rec: Recorder, seconds: float) -> Any:
    """An App whose action ``step`` notes which App's worker ran it."""
    labelled = workpool.App(url)

    @labelled.action(name="step")
    def step(i: int) -> None:
        rec.enter(i=i, worker=label)
        time.sleep(seconds)
        rec.leave()

    return labelled


def _drained(pool: Any) -> bool:
    stats = pool.stats()
    return (stats.running, stats.backlog, stats.scheduled) == (0, 0, 0)


def test_workers_that_serve_a_pool_share_its_limit(store_url, rec: Recorder):
    """Two workers of 4 slots each, a pool of limit 4: each runs about half of the
    work (without shares the first to claim kept every slot, its records refilling
    the slots they freed, and the other ran next to nothing), and together they
    never exceed the limit."""
    first = _labelled_app(store_url, "first", rec, 0.05)
    second = _labelled_app(store_url, "second", rec, 0.05)
    try:
        pool = first.pool("shared", max_parallelism=4)
        pool.stats()  # the store made and the pool's config written before the workers
        with (
            background_worker(first, concurrency=4, lease=1.5),
            background_worker(second, concurrency=4, lease=1.5),
        ):
            store = first.store
            wait_for(lambda: len(store.run(lambda tx: store.live_workers(tx, time.time()))) == 2)
            time.sleep(1.0)  # both have read the live workers since (every 0.5 s)
            pool.enqueue_action_batch("step", [{"i": i} for i in range(48)])
            wait_for(lambda: _drained(pool), timeout=60)
    finally:
        first.close()
        second.close()
    assert rec.max_active <= 4
    ran = Counter(call["worker"] for call in rec.calls)
    assert sum(ran.values()) == 48
    # A fair split is 24 each: 22 and 26 in 18 runs on both stores, 8 of them with
    # both cores busy with other processes.
    assert min(ran["first"], ran["second"]) >= 16, ran


def test_a_share_left_to_a_worker_that_takes_nothing_is_taken_back(app, rec: Recorder):
    """A live worker row that serves the pool and never claims (a worker busy
    elsewhere, or gone and not yet expired): the one running worker still reaches
    the limit and drains the pool, taking back the slots it left to the other."""
    runner = _labelled_app(_app_url(app), "runner", rec, 0.03)
    try:
        pool = runner.pool("shared", max_parallelism=4)
        pool.stats()  # the store made
        _live(runner, "ghost", [])
        pool.enqueue_action_batch("step", [{"i": i} for i in range(40)])
        run_until_idle(runner, concurrency=4)
        assert _drained(pool)
    finally:
        runner.close()
    assert rec.max_active == 4
    assert len(rec.calls) == 40
    # Its records left the ghost's share (2 of the 4 slots) free; past the grace
    # it took them back: the last jobs, too, started beside 3 others.
    assert max(call["active"] for call in rec.calls[-12:]) == 4, rec.calls


class _Config:
    def __init__(self, limit: int) -> None:
        self.max_parallelism = limit


def _worker_with(app: Any, concurrency: int, running: int, limit: int, peers: int) -> Worker:
    worker = Worker(app.store, app.registry, WorkerOptions(concurrency=concurrency))
    worker.configs = {"p": cast(PoolConfig, _Config(limit))}
    worker.peers_seen([[]] * (peers - 1) + [["p"]])
    for i in range(running):
        work = cast(ClaimedWork, SimpleNamespace(id=f"w{i}", attempt=1, pool="p"))
        worker._inflight[(work.id, 1)] = _InFlight(work, None)
    return worker


def test_a_records_refill_is_capped_at_the_workers_share(app):
    """The share is the limit over the live workers serving the pool, rounded up;
    a record refills up to it, and only slots it frees beyond it wait for the
    grace (they are the others'). One worker, a share as big as the worker's slots,
    or a pool whose share was lifted is not capped."""
    # Limit 5 over 2 workers: a share of 3. Running 3 after the finish: none left.
    worker = _worker_with(app, concurrency=5, running=3, limit=5, peers=2)
    assert worker._share("p", time.monotonic()) == 3
    rooms = {"p": 2}
    worker._hold_back(rooms, {"p": 2})
    assert rooms == {"p": 0}
    assert worker._held == {"p"} and worker._grace_at is not None

    # Running 1: 2 more fit; a record that freed 1 refills it and is not held back.
    worker = _worker_with(app, concurrency=5, running=1, limit=5, peers=2)
    rooms = {"p": 4}
    worker._hold_back(rooms, {"p": 1})
    assert rooms == {"p": 2}
    assert worker._held == set() and worker._grace_at is None

    assert _worker_with(app, 5, 3, 5, peers=1)._share("p", time.monotonic()) is None
    assert _worker_with(app, 2, 3, 5, peers=2)._share("p", time.monotonic()) is None
    lifted = _worker_with(app, 5, 3, 5, peers=2)
    lifted._unshared["p"] = time.monotonic() + 60
    assert lifted._share("p", time.monotonic()) is None
    rooms = {"p": 2}
    lifted._hold_back(rooms, {"p": 2})
    assert rooms == {"p": 2} and lifted._grace_at is None
    # Workers serving other pools only do not count.
    other = _worker_with(app, 5, 3, 5, peers=1)
    other.peers_seen([["p"], ["q"], ["q", "r"]])
    assert other._share("p", time.monotonic()) is None


def _register_noop(app: Any) -> None:
    @app.action(name="noop")
    def noop() -> None:
        return None


def _live(app: Any, worker_id: str, pools: list[str], ttl: float = 600.0) -> None:
    """A row in the workers table, as a worker's heartbeat writes it."""
    store, now = app.store, time.time()
    info = WorkerInfo(id=worker_id, host="elsewhere", pid=1, pools=pools)
    store.run(lambda tx: store.heartbeat(tx, info, now, now + ttl))


def _claim(app: Any, pool: str, limit: int, worker: str = "w1") -> list[ClaimedWork]:
    store = app.store
    return list(store.run(lambda tx: store.claim(tx, pool, limit, worker, time.time())))


def _pool_of_two_workers(app: Any, name: str, max_parallelism: int) -> Any:
    """A new pool of no-op actions, and two live workers, w1 and w2, that serve
    every pool."""
    _register_noop(app)
    pool = app.pool(name, max_parallelism=max_parallelism)
    pool.stats()  # the store made
    _live(app, "w1", [])
    _live(app, "w2", [])
    return pool


def _finish(app: Any, works: list[ClaimedWork], worker: str = "w1") -> None:
    """The attempts ``works`` succeeded, as their worker records them."""
    store = app.store
    items = [
        (w.id, w.attempt, success_json("null"), w.pool, w.started_at, w.place, "running")
        for w in works
    ]
    done = store.run(lambda tx: store.finish_succeeded(tx, items, time.time(), worker))()
    assert len(done) == len(works)


def test_a_claim_of_a_burst_smaller_than_itself_takes_its_workers_share(app):
    """A claim that finds fewer due rows than it may take, CLAIM_SPLIT_MIN or more,
    takes what brings its worker to its share of the pool's work in hand: the due
    and running rows over the live workers that serve the pool, rounded up. Workers
    of other pools and expired ones do not count. Fewer due rows than that, or at
    least as many as it may take, and it takes what it may. The same on both stores."""
    assert CLAIM_SPLIT_MIN == 128
    _register_noop(app)
    pool = app.pool("burst", max_parallelism=100_000)
    pool.stats()  # the store made
    _live(app, "w1", ["burst"])
    _live(app, "w2", [])  # serves every pool
    _live(app, "other", ["elsewhere"])
    _live(app, "expired", [], ttl=-1.0)
    ids = pool.enqueue_action_batch("noop", [{} for _ in range(300)])

    first = _claim(app, "burst", 1000)
    assert len(first) == 150  # 300 in hand over 2 live workers
    assert _claim(app, "burst", 1000) == []  # w1 runs its share already
    second = _claim(app, "burst", 1000, worker="w2")
    assert len(second) == 150  # not half of the 150 left: w1's running rows count
    assert sorted(w.id for w in first + second) == sorted(ids)

    # At least as many due as the claim may take: it takes what it may.
    pool.enqueue_action_batch("noop", [{} for _ in range(300)])
    assert len(_claim(app, "burst", 100, worker="w3")) == 100
    # Ten workers more: 200 due and 400 running over 12 is 50 a worker.
    for i in range(10):
        _live(app, f"ghost{i}", ["burst"])
    assert len(_claim(app, "burst", 1000, worker="w4")) == 50
    # Under CLAIM_SPLIT_MIN due: all of them.
    small = app.pool("small", max_parallelism=100_000)
    small.enqueue_action_batch("noop", [{} for _ in range(127)])
    assert len(_claim(app, "small", 1000)) == 127


def test_a_worker_whose_peers_are_busy_takes_the_whole_burst(app):
    """The others' running rows count in the share: a worker whose peers run work
    of the pool takes a burst that its share covers, where with idle peers it would
    take half."""
    pool = _pool_of_two_workers(app, "busy", 100_000)
    pool.enqueue_action_batch("noop", [{} for _ in range(400)])
    assert len(_claim(app, "busy", 400, worker="w2")) == 400
    pool.enqueue_action_batch("noop", [{} for _ in range(300)])
    assert len(_claim(app, "busy", 1000)) == 300  # a share of (300 + 400) / 2 = 350


def test_a_claim_stopped_by_the_pools_limit_takes_all_the_limit_leaves(app):
    """Where the pool's limit, not the due rows, stops a claim, there is no burst to
    share: the claim takes all the limit leaves, as any claim at a limit does."""
    pool = _pool_of_two_workers(app, "capped", 200)
    pool.enqueue_action_batch("noop", [{} for _ in range(300)])
    assert len(_claim(app, "capped", 1000)) == 200  # not a share of 300 over 2
    assert _claim(app, "capped", 1000, worker="w2") == []


def test_rows_left_to_a_worker_that_does_not_claim_them_run_on_the_others(app):
    """A claim that took its share does not ask to claim again at once: the rest is
    the other workers'. One that never claims them (alive, but stuck) only delays
    them: each of this worker's next claims, after its attempts end, takes its share
    of what is left, and the last ones, under CLAIM_SPLIT_MIN, whole."""
    _register_noop(app)
    pool = app.pool("burst", max_parallelism=100_000)
    store = app.store
    ids = pool.enqueue_action_batch("noop", [{} for _ in range(300)])
    worker = Worker(store, app.registry, WorkerOptions(pools=["burst"], concurrency=1000))
    worker.configs = {c.name: c for c in store.run(store.load_pools, readonly=True)}
    _live(app, worker.info.id, ["burst"])
    _live(app, "stuck", ["burst"])  # a live worker that takes nothing

    def claim() -> tuple[list[ClaimedWork], bool]:
        claimed, more = store.run(lambda tx: worker._claim_in(tx, free=1000))()
        return claimed, more

    rounds = []
    while True:
        claimed, more = claim()
        assert not more
        if not claimed:
            assert len(rounds) < 4  # after a claim that took its share, not before
            _finish(app, [w for got in rounds[-1:] for w in got], worker=worker.info.id)
            claimed, more = claim()
            if not claimed:
                break
        rounds.append(claimed)
    assert [len(got) for got in rounds] == [150, 75, 75]
    assert sorted(w.id for got in rounds for w in got) == sorted(ids)


def test_a_claim_from_many_pools_takes_its_share_of_each(app):
    """The claim of several pools at once (one statement on PostgreSQL) splits each
    pool as a claim of one pool does: a burst of CLAIM_SPLIT_MIN or more leaves the
    other workers their share, a smaller one is taken whole."""
    _register_noop(app)
    big, small = (
        app.pool("big", max_parallelism=100_000),
        app.pool("small", max_parallelism=100_000),
    )
    big.enqueue_action_batch("noop", [{} for _ in range(300)])
    small.enqueue_action_batch("noop", [{} for _ in range(50)])
    _live(app, "w1", [])
    _live(app, "w2", ["big", "small"])
    store = app.store

    def claim(worker: str) -> dict[str, int]:
        asks = {"big": 1000, "small": 1000}
        got = store.run(lambda tx: store.claim_many_later(tx, asks, worker, time.time()))()
        return {pool: len(works) for pool, works in got.items()}

    assert claim("w1") == {"big": 150, "small": 50}
    assert claim("w1") == {"big": 0, "small": 0}
    assert claim("w2") == {"big": 150, "small": 0}
