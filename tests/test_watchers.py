"""How an idle worker hears of new work: a commit elsewhere wakes its watcher, waiting
costs nothing (PostgreSQL's listener blocks on its socket; SQLite's probe, where
inotify is there, reads ``data_version`` only when the write-ahead log is written),
and stopping the worker interrupts a wait in progress."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import workpool
from conftest import background_worker, calls_at_rest, counted_calls, wait_for
from workpool.store.base import Watcher
from workpool.store.sqlite.wal_bell import WalBell


def _settled(store: Any) -> Any:
    watcher = store.watcher()
    watcher.wait(0.1)  # connects (PostgreSQL: LISTEN) and forgets what it saw
    while watcher.wait(0.1):
        pass
    return watcher


def _enqueue_later(app: Any, delay: float) -> threading.Thread:
    def enqueue() -> None:
        time.sleep(delay)
        app.pool("heard").enqueue_action("f", {})

    thread = threading.Thread(target=enqueue)
    thread.start()
    return thread


def test_a_long_wait_ends_with_a_commit_elsewhere(app: Any) -> None:
    app.action(name="f")(lambda: None)
    watcher = _settled(app.store)
    try:
        thread = _enqueue_later(app, 0.2)
        started = time.monotonic()
        assert watcher.wait(30.0), "the wait ended without seeing the enqueue"
        assert time.monotonic() - started < 15.0, "the commit did not end the wait"
        thread.join()
    finally:
        watcher.close()


def test_interrupt_ends_a_wait_in_progress_and_every_later_one(app: Any) -> None:
    watcher = _settled(app.store)
    try:
        answers: list[bool] = []
        waiting = threading.Thread(target=lambda: answers.append(watcher.wait(30.0)))
        waiting.start()
        time.sleep(0.2)
        watcher.interrupt()
        waiting.join(timeout=15.0)
        assert not waiting.is_alive(), "interrupt() did not end the wait"
        assert answers == [False]
        started = time.monotonic()
        assert not watcher.wait(30.0)
        assert time.monotonic() - started < 15.0
    finally:
        watcher.close()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_an_idle_sqlite_probe_reads_only_when_the_log_is_written(app: Any) -> None:
    """With inotify the probe blocks until the write-ahead log is written; polling
    read data_version every 2 ms, 250 times in this half second of quiet."""
    bell = WalBell.open(app.store.path)
    if bell is None:
        pytest.skip("no inotify here: the probe polls data_version")
    bell.close()
    app.action(name="f")(lambda: None)
    watcher = _settled(app.store)
    reads: list[str] = []
    watcher.conn.set_trace_callback(reads.append)
    try:
        assert not watcher.wait(0.5)
        assert len(reads) <= 3, f"an idle probe read {len(reads)} times in 0.5 s"
        thread = _enqueue_later(app, 0.2)
        assert watcher.wait(30.0), "the enqueue's commit did not ring the bell"
        thread.join()
    finally:
        watcher.close()


def test_a_database_reached_through_a_symbolic_link_is_heard(tmp_path: Any) -> None:
    """SQLite writes the log beside the file the link points to: a bell on the
    link's directory never rang, and commits were seen only at the next poll."""
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "work.db").symlink_to(tmp_path / "real" / "work.db")
    app = workpool.App(f"sqlite:///{tmp_path / 'links' / 'work.db'}")
    try:
        app.action(name="f")(lambda: None)
        app.pool("heard").stats()  # creates the database, in real/
        watcher = _settled(app.store)
        try:
            thread = _enqueue_later(app, 0.2)
            started = time.monotonic()
            assert watcher.wait(30.0)
            assert time.monotonic() - started < 15.0, "the commit did not end the wait"
            thread.join()
        finally:
            watcher.close()
    finally:
        app.close()


