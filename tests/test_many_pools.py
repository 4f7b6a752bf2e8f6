"""A worker serving many pools: one read finds the pools with due work and room,
its free slots are shared among them in turn, and every limit holds."""

from __future__ import annotations

import time

import pytest

from conftest import Recorder, WorkerThread, ph, run_until_idle
from workpool.runtime.worker import _shares

pytestmark = pytest.mark.timeout(120)


def test_claim_rooms_names_pools_with_due_work_and_their_free_slots(app):
    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store

    def rooms(pools):
        return store.run(lambda tx: store.claim_rooms(tx, pools, time.time()))

    full = app.pool("full", max_parallelism=1)
    full.enqueue_action_batch(nap, [{}, {}])
    roomy = app.pool("roomy", max_parallelism=5)
    roomy.enqueue_action(nap)
    later = app.pool("later", max_parallelism=5)
    later.enqueue_action(nap, run_after=3600)
    app.pool("empty", max_parallelism=5)
    names = ["empty", "full", "later", "nobody", "roomy"]
    assert rooms(names) == {"full": 1, "roomy": 5} == rooms(None)
    assert store.run(lambda tx: store.claim(tx, "full", 10, "w", time.time() + 1))
    assert rooms(names) == {"full": 0, "roomy": 5}, "a full pool with due work has no room"
    roomy.pause()
    assert rooms(names) == {"full": 0} == rooms(None)
    assert rooms([]) == {}


def test_claim_many_claims_each_pool_within_its_ask_and_its_limit(app):
    """One claim over several pools (on PostgreSQL, one statement for all of them):
    each pool gives at most what it was asked, what its limit leaves and what is
    due, oldest due first; a paused pool and an unknown pool give nothing."""

    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store
    now = time.time()
    wide = app.pool("wide", max_parallelism=10)
    wide_ids = wide.enqueue_action_batch(nap, [{}] * 6)
    narrow = app.pool("narrow", max_parallelism=2)
    narrow.enqueue_action_batch(nap, [{}] * 5)
    assert store.run(lambda tx: store.claim(tx, "narrow", 1, "other", now + 1))
    app.pool("later", max_parallelism=5).enqueue_action(nap, run_after=3600)
    paused = app.pool("paused", max_parallelism=5)
    paused.enqueue_action(nap)
    paused.pause()
    asks = {"wide": 4, "narrow": 4, "later": 4, "paused": 4, "nobody": 4}

    got = store.run(lambda tx: store.claim_many_later(tx, asks, "w", now + 1))()
    assert sorted(got) == sorted(asks)
    assert {w.id for w in got["wide"]} == set(wide_ids[:4]), "the first enqueued go first"
    assert len(got["narrow"]) == 1, "its limit of 2 leaves one slot beside the other claim"
    assert got["later"] == got["paused"] == got["nobody"] == []
    for pool, works in got.items():
        assert all(w.pool == pool and w.attempt == 1 and w.kind == "action" for w in works)
    stats = wide.stats()
    assert (stats.running, stats.max_parallelism) == (4, 10)


def test_shares_split_the_free_slots_evenly_and_in_turn():
    rooms = {"a": 512, "b": 512, "c": 2}
    assert _shares(rooms, 10, 0) == {"a": 4, "b": 4, "c": 2}, "what c cannot take goes on"
    assert _shares(rooms, 1000, 0) == {"a": 499, "b": 499, "c": 2}
    assert _shares(rooms, 2000, 0) == rooms
    assert _shares({"a": 0, "b": 3}, 5, 0) == {"b": 3}
    many = {f"p{i}": 100 for i in range(5)}
    assert _shares(many, 2, 0) == {"p0": 1, "p1": 1}
    assert _shares(many, 2, 1) == {"p1": 1, "p2": 1}
    assert _shares(many, 2, 4) == {"p4": 1, "p0": 1}
    assert _shares({}, 5, 3) == {}


def test_fewer_slots_than_pools_with_work_serve_every_pool_in_turn(app, rec: Recorder):
    """Two slots, six pools of six jobs: every pool starts work before any pool has
    started all of its own. A worker that refilled its slots from the first pools
    in name order would drain them before the others started."""

    @app.action(name="step")
    def step(pool: str) -> None:
        rec.add(pool=pool)
        time.sleep(0.02)

    names = [f"p{i}" for i in range(6)]
    for name in names:
        app.pool(name, max_parallelism=100).enqueue_action_batch(step, [{"pool": name}] * 6)
    run_until_idle(app, concurrency=2)

    order = rec.values("pool")
    assert len(order) == 36
    first_drained = next(i for i in range(36) if order[: i + 1].count(order[i]) == 6)
    assert set(order[:first_drained]) == set(names), order


