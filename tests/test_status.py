"""PRODUCT.md §7 (status, retention), stats, ``workpool.current()``, timeouts, async twins."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

import workpool
from conftest import Recorder, background_worker, finished, run_until_idle, wait_for
from workpool import RetryBehavior

pytestmark = pytest.mark.timeout(120)


def test_status_lifecycle_pending_running_finished(app, rec: Recorder):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="slow")
    def slow() -> str:
        started.set()
        release.wait(20)
        return "done"

    pool = app.pool("status")
    before = time.time()
    wid = pool.enqueue_action(slow)
    pending = pool.status(wid)
    assert isinstance(pending, workpool.Pending)
    assert pending.state == "pending"
    assert pending.previous_attempts == 0
    assert pending.reason == "due"
    assert pending.last_error is None
    try:
        with background_worker(app):
            assert started.wait(10)
            running = pool.status(wid)
            assert isinstance(running, workpool.Running)
            assert running.state == "running"
            assert running.previous_attempts == 0
            assert running.attempt == 1
            assert before - 1 <= running.started_at <= time.time() + 1
            release.set()
            done = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s)
    finally:
        release.set()
    assert isinstance(done, workpool.Finished)
    assert done.result == workpool.Success("done")
    assert done.on_complete_error is None


def test_status_of_unknown_id_is_finished_none(app):
    pool = app.pool("status")
    status = pool.status(str(uuid.uuid4()))
    assert status == workpool.Finished(None)
    assert status.state == "finished"
    assert status.result is None
    # Not even a UUID: still "unknown", not a crash.
    assert pool.status("no-such-work").result is None


def test_status_batch_keeps_order(app, rec: Recorder):
    @app.action(name="job")
    def job(i: int) -> int:
        return i

    pool = app.pool("status")
    done = pool.enqueue_action_batch(job, [{"i": 0}, {"i": 1}])
    run_until_idle(app)
    later = pool.enqueue_action(job, {"i": 2}, run_after=60)
    unknown = str(uuid.uuid4())
    ids = [later, done[1], unknown, done[0], later]
    statuses = pool.status_batch(ids)
    assert len(statuses) == 5
    assert statuses[0].state == "pending" and statuses[0].reason == "scheduled"
    assert statuses[1] == workpool.Finished(workpool.Success(1))
    assert statuses[2] == workpool.Finished(None)
    assert statuses[3] == workpool.Finished(workpool.Success(0))
    assert statuses[4] == statuses[0]
    assert pool.status_batch([]) == []
    pool.cancel(later)


def test_status_waiting_for_slot(app):
    started = threading.Event()
    release = threading.Event()

    @app.action(name="slow")
    def slow() -> None:
        started.set()
        release.wait(20)

    pool = app.pool("slots", max_parallelism=1)
    first = pool.enqueue_action(slow)
    second = pool.enqueue_action(slow, run_after=0.01)
    try:
        with background_worker(app, concurrency=4):
            assert started.wait(10)
            wait_for(lambda: time.time() > pool.status(second).due_at)
            status = pool.status(second)
            assert status.state == "pending"
            assert status.reason == "waiting_for_slot"
            assert (status.running, status.limit) == (1, 1)
            assert pool.status(first).state == "running"
            release.set()
            wait_for(lambda: pool.status(second).state == "finished")
    finally:
        release.set()


def test_status_is_answered_from_the_database(app, store_url):
    @app.action(name="job")
    def job() -> int:
        return 3

    pool = app.pool("shared")
    wid = pool.enqueue_action(job)
    other = workpool.App(store_url)  # another client, no registrations
    try:
        assert other.pool("shared").status(wid).state == "pending"
        run_until_idle(app)
        assert other.pool("shared").status(wid) == workpool.Finished(workpool.Success(3))
        assert other.pool("shared").stats().backlog == 0
    finally:
        other.close()


def test_status_ttl_expired_work_is_removed_by_the_pools_cleanup(app, store_url):
    @app.action(name="job")
    def job(blob: str) -> None:
        pass

    pool = app.pool("short_lived", status_ttl=0.2)
    keep_pool = app.pool("long_lived")
    big = {"blob": "x" * 5000}  # args this big live in their own table
    wid = pool.enqueue_action(job, big, run_after=60)
    kept = keep_pool.enqueue_action(job, big, run_after=60)
    pool.cancel(wid)
    keep_pool.cancel(kept)
    finished_at = time.time()
    assert pool.status(wid) == workpool.Finished(workpool.Canceled())
    wait_for(lambda: time.time() > finished_at + 0.3)
    # Still answered until a cleanup ran: retention is the pool's own job.
    with background_worker(app):
        wait_for(
            lambda: pool.status(wid).result is None,
            timeout=10,
            message="expired finished work was not removed",
        )
    assert pool.status(wid) == workpool.Finished(None)
    assert app.inspect(wid) is None
    assert keep_pool.status(kept) == workpool.Finished(workpool.Canceled())
    assert app.inspect(kept).args == big  # type: ignore[union-attr]
    prefix = getattr(app.store, "table_prefix", "")
    with app.transaction() as tx:  # big args live in their own table: gone too
        ids = [r[0] for r in tx.execute(f"SELECT id FROM {prefix}payloads").fetchall()]
    assert ids == [kept]


def test_status_ttl_of_work_finished_by_a_worker(app):
    """Finished work is retained about status_ttl, then the pool's cleanup removes it."""

    @app.action(name="job")
    def job() -> str:
        return "x"

    pool = app.pool("ttl", status_ttl=1.0)
    with background_worker(app):
        wid = pool.enqueue_action(job)
        wait_for(lambda: pool.status(wid).state == "finished")
        finished_at = time.time()
        assert pool.status(wid).result == workpool.Success("x")
        # The cleanup is periodic (at most once a minute, sooner for a short ttl).
        wait_for(lambda: pool.status(wid).result is None, timeout=75)
        assert time.time() - finished_at >= 0.9, "removed before its status_ttl"