@pytest.fixture
def high_fds() -> Iterator[None]:
    """Descriptors 0-1100 taken, so every socket opened next is numbered past 1023,
    where select() refuses to wait: as in an application with many files open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2048
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    taken = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_and_watchers_past_descriptor_1023_work(store_url: str, high_fds: None) -> None:
    app = workpool.App(store_url)
    try:
        app.action(name="f")(lambda: None)
        pool = app.pool("heard")
        wid = pool.enqueue_action("f", {})  # PostgreSQL: a pooled connection checked
        assert pool.status(wid).state == "pending"
        watcher = _settled(app.store)
        try:
            thread = _enqueue_later(app, 0.2)
            assert watcher.wait(30.0)
            thread.join()
            watcher.interrupt()
            assert not watcher.wait(30.0)
        finally:
            watcher.close()
    finally:
        app.close()


def _two_stores_with_a_table(path: str) -> tuple[Any, Any]:
    """Two SQLite stores on one file, as two processes would have, and a table t."""
    from workpool.store.sqlite.store import SqliteStore

    first, second = SqliteStore(path), SqliteStore(path)
    with first.transaction() as tx:
        tx.execute("CREATE TABLE t (who TEXT)")
    return first, second


@pytest.mark.parametrize("holder_commits", [True, False], ids=["commit", "rollback"])
def test_a_worker_waiting_for_the_sqlite_write_lock_takes_it_when_the_holder_ends(
    tmp_path: Any, holder_commits: bool
) -> None:
    """A worker's claims and records (``batch_writes``) wait for another process's
    write lock by watching the log, which the holder writes as it commits; a holder
    that rolls back writes nothing there, and the waiter must take the lock anyway."""
    path = str(tmp_path / "lock.db")
    holder, waiter = _two_stores_with_a_table(path)
    holding, ended = threading.Event(), threading.Event()

    def hold() -> None:
        with contextlib.suppress(RuntimeError), holder.transaction() as tx:
            tx.execute("INSERT INTO t VALUES ('holder')")
            holding.set()
            time.sleep(0.3)
            ended.set()
            if not holder_commits:
                raise RuntimeError("roll back")

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(5)
    took: list[bool] = []

    def wait_for_lock() -> None:
        with waiter.batch_writes(), waiter.transaction() as tx:
            tx.execute("INSERT INTO t VALUES ('waiter')")  # takes the write lock
            took.append(ended.is_set())

    second = threading.Thread(target=wait_for_lock)
    second.start()
    second.join(15)
    thread.join(15)
    assert took == [True], "the waiter took the lock only once the holder was done"
    with waiter.transaction(readonly=True) as tx:
        rows = sorted(r[0] for r in tx.execute("SELECT who FROM t").fetchall())
    assert rows == (["holder", "waiter"] if holder_commits else ["waiter"])
    probe = WalBell.open(path)
    if probe is not None:
        probe.close()
        assert waiter._lock_bell is not None, "where inotify works the waiter watched the log"
    holder.close()
    waiter.close()


def test_a_sqlite_write_transaction_takes_the_write_lock_at_its_first_statement(
    tmp_path: Any,
) -> None:
    """Until its first statement, or its COMMIT when all it has are deferred
    statements, a write transaction holds no lock: a worker builds its batch while
    another process writes, and holds the lock for the batch's SQL alone."""
    holder, other = _two_stores_with_a_table(str(tmp_path / "lazy.db"))
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.transaction() as tx:
            tx.execute("INSERT INTO t VALUES ('holder')")
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(5)
    entered, committed = threading.Event(), threading.Event()

    def write_later() -> None:
        with other.transaction() as tx:
            entered.set()
            tx.defer("INSERT INTO t VALUES ('deferred')")
        committed.set()

    second = threading.Thread(target=write_later)
    second.start()
    try:
        assert entered.wait(5), "the transaction began while another process wrote"
        with other.transaction():
            pass  # nothing to write: no lock to wait for
        assert not committed.wait(0.2), "its deferred statement waits for the lock"
    finally:
        release.set()
        thread.join(15)
        second.join(15)
    assert committed.is_set()
    with other.transaction(readonly=True) as tx:
        rows = sorted(r[0] for r in tx.execute("SELECT who FROM t").fetchall())
    assert rows == ["deferred", "holder"]
    holder.close()
    other.close()


def _rounds(monkeypatch: Any, name: str) -> list[float]:
    """When each call of the maintenance loop's method ``name`` began (monotonic)."""
    from workpool.runtime.maintenance import Maintenance

    return counted_calls(monkeypatch, Maintenance, name)


