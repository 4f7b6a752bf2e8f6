"""PRODUCT.md §9: structured events on the ``workpool`` logger, filtered by the pool's level."""

from __future__ import annotations

import json
import logging
import math

import pytest

from conftest import background_worker, run_until_idle, wait_for
from workpool import RetryBehavior

pytestmark = pytest.mark.timeout(60)


def events_of(caplog, event: str | None = None, pool: str | None = None) -> list[dict]:
    out = []
    for record in list(caplog.records):
        if record.name != "workpool" and not record.name.startswith("workpool."):
            continue
        try:
            data = json.loads(record.getMessage())
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        data["_levelno"] = record.levelno
        if event is not None and data.get("event") != event:
            continue
        if pool is not None and data.get("pool") != pool:
            continue
        out.append(data)
    return out


def test_custom_levels_exist():
    from workpool.observability import events  # registers the level names

    assert (events.TRACE, events.REPORT) == (15, 25)
    assert logging.getLevelName("REPORT") == 25
    # Number to name only: uvicorn (the dashboard's server) also registers the name
    # "TRACE", for its level 5, so the name's mapping depends on import order.
    assert logging.getLevelName(15) == "TRACE"
    assert logging.getLevelName(25) == "REPORT"
    assert logging.DEBUG < 15 < logging.INFO < 25 < logging.WARNING


def test_every_record_is_one_json_object_tagged_workpool(app, caplog):
    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job() -> int:
        return 1

    pool = app.pool("logs", log_level="INFO")
    pool.enqueue_action(job)
    run_until_idle(app)
    records = [r for r in caplog.records if r.name == "workpool" or r.name.startswith("workpool.")]
    assert records
    for record in records:
        data = json.loads(record.getMessage())
        assert isinstance(data, dict)
        assert data["component"] == "workpool"
        assert isinstance(data["event"], str)


def test_info_level_logs_enqueued_started_completed(app, caplog):
    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job(i: int) -> int:
        return i

    pool = app.pool("chatty", log_level="INFO")
    wid = pool.enqueue_action(job, {"i": 1})
    run_until_idle(app)

    enq = [e for e in events_of(caplog, "enqueued") if e.get("work_id") == wid]
    started = [e for e in events_of(caplog, "started") if e.get("work_id") == wid]
    completed = [e for e in events_of(caplog, "completed") if e.get("work_id") == wid]
    assert len(enq) == 1 and len(started) == 1 and len(completed) == 1
    assert enq[0]["pool"] == "chatty"
    assert isinstance(started[0]["start_lag"], int | float)
    assert started[0]["start_lag"] >= -0.5
    assert completed[0]["status"] == "success"
    assert completed[0]["attempts"] == 1
    assert isinstance(completed[0]["duration"], int | float)
    assert completed[0]["duration"] >= 0


def test_completed_events_report_retrying_failed_canceled(app, caplog):
    caplog.set_level(logging.DEBUG)

    @app.action(name="bad")
    def bad() -> None:
        raise RuntimeError("nope")

    pool = app.pool("chatty", log_level="INFO")
    failing = pool.enqueue_action(bad, retry=RetryBehavior(max_attempts=2, initial_backoff=0.01))
    canceled = pool.enqueue_action(bad, run_after=60)
    pool.cancel(canceled)
    run_until_idle(app)
    statuses = [e["status"] for e in events_of(caplog, "completed") if e["work_id"] == failing]
    assert statuses == ["retrying", "failed"]
    attempts = [e["attempts"] for e in events_of(caplog, "completed") if e["work_id"] == failing]
    assert attempts == [1, 2]
    assert [e["status"] for e in events_of(caplog, "completed") if e["work_id"] == canceled] == [
        "canceled"
    ]


def test_report_level_prints_only_reports(app, caplog):
    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("quiet")  # default level REPORT
    pool.enqueue_action_batch(job, [{}, {}])
    run_until_idle(app)
    for name in ("enqueued", "started", "completed"):
        assert events_of(caplog, name, pool="quiet") == [], name


def test_log_level_is_per_pool(app, caplog):
    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job() -> None:
        pass

    loud = app.pool("loud", log_level="INFO")
    quiet = app.pool("quiet", log_level="REPORT")
    lw = loud.enqueue_action(job)
    qw = quiet.enqueue_action(job)
    run_until_idle(app)
    assert [e for e in events_of(caplog, "completed") if e["work_id"] == lw]
    assert not [e for e in events_of(caplog) if e.get("work_id") == qw]


def test_log_level_change_at_run_time_is_stored(app, store_url, caplog):
    import workpool

    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("switch")
    pool.enqueue_action(job)
    run_until_idle(app)
    assert events_of(caplog, "completed", pool="switch") == []
    other = workpool.App(store_url)
    try:
        other.pool("switch").configure(log_level="INFO")
    finally:
        other.close()
    wid = pool.enqueue_action(job)
    run_until_idle(app)
    assert [e for e in events_of(caplog, "completed") if e["work_id"] == wid]