@pytest.mark.parametrize("budget", ["default", "spent"])
def test_the_cleanup_keeps_up_with_a_pool_that_finishes_more_than_a_pass_deletes(
    app, monkeypatch, budget
):
    """Expired rows beyond one cleanup pass are deleted within seconds, not a minute
    later: a fixed 10,000 rows a minute fell behind any pool finishing 170 a second.
    "spent": each pass's deleting budget runs out after its first batch, so the rest
    waits for the turn that comes back a second later."""
    from workpool.runtime import maintenance
    from workpool.runtime.maintenance import PRUNE_EVERY_S
    from workpool.runtime.worker import Worker, WorkerOptions

    if budget == "spent":
        monkeypatch.setattr(maintenance, "PRUNE_BUDGET_S", 0.0)

    @app.action(name="job")
    def job(i: int) -> None:
        pass

    busy = app.pool("busy", status_ttl=3600)
    kept = app.pool("kept", status_ttl=7200)
    n = 11_111  # not a whole number of batches: the last one is short
    busy.enqueue_action_batch(job, [{"i": i} for i in range(n)], run_after=600)
    kept_id = kept.enqueue_action(job, {"i": 0}, run_after=600)
    busy.cancel_all()
    kept.cancel_all()
    store = app.store
    finished = f"SELECT pool, count(*) FROM {store.table_prefix}finished GROUP BY pool"
    assert dict(app.run(lambda tx: tx.execute(finished).fetchall())) == {"busy": n, "kept": 1}
    start = time.time() + 3600 + 1  # every row of "busy" has expired, "kept"'s has not
    worker = Worker(store, app.registry, WorkerOptions(pools=["busy", "kept"]), lambda: start)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}
    now = start
    while now < start + 30:
        worker.maintenance.tick(now)
        if "busy" not in dict(app.run(lambda tx: tx.execute(finished).fetchall())):
            break
        now += 1.0
    left = dict(app.run(lambda tx: tx.execute(finished).fetchall()))
    assert left == {"kept": 1}, f"after {now - start:.0f} s of passes: {left}"
    assert kept.status(kept_id) == workpool.Finished(workpool.Canceled())
    times = store.run(store.duty_times)
    assert times[("busy", "prune")] == now + PRUNE_EVERY_S, "back to once a minute"