def test_a_resting_workers_maintenance_wakes_once_a_second_and_a_start_wakes_it(
    app: Any, monkeypatch: Any
) -> None:
    """Quiet with nothing in flight, a worker's maintenance loop sleeps until its
    next duty (its reads come a second apart), not ten rounds a second: on
    PostgreSQL that took an idle worker from 5.8 to 2.6-3.0 ms of CPU a second. A start
    wakes it, and it goes back to a tick's pace, which an attempt's timeout needs."""
    from workpool.runtime.maintenance import QUIET_S, TICK_S

    rounds = _rounds(monkeypatch, "tick")
    started: list[float] = []

    @app.action(name="slow")
    def slow() -> None:
        started.append(time.monotonic())
        time.sleep(0.6)

    pool = app.pool("resting")
    with background_worker(app, lease=15.0):  # heartbeats (SQLite: commits) 5 s apart
        resting = calls_at_rest(rounds, QUIET_S + 1.0)
        wid = pool.enqueue_action(slow)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=10)
    # A second apart, 2 or 3 rounds; half a second apart (round 51's), 4 or 5.
    assert resting <= 3, f"{resting} rounds in 2 s of rest"
    busy = [t for t in rounds if started[0] <= t <= started[0] + 0.6]
    assert len(busy) >= 0.6 / TICK_S / 2, f"{len(busy)} rounds in the 0.6 s the attempt ran"


def test_a_worker_whose_pools_are_not_stored_yet_rests_as_well(app: Any, monkeypatch: Any) -> None:
    """A worker started before anything was enqueued to its pools (a pool's row is
    written at its first use) has no duties of theirs yet: its maintenance loop
    rests a second between rounds too. Their due times stayed in the past, and
    such a worker went round ten times a second until its first work came."""
    from workpool.runtime.maintenance import QUIET_S

    rounds = _rounds(monkeypatch, "tick")
    with background_worker(app, pools=["not_stored_yet"], lease=15.0):
        resting = calls_at_rest(rounds, QUIET_S + 1.0)
    # Round 53's worker: 20 rounds in these 2 s.
    assert resting <= 3, f"{resting} rounds in 2 s of rest"


def test_a_resting_worker_reads_in_one_transaction_a_second(app: Any, monkeypatch: Any) -> None:
    """At rest, the dispatcher's idle poll asks the maintenance loop to look for it
    (Maintenance.look), and that round reads the peers, lost work, handler retries,
    its running rows and the look in one transaction, sent at its end: on
    PostgreSQL one round trip, so the server's process wakes once a second for
    them, not three to five times."""
    from workpool.runtime.maintenance import QUIET_S

    runs = counted_calls(monkeypatch, app.store, "run")

    @app.action(name="quick")
    def quick() -> str:
        return "ok"

    pool = app.pool("resting")
    with background_worker(app, lease=15.0):  # heartbeats 5 s apart
        wid = pool.enqueue_action(quick)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=10)
        # Quiet, and before its first report (REPORT_FIRST_S), whose turn is a write.
        resting = calls_at_rest(runs, QUIET_S + 0.7)
    # A round a second, and the dispatcher's read of the configs and the next due
    # time (every POLL_READS_S) at most once. Round 53's worker: 6 and 7 in 2 s.
    assert resting <= 3, f"{resting} transactions in 2 s of rest"