def test_periodic_report_has_the_documented_numbers(app, caplog):
    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("reported", max_parallelism=0)  # paused: the backlog stays
    pool.enqueue_action_batch(job, [{}, {}, {}])
    with background_worker(app):
        reports = wait_for(lambda: events_of(caplog, "report", pool="reported"), timeout=10)
    report = reports[0]
    for field in (
        "backlog",
        "running",
        "completed",
        "succeeded",
        "failed",
        "retries",
        "canceled",
        "failure_rate",
        "permanent_failure_rate",
    ):
        assert field in report, field
    assert report["backlog"] == 3
    assert report["running"] == 0
    assert report["_levelno"] == 25
    pool.cancel_all()


def test_a_worker_takes_its_first_report_turn_only_after_its_first_seconds(app, caplog):
    """The report counts the pool's rows (costly on a big backlog): a starting worker
    claims first. Driven by the maintenance clock, not by sleeping."""
    from workpool.runtime.maintenance import REPORT_FIRST_S
    from workpool.runtime.worker import Worker, WorkerOptions

    caplog.set_level(logging.DEBUG)
    pool = app.pool("first_report", max_parallelism=0)
    pool.configure()
    start = 1_000_000.0
    worker = Worker(app.store, app.registry, WorkerOptions(pools=["first_report"]), lambda: start)
    worker.configs = {c.name: c for c in app.store.run(app.store.load_pools)}
    worker.maintenance.duties("first_report", start + 1.0, {}, math.inf)
    assert events_of(caplog, "report", pool="first_report") == []
    worker.maintenance.duties("first_report", start + REPORT_FIRST_S, {}, math.inf)
    assert len(events_of(caplog, "report", pool="first_report")) == 1


def test_duties_read_once_take_only_the_turns_that_are_due(app, caplog):
    """A worker reads when every duty is next due and takes only the due turns (each
    turn is a write transaction); a duty with no row yet is taken, which creates it."""
    from workpool.runtime.maintenance import REPORT_EVERY_S, REPORT_FIRST_S
    from workpool.runtime.worker import Worker, WorkerOptions

    caplog.set_level(logging.DEBUG)
    store = app.store
    app.pool("dutiful", max_parallelism=0).configure()
    started = 1_000_000.0
    start = started + REPORT_FIRST_S  # past a new worker's first seconds without reports
    worker = Worker(store, app.registry, WorkerOptions(pools=["dutiful"]), lambda: started)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}

    def reports() -> int:
        return len(events_of(caplog, "report", pool="dutiful"))

    worker.maintenance.duties("dutiful", start, store.run(store.duty_times), math.inf)
    assert reports() == 1
    times = store.run(store.duty_times)
    assert times[("dutiful", "report")] == start + REPORT_EVERY_S
    assert ("dutiful", "prune") in times
    worker.maintenance.duties("dutiful", start + 1.0, times, math.inf)
    assert reports() == 1
    later = start + REPORT_EVERY_S
    worker.maintenance.duties("dutiful", later, store.run(store.duty_times), math.inf)
    assert reports() == 2
    stale = dict(times)  # read before that turn: another worker may have taken it
    worker.maintenance.duties("dutiful", later + 1.0, stale, math.inf)
    assert reports() == 2, "a stale read only sends the worker to take_turn, which says no"


def test_a_duties_pass_takes_a_bounded_number_of_pools_longest_due_first(app):
    """The pass runs on the heartbeat's thread: thousands of pools seen for the first
    time (every turn due) are spread over passes instead of holding it for seconds."""
    from workpool.runtime.maintenance import DUTY_POOLS_PER_PASS
    from workpool.runtime.worker import Worker, WorkerOptions

    store = app.store
    names = [f"d{i:03d}" for i in range(DUTY_POOLS_PER_PASS + 50)]
    for name in names:
        app.pool(name, max_parallelism=0).configure()
    now = 1_000_000.0
    worker = Worker(store, app.registry, WorkerOptions(pools=names), lambda: now)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}

    def pruned() -> set[str]:
        return {p for (p, duty) in store.run(store.duty_times) if duty == "prune"}

    worker.maintenance.tick(now)
    first = pruned()
    assert len(first) == DUTY_POOLS_PER_PASS
    worker.maintenance.tick(now + 1.0)
    assert pruned() == set(names), "the pools left out went first in the next pass"