def test_stats_numbers(app):
    @app.action(name="ok")
    def ok() -> None:
        pass

    @app.action(name="bad")
    def bad() -> None:
        raise RuntimeError("bad")

    pool = app.pool("stats")
    empty = pool.stats()
    assert (empty.running, empty.backlog, empty.scheduled) == (0, 0, 0)
    assert (empty.completed, empty.failure_rate, empty.permanent_failure_rate) == (0, 0, 0)
    assert empty.max_parallelism == 10  # the default
    assert empty.paused is False

    pool.enqueue_action_batch(ok, [{}, {}])
    pool.enqueue_action(bad, retry=RetryBehavior(max_attempts=2, initial_backoff=0.01))
    later = pool.enqueue_action(ok, run_after=60)
    before = pool.stats()
    assert (before.backlog, before.scheduled, before.running) == (3, 1, 0)
    pool.cancel(later)
    run_until_idle(app)
    stats = pool.stats()
    # completions: 2 succeeded, 1 retry, 1 failed for good, 1 canceled
    assert stats.succeeded == 2
    assert stats.retries == 1
    assert stats.failed == 1
    assert stats.canceled == 1
    assert stats.completed == 5
    assert stats.failure_rate == pytest.approx((1 + 1) / 5, abs=1e-3)
    assert stats.permanent_failure_rate == pytest.approx(1 / (5 - 1), abs=1e-3)
    assert (stats.backlog, stats.scheduled, stats.running) == (0, 0, 0)


def test_current_inside_sync_and_async_actions(app, rec: Recorder):
    @app.action(name="sync_info")
    def sync_info() -> None:
        info = workpool.current()
        rec.add(info=info)

    @app.action(name="async_info")
    async def async_info() -> None:
        await asyncio.sleep(0)
        rec.add(info=workpool.current())

    pool = app.pool("current")
    a = pool.enqueue_action(sync_info)
    b = pool.enqueue_action(async_info)
    run_until_idle(app)
    infos = {c["info"].work_id: c["info"] for c in rec.calls}
    assert set(infos) == {a, b}
    assert (infos[a].pool, infos[a].fn_name, infos[a].attempt) == ("current", "sync_info", 1)
    assert (infos[b].pool, infos[b].fn_name, infos[b].attempt) == ("current", "async_info", 1)
    assert isinstance(infos[a], workpool.RunInfo)


def test_current_outside_work_raises_lookup_error():
    with pytest.raises(LookupError):
        workpool.current()


def test_current_does_not_leak_between_attempts(app, rec: Recorder):
    @app.action(name="job")
    def job(i: int) -> None:
        time.sleep(0.01)
        rec.add(i=i, wid=workpool.current().work_id)

    pool = app.pool("current")
    wids = pool.enqueue_action_batch(job, [{"i": i} for i in range(8)])
    run_until_idle(app, concurrency=4)
    got = {c["i"]: c["wid"] for c in rec.calls}
    assert got == dict(enumerate(wids))


def test_timeout_of_a_sync_action(app):
    gate = threading.Event()

    @app.action(name="hangs")
    def hangs() -> None:
        gate.wait(5)

    pool = app.pool("timeouts")
    wid = pool.enqueue_action(hangs, timeout=0.3)
    start = time.time()
    try:
        with background_worker(app):
            status = wait_for(lambda: (s := pool.status(wid)).state == "finished" and s, 4)
            took = time.time() - start
            gate.set()  # the abandoned thread ends; the worker can stop
    finally:
        gate.set()
    assert status.result.kind == "failed"
    assert "timed out" in status.result.error
    assert took < 4