def test_many_limited_pools_hold_every_limit_across_workers(app):
    """Twelve pools of limit 2 served by two workers of 12 slots, as many as the
    limits allow: claims and the refills in the transactions that record outcomes
    share the slots among the pools, every pool reaches its limit, none exceeds it."""
    recs = {f"q{i:02d}": Recorder() for i in range(12)}

    @app.action(name="hold")
    def hold(pool: str) -> None:
        recs[pool].enter()
        time.sleep(0.05)
        recs[pool].leave()

    for name in recs:
        app.pool(name, max_parallelism=2).enqueue_action_batch(hold, [{"pool": name}] * 6)

    workers = [WorkerThread(app, until_idle=True, concurrency=12, lease=2.0) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert {name: r.max_active for name, r in recs.items()} == dict.fromkeys(recs, 2)
    assert all(len(r.calls) == 6 for r in recs.values())


def test_next_due_answers_for_hundreds_of_pools(app):
    """A worker of all pools asks, each time it goes idle, when the next work of any
    of them falls due. SQLite refused the question for more than 250 pools (over
    500 terms in one compound SELECT), so such a worker failed on every idle pass."""

    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store
    names = [f"n{i:03d}" for i in range(300)]
    with app.transaction() as tx:
        for i, name in enumerate(names):
            pool = app.pool(name)
            pool.enqueue_action(nap, tx=tx)  # due now: not "next"
            pool.enqueue_action(nap, run_after=600 + i, tx=tx)
    now = time.time()

    def next_due(pools):
        return store.run(lambda tx: store.next_due(tx, pools, now), readonly=True)

    first = next_due(names)
    assert first is not None and 590 < first - now < 610
    assert next_due(list(reversed(names))) == first
    assert 840 < next_due(names[250:]) - now < 860, "the earliest of the last 50 pools"
    assert next_due(["nobody"]) is None


def test_maintenance_reads_of_hundreds_of_pools_find_work_in_any_of_them(app):
    """A worker's maintenance asks about all its pools in one read each: lost work,
    handler retries due, its own running rows, and how many rows are active.
    PostgreSQL takes the pools as one array (with a parameter each, a worker of 500
    pools bound 1,000 of them twice a second, 2.4 ms of its CPU each time)."""

    @app.action(name="nap")
    def nap() -> None:
        return None

    store = app.store
    names = [f"m{i:03d}" for i in range(300)]
    with app.transaction() as tx:
        for name in names:
            app.pool(name).enqueue_action(nap, run_after=600, tx=tx)
    app.pool(names[-1]).enqueue_action(nap)
    waiting = app.pool(names[150]).enqueue_action(nap)
    now = time.time()
    # Claimed by a worker that never heartbeat: its claim counts as lost.
    claimed = store.run(lambda tx: store.claim_later(tx, names[-1], 1, "gone", now))()
    assert len(claimed) == 1
    with app.transaction() as tx:
        tx.execute(
            f"UPDATE {store.table_prefix}work SET state = 'completing', due_at = {ph(app)}"
            f" WHERE id = {ph(app)}",
            (now - 1, waiting),
        )

    def read(fn):
        return store.run(fn, readonly=True)

    assert read(lambda tx: store.maintenance_due(tx, names, now)) == (True, now - 1)
    assert read(lambda tx: store.maintenance_due(tx, names[:150], now)) == (False, None)
    # These two lock the rows they return: a write transaction.
    assert [w.id for w in store.run(lambda tx: store.lost_work(tx, names, now, 32))] == [
        claimed[0].id
    ]
    assert [w.id for w in store.run(lambda tx: store.due_handlers(tx, names, now, 32))] == [waiting]
    assert read(lambda tx: store.running_of(tx, "gone", names)) == [
        (claimed[0].id, 1, claimed[0].started_at)
    ]
    assert read(lambda tx: store.running_of(tx, "gone", names[:299])) == []
    assert read(lambda tx: store.active_count(tx, names)) == 302
    assert read(lambda tx: store.active_count(tx, names[:150])) == 150
    assert read(lambda tx: store.claimable(tx, names, now)) is False  # the due one is claimed
    app.pool(names[10]).enqueue_action(nap)
    assert read(lambda tx: store.claimable(tx, names, time.time())) is True
    assert read(lambda tx: store.claimable(tx, names[11:], time.time())) is False