def test_a_maintenance_round_with_nothing_to_read_still_takes_its_turns(app):
    """A round's reads go together at its end; a round in which none is due (the
    peers, lost work, handler retries, its running rows, upkeep and the duties'
    times all read a moment ago) still takes the turns that are due: here forgetting
    a worker dead for an hour."""
    from workpool.runtime.maintenance import PRUNE_EVERY_S
    from workpool.runtime.worker import Worker, WorkerOptions
    from workpool.store.base import WorkerInfo

    store = app.store
    app.pool("tended", max_parallelism=0).configure()
    now = 1_000_000.0
    worker = Worker(store, app.registry, WorkerOptions(pools=["tended"]), lambda: now)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}
    rounds = worker.maintenance
    rounds.tick(now)
    later = now + PRUNE_EVERY_S
    info = WorkerInfo("an-hour-ago", "gone.example", 1)
    store.run(lambda tx: store.heartbeat(tx, info, later - 3616, later - 3601))
    # Every read a moment ago and not due again; the duties' pass and forgetting due.
    rounds._next = {name: later + 100.0 for name in rounds._next}
    rounds._next["duties"] = rounds._next["forget"] = later
    rounds._handlers_read, rounds._handlers_at = later, float("inf")
    rounds._times_until = later + 100.0
    rounds.tick(later)
    sql = f"SELECT id FROM {store.table_prefix}workers WHERE id = 'an-hour-ago'"
    assert not store.run(lambda tx: tx.execute(sql).fetchall()), "the dead worker is forgotten"


def test_maintenance_forgets_workers_dead_for_an_hour_once_a_minute(app):
    from workpool.runtime.maintenance import PRUNE_EVERY_S
    from workpool.runtime.worker import Worker, WorkerOptions
    from workpool.store.base import WorkerInfo

    store = app.store
    app.pool("tended", max_parallelism=0).configure()
    now = 1_000_000.0
    worker = Worker(store, app.registry, WorkerOptions(pools=["tended"]), lambda: now)
    worker.configs = {c.name: c for c in store.run(store.load_pools)}

    def workers() -> list[str]:
        sql = f"SELECT id FROM {store.table_prefix}workers"
        ids = [r[0] for r in store.run(lambda tx: tx.execute(sql).fetchall())]
        return sorted(i for i in ids if i != worker.info.id)

    def dead(name: str, expired_at: float) -> None:
        info = WorkerInfo(name, "gone.example", 1)
        store.run(lambda tx: store.heartbeat(tx, info, expired_at - 15, expired_at))

    dead("an-hour-ago", now - 3601)
    dead("a-minute-ago", now - 60)
    worker.maintenance.tick(now)
    assert workers() == ["a-minute-ago"], "the lost worker of a minute ago stays visible"
    dead("an-hour-ago", now - 3601)
    worker.maintenance.tick(now + 1.0)
    assert workers() == ["a-minute-ago", "an-hour-ago"], "once a minute, not every pass"
    worker.maintenance.tick(now + PRUNE_EVERY_S)
    assert workers() == ["a-minute-ago"]


def test_start_lag_is_start_time_minus_due_time(app, caplog):
    import time

    caplog.set_level(logging.DEBUG)

    @app.action(name="job")
    def job() -> None:
        pass

    pool = app.pool("lagging", log_level="INFO", max_parallelism=0)
    wid = pool.enqueue_action(job)
    due = pool.status(wid).due_at
    wait_for(lambda: time.time() > due + 0.5)  # due, but the pool is paused
    pool.configure(max_parallelism=1)
    run_until_idle(app)
    started = [e for e in events_of(caplog, "started") if e["work_id"] == wid]
    assert len(started) == 1
    assert 0.5 <= started[0]["start_lag"] < 10


def test_the_first_maintenance_round_does_not_heartbeat_again(app):
    """A worker heartbeats itself before its first claim; its maintenance then
    heartbeats a lease/3 later, not in its first round, whose transactions would
    run beside that claim."""
    from workpool.runtime.worker import Worker, WorkerOptions

    store = app.store
    app.pool("beat").configure()
    clock = [1_000_000.0]
    options = WorkerOptions(pools=["beat"], lease=15.0)
    worker = Worker(store, app.registry, options, lambda: clock[0])
    worker.configs = {c.name: c for c in store.run(store.load_pools)}

    def beat() -> float:
        sql = f"SELECT heartbeat_at FROM {store.table_prefix}workers WHERE id = '{worker.info.id}'"
        return float(store.run(lambda tx: tx.execute(sql).fetchone())[0])

    worker.maintenance.heartbeat(clock[0])  # as Worker.run does before its first claim
    clock[0] += 0.1
    worker.maintenance.tick(clock[0])
    assert beat() == 1_000_000.0, "the first round heartbeat again"
    clock[0] = 1_000_000.0 + options.lease / 3
    worker.maintenance.tick(clock[0])
    assert beat() == clock[0], "the next heartbeat is due a third of the lease later"