def test_work_after_a_timed_out_sync_action_does_not_wait_for_its_thread(app, rec: Recorder):
    """A worker starts its threads as the work in flight needs them; a sync action
    past its timeout still holds one, so the next attempt must get another."""
    gate = threading.Event()

    @app.action(name="stuck")
    def stuck() -> None:
        gate.wait(30)

    @app.action(name="after")
    def after() -> None:
        rec.add()

    pool = app.pool("timeouts")
    wid = pool.enqueue_action(stuck, timeout=0.3)
    before = set(threading.enumerate())  # other tests' threads may still be leaving
    try:
        with background_worker(app, concurrency=2):
            assert wait_for(lambda: finished(pool, wid), 10).result.kind == "failed"
            pool.enqueue_action(after)
            wait_for(lambda: len(rec.calls) == 1, 10)
            assert not gate.is_set()  # it ran while the stuck thread still waited
            threads = [t.name for t in set(threading.enumerate()) - before if "-exec-" in t.name]
            assert len(threads) == 2, threads  # of 2, started as they were needed
            gate.set()  # the abandoned thread ends; the worker can stop
    finally:
        gate.set()


def test_a_worker_starts_no_more_threads_than_its_work_needs(app, rec: Recorder):
    @app.action(name="note")
    def note() -> None:
        rec.add()

    app.pool("few").enqueue_action_batch(note, [{}] * 3)
    before = set(threading.enumerate())
    with background_worker(app, concurrency=200):
        wait_for(lambda: len(rec.calls) == 3, 10)
        threads = [t.name for t in set(threading.enumerate()) - before if "-exec-" in t.name]
    assert 1 <= len(threads) <= 3, threads


def test_status_batch_reads_each_state_and_the_occupancy_of_each_pool(app):
    """One read answers finished, running, waiting, due, scheduled and unknown ids,
    with the running count and limit of the pool of each due one; status() of each
    id alone answers the same."""
    started = threading.Event()
    release = threading.Event()

    @app.action(name="hold")
    def hold() -> None:
        started.set()
        release.wait(20)

    @app.action(name="quick")
    def quick() -> int:
        return 7

    full = app.pool("full", max_parallelism=1)
    roomy = app.pool("roomy", max_parallelism=3)
    done = full.enqueue_action(quick)
    run_until_idle(app)
    held = full.enqueue_action(hold)
    waiting = full.enqueue_action(quick)
    unknown = str(uuid.uuid4())
    try:
        with background_worker(app, pools=["full"]):
            assert started.wait(10)
            due = roomy.enqueue_action(quick)
            later = roomy.enqueue_action(quick, run_after=60)
            first = full.status_batch([done, held, waiting, unknown, waiting])
            second = roomy.status_batch([later, due])
            # One id at a time is a statement of its own (status()): the same answers.
            alone = [full.status(i) for i in (done, held, waiting, unknown, waiting)]
            alone += [roomy.status(i) for i in (later, due)]
            release.set()
    finally:
        release.set()
    assert first[0] == workpool.Finished(workpool.Success(7))
    assert (first[1].state, first[1].attempt) == ("running", 1)
    assert (first[2].reason, first[2].running, first[2].limit) == ("waiting_for_slot", 1, 1)
    assert first[3] == workpool.Finished(None)
    assert first[4] == first[2]
    assert (second[0].reason, second[0].running, second[0].limit) == ("scheduled", None, None)
    assert (second[1].reason, second[1].running, second[1].limit) == ("due", 0, 3)
    assert alone == first + second


def test_status_batch_of_more_ids_than_one_read_takes(app):
    """1,400 ids are read 500 at a time; each answer stays with its id, in order."""

    @app.action(name="square")
    def square(i: int) -> int:
        return i * i

    pool = app.pool("many_ids", max_parallelism=100)
    done = pool.enqueue_action_batch(square, [{"i": i} for i in range(700)])
    run_until_idle(app)
    waiting = pool.enqueue_action_batch(square, [{"i": i} for i in range(700)])
    statuses = pool.status_batch([*done, *waiting])
    assert statuses[:700] == [workpool.Finished(workpool.Success(i * i)) for i in range(700)]
    assert {(s.state, s.reason, s.running, s.limit) for s in statuses[700:]} == {
        ("pending", "due", 0, 100)
    }