class _Deaf(Watcher):
    """A watcher that never hears a change: every notification is missed."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def wait(self, timeout: float) -> bool:
        self._stop.wait(timeout)
        return False

    def interrupt(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()


def test_a_missed_notification_is_covered_by_the_idle_poll_which_only_looks(
    app: Any, monkeypatch: Any
) -> None:
    """A worker that hears nothing still starts new work within its idle poll. The
    poll looks first (one read) and claims only when the look finds work: on
    PostgreSQL a claim is a transaction of four statements and a COMMIT, once a
    second for ever in an idle worker. A poll that found nothing reads the next due
    time (and the configs) again only every POLL_READS_S."""
    from workpool.runtime.worker import IDLE_POLL_S

    monkeypatch.setattr(app.store, "watcher", _Deaf)
    claims = counted_calls(monkeypatch, app.store, "claim_many_later")
    looks = counted_calls(monkeypatch, app.store, "claimable_later")
    dues = counted_calls(monkeypatch, app.store, "next_due")

    @app.action(name="quick")
    def quick() -> str:
        return "ok"

    pool = app.pool("deaf")
    pool.stats()
    with background_worker(app):
        time.sleep(IDLE_POLL_S + 0.5)  # past its start and a first poll
        claims.clear()
        looks.clear()
        dues.clear()
        time.sleep(2 * IDLE_POLL_S + 0.2)
        idle_claims, idle_looks, idle_dues = len(claims), len(looks), len(dues)
        enqueued = time.monotonic()
        wid = pool.enqueue_action(quick)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=10)
        waited = time.monotonic() - enqueued
    assert idle_claims == 0, f"{idle_claims} claims in {2 * IDLE_POLL_S} s of idle polls"
    assert idle_looks >= 2, f"{idle_looks} looks in {2 * IDLE_POLL_S} s of idle polls"
    # Round 52's poll read it after every look: 2 in this window.
    assert idle_dues <= 1, f"{idle_dues} reads of the next due time in {2 * IDLE_POLL_S} s"
    assert waited < IDLE_POLL_S + 2.0, f"started {waited:.2f} s after its enqueue"


def test_scheduled_work_whose_notification_was_missed_starts_within_a_poll_of_due(
    app: Any, monkeypatch: Any
) -> None:
    """Its due time is read no more than every POLL_READS_S by a worker that hears
    nothing, but the poll's look finds it once it is due."""
    from workpool.runtime.worker import IDLE_POLL_S, POLL_READS_S

    monkeypatch.setattr(app.store, "watcher", _Deaf)

    @app.action(name="stamp")
    def stamp() -> float:
        return time.time()

    pool = app.pool("deaf_later")
    pool.stats()
    with background_worker(app):
        time.sleep(IDLE_POLL_S + 0.5)  # past its start, resting on its idle polls
        due = time.time() + POLL_READS_S / 2
        wid = pool.enqueue_action(stamp, run_at=due)
        wait_for(lambda: pool.status(wid).state == "finished", timeout=POLL_READS_S + 10)
    status = pool.status(wid)
    assert isinstance(status, workpool.Finished) and status.result is not None
    started = status.result.return_value
    assert started >= due, f"started {due - started:.3f} s before it was due"
    assert started - due < IDLE_POLL_S + 1.0, f"started {started - due:.2f} s after due"


def test_a_resting_worker_reads_when_its_duties_are_due_only_when_one_may_be(
    app: Any, monkeypatch: Any
) -> None:
    """Its reports and prunes are a minute apart: it reads their times again when
    the earliest falls due, after taking a turn, or DUTY_TIMES_READ_S after the
    last read, not every second."""
    from workpool.runtime.maintenance import QUIET_S, REPORT_FIRST_S

    reads = counted_calls(monkeypatch, app.store, "duty_times_later")
    app.pool("resting").stats()
    with background_worker(app):
        # Before its first report (REPORT_FIRST_S), whose turn is a read again.
        seen = calls_at_rest(reads, QUIET_S + 0.5, REPORT_FIRST_S - QUIET_S - 1.5)
    # Round 52's worker read them once a second or more: 2 and 4 here.
    assert seen == 0, f"{seen} reads of the duties' times in {REPORT_FIRST_S - QUIET_S - 1.5} s"


def test_a_resting_worker_still_heartbeats_on_time(app: Any, monkeypatch: Any) -> None:
    """Its sleep ends when its earliest duty is due: with a lease of 0.9 s it
    heartbeats every 0.3 s, sooner than a resting round would come."""
    from workpool.runtime.maintenance import QUIET_S

    beats = _rounds(monkeypatch, "heartbeat")
    app.pool("resting").stats()
    with background_worker(app, lease=0.9):
        seen = calls_at_rest(beats, QUIET_S + 1.0)
    # About 6.7 at 0.3 s apart; 4 at a resting round's 0.5 s.
    assert seen >= 5, f"{seen} heartbeats in 2 s, with a lease of 0.9 s"
