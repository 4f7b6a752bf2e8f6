"""PRODUCT.md §6: run_at/run_after delay the first start; far past = now; absurd future = error."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta, timezone

import pytest

import workpool
from conftest import Recorder, assert_pool_empty, background_worker, run_until_idle, wait_for
from workpool.runtime.worker import Worker, WorkerOptions

pytestmark = pytest.mark.timeout(120)

YEAR = 365 * 86_400.0


@pytest.fixture
def job(app, rec: Recorder):
    @app.action(name="job")
    def job(i: int = 0) -> int:
        rec.add(i=i)
        return i

    return job


def test_run_after_delays_the_start(app, job, rec: Recorder):
    pool = app.pool("sched")
    before = time.time()
    wid = pool.enqueue_action(job, {"i": 1}, run_after=1.0)
    status = pool.status(wid)
    assert status.state == "pending"
    assert status.reason == "scheduled"
    assert status.previous_attempts == 0
    assert before + 0.99 <= status.due_at <= time.time() + 1.01
    assert pool.stats().scheduled == 1
    assert pool.stats().backlog == 0
    run_until_idle(app)
    assert len(rec.calls) == 1
    assert rec.calls[0]["t"] >= before + 0.99
    assert pool.status(wid).result == workpool.Success(1)


def test_run_at_aware_datetime_delays_the_start(app, job, rec: Recorder):
    pool = app.pool("sched")
    at = datetime.now(UTC) + timedelta(seconds=0.8)
    wid = pool.enqueue_action(job, run_at=at)
    status = pool.status(wid)
    assert status.reason == "scheduled"
    assert status.due_at == pytest.approx(at.timestamp(), abs=0.01)
    run_until_idle(app)
    assert rec.calls[0]["t"] >= at.timestamp() - 0.01


def test_run_at_in_another_time_zone(app, job, rec: Recorder):
    pool = app.pool("sched")
    tz = timezone(timedelta(hours=-7))
    at = datetime.now(tz) + timedelta(seconds=0.5)
    wid = pool.enqueue_action(job, run_at=at)
    assert pool.status(wid).due_at == pytest.approx(at.timestamp(), abs=0.01)
    run_until_idle(app)
    assert rec.calls[0]["t"] >= at.timestamp() - 0.01


def test_run_at_unix_seconds(app, job, rec: Recorder):
    pool = app.pool("sched")
    at = time.time() + 0.6
    wid = pool.enqueue_action(job, run_at=at)
    assert pool.status(wid).due_at == pytest.approx(at, abs=0.01)
    run_until_idle(app)
    assert rec.calls[0]["t"] >= at - 0.01


def test_run_at_in_the_past_means_now(app, job, rec: Recorder):
    pool = app.pool("sched")
    recent_past = pool.enqueue_action(job, {"i": 1}, run_at=time.time() - 30)
    far_past = pool.enqueue_action(job, {"i": 2}, run_at=datetime(2000, 1, 1, tzinfo=UTC))
    epoch = pool.enqueue_action(job, {"i": 3}, run_at=0)
    now = time.time()
    for wid in (recent_past, far_past, epoch):
        status = pool.status(wid)
        assert status.state == "pending"
        assert status.reason == "due"
        assert status.due_at <= now + 0.01
    # "more than a year in the past: now"
    assert pool.status(far_past).due_at == pytest.approx(now, abs=5)
    assert pool.status(epoch).due_at == pytest.approx(now, abs=5)
    assert pool.stats().backlog == 3
    run_until_idle(app)
    assert sorted(rec.values("i")) == [1, 2, 3]


def test_negative_run_after_means_now(app, job, rec: Recorder):
    pool = app.pool("sched")
    wid = pool.enqueue_action(job, run_after=-5)
    assert pool.status(wid).reason == "due"
    run_until_idle(app)
    assert len(rec.calls) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"run_at": lambda: time.time() + 4 * YEAR + 86_400},
        {"run_at": lambda: datetime.now(UTC) + timedelta(days=5 * 365)},
        {"run_at": lambda: datetime(9999, 1, 1, tzinfo=UTC)},
        {"run_after": lambda: 4 * YEAR + 86_400},
        {"run_after": lambda: 1e300},
    ],
    ids=["unix+4y", "datetime+5y", "year9999", "run_after+4y", "run_after_1e300"],
)
def test_absurd_future_times_are_a_clear_error(app, job, kwargs):
    pool = app.pool("sched")
    values = {k: v() for k, v in kwargs.items()}
    with pytest.raises(ValueError) as info:
        pool.enqueue_action(job, **values)
    assert isinstance(info.value, workpool.WorkpoolError)
    with pytest.raises(ValueError):
        pool.enqueue_action_batch(job, [{}, {}], **values)
    assert_pool_empty(pool)


def test_three_years_ahead_is_accepted(app, job):
    pool = app.pool("sched")
    wid = pool.enqueue_action(job, run_after=3 * YEAR)
    assert pool.status(wid).reason == "scheduled"
    pool.cancel(wid)


def test_run_at_and_run_after_together_is_an_error(app, job):
    pool = app.pool("sched")
    with pytest.raises(ValueError):
        pool.enqueue_action(job, run_at=time.time() + 5, run_after=5)
    assert_pool_empty(pool)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_times_are_errors(app, job, bad):
    pool = app.pool("sched")
    with pytest.raises(ValueError):
        pool.enqueue_action(job, run_after=bad)
    with pytest.raises(ValueError):
        pool.enqueue_action(job, run_at=bad)
    assert_pool_empty(pool)


def test_naive_datetime_is_an_error(app, job):
    pool = app.pool("sched")
    with pytest.raises(ValueError):
        pool.enqueue_action(job, run_at=datetime.now() + timedelta(seconds=5))
    assert_pool_empty(pool)


@pytest.mark.parametrize("bad", ["5", [1], object()], ids=["str", "list", "object"])
def test_wrong_type_times_are_type_errors(app, job, bad):
    pool = app.pool("sched")
    with pytest.raises(TypeError):
        pool.enqueue_action(job, run_after=bad)
    with pytest.raises(TypeError):
        pool.enqueue_action(job, run_at=bad)
    assert_pool_empty(pool)


def test_scheduled_mutation_and_query(app, rec: Recorder, user_table):
    @app.mutation(name="write")
    def write(tx) -> None:
        rec.add(kind="mutation")
        user_table.insert(tx, "m")

    @app.query(name="read")
    def read(tx) -> int:
        rec.add(kind="query")
        return user_table.count(tx)

    pool = app.pool("sched")
    start = time.time()
    m = pool.enqueue_mutation(write, run_after=0.5)
    q = pool.enqueue_query(read, run_after=1.0)
    assert pool.status(m).reason == "scheduled"
    run_until_idle(app)
    times = {c["kind"]: c["t"] for c in rec.calls}
    assert times["mutation"] >= start + 0.49
    assert times["query"] >= start + 0.99
    assert pool.status(q).result == workpool.Success(1)


def test_until_idle_waits_for_scheduled_work(app, job, rec: Recorder):
    pool = app.pool("sched")
    pool.enqueue_action(job, run_after=0.7)
    run_until_idle(app, timeout=20)
    assert len(rec.calls) == 1, "scheduled work counts as not idle"


@pytest.mark.parametrize("pools", [None, ["new"]], ids=["all-pools", "named-pool"])
def test_a_worker_wakes_for_work_scheduled_in_a_pool_created_after_it_started(app, job, pools):
    # The worker's last claim read no config of the new pool; waking for its first
    # work at the idle poll instead of at its due time started it up to 1 s late.
    app.store.migrate()
    worker = Worker(app.store, app.registry, WorkerOptions(pools=pools))
    worker.configs = {c.name: c for c in app.store.run(app.store.load_pools, readonly=True)}
    assert "new" not in worker.configs
    app.pool("new").enqueue_action(job, run_after=0.5)
    assert worker._sleep_time() == 0.0, "a pool that appeared is claimed from at once"
    assert "new" in worker.configs
    wait = worker._sleep_time()
    assert 0.3 < wait <= 0.5, "then it sleeps until the work is due"


def test_work_due_while_every_slot_was_busy_starts_on_time(app, rec: Recorder):
    """A worker woken while all its slots are busy waits for a slot to free. When
    the attempt that frees it ends before the next work is due, the worker must
    still wake at that due time: sleeping the 1 s idle poll instead started it
    most of a second late on PostgreSQL (SQLite's commit probe hid it)."""

    @app.action(name="hold")
    def hold() -> None:
        rec.add(kind="hold")
        time.sleep(0.15)

    @app.action(name="due")
    def due(at: float) -> None:
        rec.add(kind="due", late=time.time() - at)

    pool = app.pool("busy")
    with background_worker(app, concurrency=1):
        pool.enqueue_action(hold)
        wait_for(lambda: rec.count(kind="hold"), timeout=10)
        at = time.time() + 0.3
        pool.enqueue_action(due, {"at": at}, run_at=at)  # its NOTIFY finds no free slot
        wait_for(lambda: rec.count(kind="due"), timeout=10)
    late = rec.values("late")[-1]
    assert late < 0.5, f"started {late:.2f} s after it was due"


def test_due_work_held_by_a_full_pool_does_not_hide_later_work(app, job):
    """The worker sleeps until the next work that is not due yet: due work that a
    full pool holds back must not make it sleep the whole idle poll instead."""
    app.store.migrate()
    full = app.pool("full", max_parallelism=1)
    full.enqueue_action_batch(job, [{"i": 1}, {"i": 2}])
    store = app.store
    assert store.run(lambda tx: store.claim(tx, "full", 5, "w", time.time()))
    app.pool("soon").enqueue_action(job, run_after=0.5)
    worker = Worker(app.store, app.registry, WorkerOptions())
    worker.configs = {c.name: c for c in app.store.run(app.store.load_pools, readonly=True)}
    wait = worker._sleep_time()
    assert 0.3 < wait <= 0.5, f"slept {wait:.2f} s"