def test_short_actions_share_threads_instead_of_starting_one_each(app, rec: Recorder):
    """A claim of 300 quick actions needs a few threads, not 300: a thread starts
    only when none is idle (starting 300 delayed the first attempt by 60 ms)."""

    @app.action(name="note")
    def note(i: int) -> None:
        rec.add(i=i)

    app.pool("many", max_parallelism=300).enqueue_action_batch(note, [{"i": i} for i in range(300)])
    before = set(threading.enumerate())
    with background_worker(app, concurrency=300):
        wait_for(lambda: len(rec.calls) == 300, 20)
        threads = [t.name for t in set(threading.enumerate()) - before if "-exec-" in t.name]
    assert sorted(c["i"] for c in rec.calls) == list(range(300))
    assert 1 <= len(threads) <= 150, len(threads)


def test_blocking_actions_get_a_thread_each_up_to_the_concurrency(app, rec: Recorder):
    """Actions that block together each get a thread: all 8 must be in the barrier
    at once, or it breaks after its timeout and they fail."""
    barrier = threading.Barrier(8, timeout=20)

    @app.action(name="meet")
    def meet(i: int) -> None:
        barrier.wait()
        rec.add(i=i)

    pool = app.pool("meeting", max_parallelism=8)
    ids = pool.enqueue_action_batch(meet, [{"i": i} for i in range(8)])
    with background_worker(app, concurrency=8):
        wait_for(lambda: all(finished(pool, wid) for wid in ids), 30)
    assert all(pool.status(wid).result.kind == "success" for wid in ids)
    assert sorted(c["i"] for c in rec.calls) == list(range(8))


def test_timeout_of_an_async_action(app):
    @app.action(name="hangs_async")
    async def hangs_async() -> None:
        await asyncio.sleep(30)

    pool = app.pool("timeouts")
    wid = pool.enqueue_action(hangs_async, timeout=0.3)
    start = time.time()
    run_until_idle(app, timeout=10)
    assert time.time() - start < 5
    result = pool.status(wid).result
    assert result.kind == "failed"
    assert "timed out" in result.error


def test_an_action_within_its_timeout_succeeds(app):
    @app.action(name="quick")
    async def quick() -> int:
        await asyncio.sleep(0.01)
        return 1

    pool = app.pool("timeouts")
    wid = pool.enqueue_action(quick, timeout=5)
    run_until_idle(app)
    assert pool.status(wid).result == workpool.Success(1)


def test_async_twins(app, rec: Recorder):
    @app.action(name="job")
    def job(i: int) -> int:
        rec.add(i=i)
        return i

    @app.mutation(name="mut")
    def mut(tx) -> str:
        return "m"

    @app.query(name="qry")
    def qry(tx) -> str:
        return "q"

    pool = app.pool("async_api")

    async def client() -> tuple:
        one = await pool.enqueue_action_async(job, {"i": 1})
        many = await pool.enqueue_action_batch_async(job, [{"i": 2}, {"i": 3}])
        m = await pool.enqueue_mutation_async(mut)
        ms = await pool.enqueue_mutation_batch_async(mut, [{}])
        q = await pool.enqueue_query_async(qry)
        qs = await pool.enqueue_query_batch_async(qry, [{}])
        later = await pool.enqueue_action_async(job, {"i": 4}, run_after=60)
        assert (await pool.status_async(later)).state == "pending"
        await pool.cancel_async(later)
        return one, many, m, ms, q, qs, later

    one, many, m, ms, q, qs, later = asyncio.run(client())
    run_until_idle(app)

    async def check() -> None:
        assert (await pool.status_async(one)).result == workpool.Success(1)
        got = await pool.status_batch_async([*many, m, *ms, q, *qs, later])
        assert [s.result for s in got] == [
            workpool.Success(2),
            workpool.Success(3),
            workpool.Success("m"),
            workpool.Success("m"),
            workpool.Success("q"),
            workpool.Success("q"),
            workpool.Canceled(),
        ]
        await pool.configure_async(max_parallelism=3)
        assert (await pool.stats_async()).max_parallelism == 3
        other = await pool.enqueue_action_async(job, {"i": 5}, run_after=60)
        assert await pool.cancel_all_async() == 1
        assert (await pool.status_async(other)).result == workpool.Canceled()

    asyncio.run(check())
    assert sorted(rec.values("i")) == [1, 2, 3]


def test_result_and_status_types_are_frozen_tagged_values():
    import dataclasses

    assert workpool.Success(1).kind == "success"
    assert workpool.Failed("e").kind == "failed"
    assert workpool.Canceled().kind == "canceled"
    assert workpool.Finished(None).state == "finished"
    assert workpool.Pending(0).state == "pending"
    assert workpool.Running(0).state == "running"
    with pytest.raises(dataclasses.FrozenInstanceError):
        workpool.Success(1).return_value = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        workpool.Finished(None).result = workpool.Canceled()  # type: ignore[misc]


def test_pool_config_is_persisted_and_overwritten_by_given_options(app, store_url):
    # Options apply on a pool's first write (enqueue, configure, ...); reads such as
    # stats() show them but never write them.
    app.pool("cfg", max_parallelism=4, log_level="INFO").configure()
    other = workpool.App(store_url)
    try:
        assert other.pool("cfg").stats().max_parallelism == 4  # no options: stored config
        assert other.pool("cfg", max_parallelism=6).stats().max_parallelism == 6  # a view
        assert other.pool("cfg").stats().max_parallelism == 4  # ... that wrote nothing
        other.pool("cfg", max_parallelism=6).configure()
    finally:
        other.close()
    assert app.pool("cfg").stats().max_parallelism == 6


def _indexes(app: workpool.App, store_url: str) -> set[str]:
    with app.transaction() as tx:
        if store_url.startswith("sqlite"):
            rows = tx.execute("SELECT name FROM sqlite_master WHERE type = 'index'").fetchall()
        else:
            rows = tx.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = %s", (app.store.schema,)
            ).fetchall()
    return {r[0] for r in rows}


def test_a_first_schema_store_upgrades_in_place_keeping_its_work(
    store_url: str, monkeypatch: pytest.MonkeyPatch
):
    """A store made by the first schema (args and context inline, one index on every
    outcome) upgrades in place: pending work keeps its args and context and runs,
    finished work keeps its args, recent_failures lists the failures newest first."""
    import workpool.store.postgres.store as pg_store
    import workpool.store.sqlite.store as sqlite_store
    from workpool.core.results import result_to_json

    module = sqlite_store if store_url.startswith("sqlite") else pg_store
    full = list(module.MIGRATIONS)
    monkeypatch.setattr(module, "MIGRATIONS", full[:1])
    old = workpool.App(store_url)
    old._migrate()
    assert "finished_outcome" in _indexes(old, store_url)
    prefix = getattr(old.store, "table_prefix", "")
    mark = "?" if store_url.startswith("sqlite") else "%s"
    now = time.time()
    pending = str(uuid.uuid4())
    finished = {str(uuid.uuid4()): i for i in range(6)}  # odd ones failed
    with old.transaction() as tx:
        tx.execute(
            f"INSERT INTO {prefix}work (id, pool, kind, fn_name, args, on_complete, context,"
            " state, due_at, attempt, cancel_requested, handler_failures, lost_count,"
            f" enqueued_at) VALUES ({mark}, 'mine', 'action', 'add', {mark}, 'noted', {mark},"
            f" 'pending', {mark}, 0, 0, 0, 0, {mark})",
            (pending, '{"a":2,"b":3}', '{"order":7}', now - 1, now - 1),
        )
        for wid, i in finished.items():
            result = workpool.Failed(f"odd {i}") if i % 2 else workpool.Success(i)
            tx.execute(
                f"INSERT INTO {prefix}finished (id, pool, fn_name, kind, args, outcome, result,"
                " attempts, enqueued_at, finished_at) VALUES"
                f" ({mark}, 'mine', 'add', 'action', {mark}, {mark}, {mark}, 1, {mark}, {mark})",
                (wid, f'{{"a":{i},"b":0}}', result.kind, result_to_json(result), now, now + i),
            )
    old.close()

    monkeypatch.setattr(module, "MIGRATIONS", full)
    new = workpool.App(store_url)
    noted: list[tuple[str, object, object]] = []

    @new.action(name="add")
    def add(a: int, b: int) -> int:
        return a + b

    @new.mutation(name="noted")
    def noted_fn(tx: object, work_id: str, context: object, result: object) -> None:
        noted.append((work_id, context, result))

    try:
        names = _indexes(new, store_url)
        assert "finished_failed" in names and "finished_outcome" not in names
        pool = new.pool("mine")
        failures = pool.recent_failures()
        assert [f.result for f in failures] == [workpool.Failed(f"odd {i}") for i in (5, 3, 1)]
        assert [f.args for f in failures] == [{"a": i, "b": 0} for i in (5, 3, 1)]
        assert new.inspect(pending).args == {"a": 2, "b": 3}  # type: ignore[union-attr]
        run_until_idle(new)
        assert pool.status(pending) == workpool.Finished(workpool.Success(5))
        assert noted == [(pending, {"order": 7}, workpool.Success(5))]
        assert new.inspect(pending).args == {"a": 2, "b": 3}  # type: ignore[union-attr]
    finally:
        new.close()


def test_a_store_migrated_by_a_newer_version_is_refused(
    store_url: str, monkeypatch: pytest.MonkeyPatch
):
    """A store that a newer workpool has migrated may hold rows this version would
    misread (SQLite schema 4 keeps small args in the work row, where schema 3 code
    would not look): this version must refuse it with a clear error, and change
    nothing."""
    import workpool.store.postgres.store as pg_store
    import workpool.store.sqlite.store as sqlite_store

    module = sqlite_store if store_url.startswith("sqlite") else pg_store
    full = list(module.MIGRATIONS)
    monkeypatch.setattr(module, "MIGRATIONS", [*full, "SELECT 1"])
    newer = workpool.App(store_url)
    newer._migrate()
    newer.close()
    monkeypatch.setattr(module, "MIGRATIONS", full)
    older = workpool.App(store_url)
    try:
        with pytest.raises(workpool.StoreError, match=rf"schema {len(full) + 1}.*newer"):
            older.pool("p").stats()
    finally:
        older.close()
    monkeypatch.setattr(module, "MIGRATIONS", [*full, "SELECT 1"])
    again = workpool.App(store_url)
    try:
        assert again.pool("p").stats().backlog == 0
    finally:
        again.close()


@pytest.mark.parametrize("size", [0, 200, 300, 100_000])
def test_args_and_context_of_any_size_reach_the_action_the_handler_and_inspect(
    app: workpool.App, size: int
) -> None:
    """SQLite keeps small args and context in the work row and big ones apart (the
    limit is 512 characters together): on both stores every size must arrive whole,
    at the action, at on_complete, and in inspect and recent_failures, while the work
    is pending and once it has finished, in a batch (even one with items on both
    sides of the limit) and alone."""
    seen: list[tuple[str, object]] = []

    @app.action(name="echo")
    def echo(text: str, fail: bool) -> int:
        seen.append(("action", text))
        if fail:
            raise workpool.NonRetryableError("asked to fail")
        return len(text)

    @app.mutation(name="noted")
    def noted(tx: workpool.Tx, work_id: str, context: object, result: object) -> None:
        seen.append(("handler", context))

    pool = app.pool(f"sizes{size}")
    # At 200 the batch's second item is over the limit and its first is not.
    text, longer, note = "a" * size, "a" * size + "b" * 100, {"note": "c" * size}
    alone = pool.enqueue_action(
        echo, {"text": text, "fail": False}, on_complete=noted, context=note
    )
    batch = pool.enqueue_action_batch(
        echo,
        [{"text": text, "fail": False}, {"text": longer, "fail": True}],
        on_complete=noted,
        context=note,
    )
    for wid, args in [
        (alone, {"text": text, "fail": False}),
        (batch[1], {"text": longer, "fail": True}),
    ]:
        assert app.inspect(wid).args == args  # type: ignore[union-attr]
    run_until_idle(app)
    assert sorted(v for k, v in seen if k == "action") == sorted([text, text, longer])
    assert [v for k, v in seen if k == "handler"] == [note] * 3
    assert pool.status(alone) == workpool.Finished(workpool.Success(size))
    assert pool.status(batch[0]) == workpool.Finished(workpool.Success(size))
    assert app.inspect(alone).args == {"text": text, "fail": False}  # type: ignore[union-attr]
    (failure,) = pool.recent_failures()
    assert (failure.work_id, failure.args) == (batch[1], {"text": longer, "fail": True})
