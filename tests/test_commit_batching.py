"""Statements that wait for the COMMIT: claims, the counting of successes, deferred rows.

PostgreSQL sends a recording transaction's writes, its counters and its claim with
the COMMIT, in one round trip, and reads the claim's rows afterwards; SQLite runs
them at once. Either way a claim exists only once committed, and a success is
counted once, in the same histogram buckets as ``histogram.bucket`` puts it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

import workpool
from conftest import create_table, end_and_claim, record_and_claim, run_until_idle
from workpool.core import histogram
from workpool.core.decide import Succeeded
from workpool.core.ids import new_work_ids
from workpool.core.results import success_json
from workpool.runtime.worker import Worker, WorkerOptions
from workpool.store.base import Counters, NewWork, minute_of
from workpool.store.sqlite.store import SMALL_CLAIM, SqliteStore


def _pending(app, pool: str, count: int, due_at: float = 0.0) -> list[str]:
    app.pool(pool).configure(max_parallelism=100)
    now = time.time()
    ids = new_work_ids(count)
    items = [
        NewWork(work_id, pool, "action", "noop", "{}", None, None, None, None, due_at, now)
        for work_id in ids
    ]
    app.store.run(lambda tx: app.store.insert_work(tx, items))
    return ids


@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_a_claim_for_the_commit_exists_only_once_committed(app, json_arrays: bool):
    """On SQLite without JSON functions the claim returns its rows itself."""
    if not json_arrays:
        _no_json(app)
    store = app.store
    ids = _pending(app, "later", 3)

    class Abandon(Exception):
        pass

    def claim_then_fail(tx):
        store.claim_later(tx, "later", 2, "w1", time.time())
        raise Abandon

    with pytest.raises(Abandon):
        store.run(claim_then_fail)
    assert [app.pool("later").status(i).state for i in ids] == ["pending"] * 3

    answer = store.run(lambda tx: store.claim_later(tx, "later", 2, "w1", time.time()))
    claimed = answer()
    assert [w.id for w in claimed] == ids[:2]
    assert [app.pool("later").status(i).state for i in ids] == ["running", "running", "pending"]


def test_a_claims_answer_reads_only_the_payloads_it_left_out(app, monkeypatch):
    """Small args come with the claim's rows (SQLite reads those in one statement
    after the COMMIT): reading its answer opens no transaction. Args kept apart
    (over SQLite's 512 characters, over PostgreSQL's 8 KB) are read then, in one
    transaction, and come back whole."""
    store = app.store

    @app.action(name="noop")
    def noop(**_: object) -> None:
        pass

    pool = app.pool("answer", max_parallelism=100)
    small = pool.enqueue_action_batch("noop", [{"i": i} for i in range(3)])
    big_args = {"pad": "x" * 10_000}
    later = time.time() + 60
    big = pool.enqueue_action("noop", big_args, run_at=later)
    opened: list[bool] = []
    run = store.run

    def counting_run(fn, **kwargs):
        opened.append(kwargs.get("readonly", False))
        return run(fn, **kwargs)

    answer = store.run(lambda tx: store.claim_later(tx, "answer", 10, "w", time.time()))
    monkeypatch.setattr(store, "run", counting_run)
    assert sorted(w.id for w in answer()) == sorted(small)
    assert opened == [], "small args need no read after the COMMIT"

    monkeypatch.setattr(store, "run", run)
    answer = store.run(lambda tx: store.claim_later(tx, "answer", 10, "w", later + 1))
    monkeypatch.setattr(store, "run", counting_run)
    claimed = answer()
    assert [w.id for w in claimed] == [big]
    assert json.loads(claimed[0].args) == big_args
    assert opened == [True], "one read transaction for the payload left out"


def test_a_claims_answer_holds_the_rows_it_started_and_no_other(app):
    """SQLite reads a claim's rows after its COMMIT, by rowid, as the ones that
    claim started (its worker, its start time), when it asked for more than
    SMALL_CLAIM. A row whose rowid changed since (a VACUUM may renumber them) is not
    mistaken for another, and one that changed hands (rescued, then claimed by
    another worker) is left out: its new claim runs it. (PostgreSQL's claim, and
    SQLite's of a few, return their rows themselves.)"""
    store = app.store
    if not isinstance(store, SqliteStore):
        pytest.skip("PostgreSQL's claim returns its own rows")
    ids = _pending(app, "answered", 4)
    started = time.time()
    asked = SMALL_CLAIM + 1
    answer = store.run(lambda tx: store.claim_later(tx, "answered", asked, "w1", started))
    first, second, third, fourth = ids
    with app.transaction() as tx:
        # The first two trade rowids; the third moves past every other.
        rowid = {
            i: tx.execute("SELECT rowid FROM work WHERE id = ?", [i]).fetchone()[0] for i in ids
        }
        tx.execute("UPDATE work SET rowid = -1 WHERE id = ?", [first])
        tx.execute("UPDATE work SET rowid = ? WHERE id = ?", [rowid[first], second])
        tx.execute("UPDATE work SET rowid = ? WHERE id = ?", [rowid[second], first])
        tx.execute("UPDATE work SET rowid = 1000000 WHERE id = ?", [third])
        tx.execute("UPDATE work SET state = 'pending', worker_id = NULL WHERE id = ?", [fourth])
    again = store.run(lambda tx: store.claim(tx, "answered", 1, "w2", started + 1))
    assert [(w.id, w.attempt) for w in again] == [(fourth, 2)]
    claimed = answer()
    assert sorted((w.id, w.attempt, w.started_at) for w in claimed) == sorted(
        (i, 1, started) for i in (first, second)
    )
    assert {w.id: w.place for w in claimed} == {first: rowid[second], second: rowid[first]}
    assert answer() == claimed


def test_rows_of_a_deferred_statement_are_read_after_the_commit(app):
    store = app.store
    seen = {}

    def body(tx):
        deferred = tx.defer("SELECT 41 + 1", rows=True)
        with pytest.raises(RuntimeError, match="has not run"):
            deferred.rows  # noqa: B018 -- reading before the COMMIT is the error
        seen["deferred"] = deferred

    store.run(body)
    assert [tuple(r) for r in seen["deferred"].rows] == [(42,)]


def test_successes_are_counted_once_in_the_buckets_of_histogram_bucket(app):
    """Start lags on each bucket bound, just above it, and far beyond the last."""
    store = app.store
    finite = [b for b in histogram.LAG_BOUNDS if math.isfinite(b)]
    lags = [0.0] + finite + [math.nextafter(b, math.inf) for b in finite] + [3600.0]
    ids = _pending(app, "lags", len(lags))
    started: dict[str, float] = {}
    for lag in lags:  # due at 0.0: a claim at time ``lag`` starts it ``lag`` late
        (work,) = store.run(lambda tx, lag=lag: store.claim(tx, "lags", 1, "w1", lag))
        started[work.id] = work.started_at
    assert sorted(started) == sorted(ids)

    now = time.time()
    # (id, attempt, result, pool, start lag, place, state): PostgreSQL counts the lags of the
    # rows it finishes, SQLite the ones given for them.
    items = [
        (w, 1, success_json("null"), "lags", started[w], None, "running") for w in sorted(started)
    ]
    stale = [
        (ids[0], 2, success_json("null"), "lags", 0.0, None, "running")
    ]  # a wrong attempt: not counted
    assert store.run(lambda tx: store.finish_succeeded(tx, stale, now, "w1"))() == []
    done = store.run(lambda tx: store.finish_succeeded(tx, items, now, "w1"))()
    assert sorted(done) == sorted((w, 1) for w in ids)
    assert store.run(lambda tx: store.finish_succeeded(tx, items, now, "w1"))() == []

    counted = store.run(lambda tx: store.read_counters(tx, "lags", minute_of(now)), readonly=True)
    expected = Counters.successes([max(s - 0.0, 0.0) for s in started.values()])
    assert counted.lag_hist == expected.lag_hist
    assert counted.lag_hist == tuple(
        sum(1 for lag in lags if histogram.bucket(lag) == i)
        for i in range(len(histogram.LAG_BOUNDS))
    )
    assert (counted.completed, counted.succeeded, counted.lag_count) == (len(lags),) * 3
    assert (counted.failed, counted.retries, counted.canceled) == (0, 0, 0)
    assert counted.lag_max == 3600.0
    assert counted.lag_sum == pytest.approx(sum(lags))


@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_one_success_finishes_its_row_only_for_its_current_attempt(app, json_arrays: bool):
    """A batch of one (a pool at its limit hands its slots over one at a time): a
    stale attempt's success leaves the row running, uncounted; the current one's
    finishes it with its result, counted once; the same outcome again takes nothing."""
    if not json_arrays:
        _no_json(app)
    store = app.store
    (wid, other) = _pending(app, "one", 2)
    assert len(store.run(lambda tx: store.claim(tx, "one", 2, "w1", 1.0))) == 2
    now = time.time()
    pool = app.pool("one")

    def finish(attempt: int, value: str) -> list[tuple[str, int]]:
        item = [(wid, attempt, success_json(value), "one", 1.0, None, "running")]
        return store.run(lambda tx: store.finish_succeeded(tx, item, now, "w1"))()

    def counted() -> tuple[int, int]:
        got = store.run(lambda tx: store.read_counters(tx, "one", minute_of(now)), readonly=True)
        return got.completed, got.succeeded

    assert finish(2, '"stale"') == []
    assert isinstance(pool.status(wid), workpool.Running)
    assert counted() == (0, 0)
    assert finish(1, '"live"') == [(wid, 1)]
    assert pool.status(wid) == workpool.Finished(workpool.Success("live"))
    assert finish(1, '"again"') == []
    assert pool.status(wid) == workpool.Finished(workpool.Success("live"))
    assert counted() == (1, 1)
    assert isinstance(pool.status(other), workpool.Running), "the other row is untouched"


@pytest.mark.parametrize("live_first", [False, True], ids=["sorted", "live-first"])
@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_a_stale_and_a_live_outcome_of_one_item_in_one_batch_count_once(
    app, json_arrays: bool, live_first: bool
):
    """A batch may hold an old attempt's success beside the current one's: only the
    one that finishes the row is counted, and the row is finished once, whatever
    their order (and on SQLite with or without its JSON functions)."""
    store = app.store
    if not json_arrays:
        if not isinstance(store, SqliteStore):
            pytest.skip("only SQLite has a path without JSON arrays")
        store._json = False
    (wid, other) = _pending(app, "twice", 2)
    claimed = store.run(lambda tx: store.claim(tx, "twice", 2, "w1", 1.0))
    assert sorted(w.id for w in claimed) == sorted([wid, other])
    now = time.time()
    items = sorted(
        [
            (wid, 0, success_json('"stale"'), "twice", 1.0, None, "running"),
            (wid, 1, success_json('"live"'), "twice", 1.0, None, "running"),
            (other, 1, success_json("null"), "twice", 1.0, None, "running"),
        ],
        reverse=live_first,
    )
    done = store.run(lambda tx: store.finish_succeeded(tx, items, now, "w1"))()
    assert sorted(done) == sorted([(wid, 1), (other, 1)])
    counted = store.run(lambda tx: store.read_counters(tx, "twice", minute_of(now)), readonly=True)
    assert (counted.completed, counted.succeeded) == (2, 2)
    assert app.pool("twice").status(wid) == workpool.Finished(workpool.Success("live"))


def test_a_success_is_finished_where_its_claim_left_it_or_by_id_once_moved(app):
    """A claim says where it left each row (``ClaimedWork.place``: PostgreSQL's
    ctid, SQLite's rowid), and a success's finish looks there first. On PostgreSQL
    a row updated since (here its cancel flag) has moved; SQLite's rows stay, but a
    VACUUM may renumber them; and a place may hold another row: all are found by
    id. Each success finishes once."""
    store = app.store
    ids = _pending(app, "placed", 4)
    claimed = store.run(lambda tx: store.claim(tx, "placed", 4, "w1", time.time()))
    places = {w.id: w.place for w in claimed}
    assert sorted(places) == sorted(ids)
    assert None not in places.values() and len(set(places.values())) == 4
    _, moved, a, b = ids  # the first keeps its place

    def flag(tx: workpool.Tx) -> bool:
        work = store.load_for_update(tx, moved)
        assert work is not None
        return store.flag_cancel(tx, work)

    assert store.run(flag)
    # a and b trade places: each place holds the other's row.
    places[a], places[b] = places[b], places[a]
    now = time.time()
    items = [
        (w, 1, success_json(f'"{w}"'), "placed", 0.0, places[w], "running") for w in sorted(ids)
    ]
    done = store.run(lambda tx: store.finish_succeeded(tx, items, now, "w1"))()
    assert sorted(done) == sorted((w, 1) for w in ids)
    assert store.run(lambda tx: store.finish_succeeded(tx, items, now, "w1"))() == []
    pool = app.pool("placed")
    for w in ids:
        assert pool.status(w) == workpool.Finished(workpool.Success(w))
    counted = store.run(lambda tx: store.read_counters(tx, "placed", minute_of(now)), readonly=True)
    assert (counted.completed, counted.succeeded) == (4, 4)


def test_a_batch_of_successes_all_at_their_places_finishes_each_once(app):
    """The usual batch: every row where its claim left it. Each is finished with
    its own result and leaves ``work``; a stale attempt beside them takes nothing."""
    store = app.store
    ids = _pending(app, "in_place", 3)
    claimed = store.run(lambda tx: store.claim(tx, "in_place", 3, "w1", time.time()))
    now = time.time()
    items = [
        (w.id, w.attempt, success_json(f'"{w.id}"'), "in_place", 0.0, w.place, "running")
        for w in claimed
    ]
    done = store.run(lambda tx: store.finish_succeeded(tx, items, now, "w1"))()
    assert sorted(done) == sorted((w, 1) for w in ids)
    stale = [(ids[0], 1, success_json('"again"'), "in_place", 0.0, items[0][5], "running")]
    assert store.run(lambda tx: store.finish_succeeded(tx, stale + items[1:], now, "w1"))() == []
    pool = app.pool("in_place")
    for w in ids:
        assert pool.status(w) == workpool.Finished(workpool.Success(w))
    assert store.run(lambda tx: store.active_count(tx, ["in_place"]), readonly=True) == 0
    counted = store.run(
        lambda tx: store.read_counters(tx, "in_place", minute_of(now)), readonly=True
    )
    assert (counted.completed, counted.succeeded) == (3, 3)


def _no_json(app) -> None:
    """SQLite without its JSON functions (skip on PostgreSQL, which has one path)."""
    if not isinstance(app.store, SqliteStore):
        pytest.skip("only SQLite has a path without JSON arrays")
    app.store._json = False


@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_a_finish_of_successes_at_once_tells_which_took_inside_the_transaction(
    app, json_arrays: bool
):
    """``at_commit=False``: the rows are finished at once, the (id, attempt) pairs
    that took can be read before the COMMIT, and the transaction's later statements
    find those rows finished; a rollback keeps them running."""
    if not json_arrays:
        _no_json(app)
    (wid, other) = _pending(app, "at_once", 2)
    store = app.store
    claimed = store.run(lambda tx: store.claim(tx, "at_once", 2, "w1", 1.0))
    assert sorted(w.id for w in claimed) == sorted([wid, other])
    now = time.time()
    items = [
        (wid, 0, success_json('"stale"'), "at_once", 1.0, None, "running"),
        (wid, 1, success_json('"live"'), "at_once", 1.0, None, "running"),
        (other, 1, success_json("null"), "at_once", 1.0, None, "running"),
    ]
    pool = app.pool("at_once")

    def body(tx: workpool.Tx, fail: bool) -> list[tuple[str, int]]:
        taken = store.finish_succeeded(tx, items, now, "w1", at_commit=False)()
        assert store.load_many_for_update(tx, [wid, other]) == {}
        if fail:
            raise RuntimeError("rolled back")
        return taken

    with pytest.raises(RuntimeError, match="rolled back"):
        store.run(lambda tx: body(tx, True))
    assert pool.status(wid).state == pool.status(other).state == "running"
    assert sorted(store.run(lambda tx: body(tx, False))) == sorted([(wid, 1), (other, 1)])
    assert pool.status(wid) == workpool.Finished(workpool.Success("live"))
    assert pool.stats().succeeded == 2


@pytest.mark.parametrize("live_first", [False, True], ids=["stale-first", "live-first"])
@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_a_stale_and_a_live_success_of_one_item_run_its_on_complete_once(
    app, store_url: str, json_arrays: bool, live_first: bool
):
    """The completer's short path for successes with an on_complete: a batch holding
    an old attempt's success beside the current one's calls the handler once, with
    the current attempt's result and the context its claim read, whatever their
    order, and its writes commit once (on SQLite with or without its JSON
    functions)."""
    if not json_arrays:
        _no_json(app)
    table = create_table(app, store_url, "handled_marks", "k TEXT, v TEXT")

    seen: list[tuple[str, object, workpool.Result]] = []

    @app.mutation(name="seen")
    def record(tx, work_id: str, context: object, result: workpool.Result) -> None:
        seen.append((work_id, context, result))
        assert isinstance(result, workpool.Success)
        tx.execute(f"INSERT INTO {table} (k, v) VALUES ('{work_id}', '{result.return_value}')")

    @app.action(name="noop")
    def noop() -> None:
        return None

    pool = app.pool("handled", max_parallelism=10)
    wid = pool.enqueue_action("noop", on_complete="seen", context={"c": 1})
    store = app.store
    worker = Worker(store, app.registry, WorkerOptions(pools=["handled"]))
    (claimed,) = store.run(lambda tx: store.claim(tx, "handled", 1, worker.info.id, app.clock()))
    assert claimed.on_complete == "seen" and json.loads(claimed.context or "") == {"c": 1}
    assert claimed.attempt == 1
    stale = dataclasses.replace(claimed, attempt=0)
    batch = [(stale, Succeeded("stale"), 0.0), (claimed, Succeeded("live"), 0.0)]
    if live_first:
        batch.reverse()
    worker._record(batch)
    assert seen == [(wid, {"c": 1}, workpool.Success("live"))]
    with app.transaction() as tx:
        assert tx.execute(f"SELECT k, v FROM {table}").fetchall() == [(wid, "live")]
    assert pool.status(wid) == workpool.Finished(workpool.Success("live"))
    assert pool.stats().succeeded == 1


@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_the_handler_gets_the_context_its_claim_read_small_or_big(app, json_arrays: bool):
    """The short path runs a handler with the context its claim returned: no context,
    a small one (inline in SQLite's work row) and a big one (in SQLite's payloads,
    read after the claim's COMMIT) each reach the handler exactly as enqueued; work
    without a handler beside them claims no context."""
    if not json_arrays:
        _no_json(app)
    seen: dict[str, object] = {}

    @app.mutation(name="got")
    def got(tx, work_id: str, context: object, result: workpool.Result) -> None:
        assert work_id not in seen
        seen[work_id] = context

    @app.action(name="noop")
    def noop() -> None:
        return None

    pool = app.pool("contexts", max_parallelism=10)
    big = {"blob": "z" * 200_000}
    contexts: list[object] = [None, {"small": 1}, big]
    ids = [pool.enqueue_action("noop", on_complete="got", context=c) for c in contexts]
    plain = pool.enqueue_action("noop", context={"unused": True})
    store = app.store
    worker = Worker(store, app.registry, WorkerOptions(pools=["contexts"]))
    claimed = store.run(lambda tx: store.claim(tx, "contexts", 10, worker.info.id, app.clock()))
    by_id = {w.id: w for w in claimed}
    assert by_id[plain].on_complete is None and by_id[plain].context is None
    assert [json.loads(by_id[w].context or "null") for w in ids] == contexts
    worker._record([(w, Succeeded(None), 0.0) for w in claimed])
    assert seen == dict(zip(ids, contexts, strict=True))
    assert all(pool.status(w) == workpool.Finished(workpool.Success(None)) for w in [*ids, plain])


def test_a_record_of_a_success_and_a_claim_in_one_transaction_claims_the_slot_it_freed(app):
    """A worker's record that refills its slot at a limit of 1: the finish takes the
    running attempt and the claim, after it, sees its slot free and takes the next
    item; a stale finish takes nothing, and the claim then respects the limit (the
    next item still holds the one slot). (On PostgreSQL this transaction is one call
    of the record-and-claim function: test_postgres checks that it is.)"""

    @app.action
    def noop() -> None:
        pass

    pool = app.pool("refill", max_parallelism=1)
    ids = pool.enqueue_action_batch(noop, [{}, {}, {}])
    store = app.store
    (first,) = store.run(lambda tx: store.claim(tx, "refill", 1, "w1", time.time()))
    assert first.id == ids[0]

    done, claimed, _ = record_and_claim(store, "refill", first.id, success_json("7"))
    assert done == [(first.id, 1)]
    assert [(w.id, w.attempt) for w in claimed] == [(ids[1], 1)]
    assert pool.status(first.id) == workpool.Finished(workpool.Success(7))
    assert pool.stats().succeeded == 1

    done, claimed, _ = record_and_claim(store, "refill", first.id, success_json("7"))
    assert (done, claimed) == ([], [])
    assert pool.status(ids[1]).state == "running"
    assert pool.status(ids[2]).state == "pending"
    assert pool.stats().succeeded == 1


def test_a_worker_claims_at_most_its_stores_batch_in_a_transaction(app):
    """A worker with more slots than ``Store.worker_batch`` (512 on SQLite, 1,024 on
    PostgreSQL) asks for no more than that per pool in one claim, and for that much
    while more work waits; every item runs once."""
    store = app.store
    batch = store.worker_batch
    ran: list[int] = []

    @app.action(name="count")
    def count(i: int) -> None:
        ran.append(i)

    pool = app.pool("wide", max_parallelism=10 * batch)
    total = 2 * batch + 100
    ids = pool.enqueue_action_batch(count, [{"i": i} for i in range(total)])
    asked: list[int] = []
    real = store.claim_many_later

    def claim_many_later(tx, asks, worker_id, now):
        asked.extend(asks.values())
        return real(tx, asks, worker_id, now)

    store.claim_many_later = claim_many_later
    run_until_idle(app, concurrency=3 * batch, pools=["wide"])
    assert sorted(ran) == list(range(total)), "every item ran exactly once"
    assert max(asked) == batch, f"claims asked for {sorted(set(asked))[-3:]}"
    assert all(pool.status(i).state == "finished" for i in ids)


# --- ended attempts: a slot given to the next attempt before the outcome is recorded ---------


@pytest.mark.parametrize("json_arrays", [True, False], ids=["json", "per-row"])
def test_an_ended_attempt_frees_its_slot_and_is_recorded_as_a_running_one(app, json_arrays: bool):
    """``end_attempt`` and a claim in one transaction: the claim takes the slot the
    ended attempt freed, at a limit of 1; the ended work is Running to status and
    ``completing`` to stats until its success is recorded, by the same finish as a
    running attempt's, with the state and place that ``end_attempt`` answered."""
    if not json_arrays:
        _no_json(app)
    store = app.store
    first, second, third = _pending(app, "handed", 3)
    pool = app.pool("handed")
    pool.configure(max_parallelism=1)
    (work,) = store.run(lambda tx: store.claim(tx, "handed", 1, "w1", time.time()))
    assert store.run(lambda tx: store.claim(tx, "handed", 1, "w1", time.time())) == []

    ended, claimed, _ = end_and_claim(store, work, "handed")
    assert ended is not None and (ended.id, ended.state) == (first, "ended")
    assert ended.place is not None
    assert [w.id for w in claimed] == [second], "the ended attempt's slot went to the next"
    assert claimed[0].place is not None, "a claim of one says where it left its row"
    assert isinstance(pool.status(first), workpool.Running)
    stats = pool.stats()
    assert (stats.running, stats.completing, stats.backlog) == (1, 1, 1)
    assert store.run(lambda tx: store.claim(tx, "handed", 1, "w1", time.time())) == []

    again, claimed_again, _ = end_and_claim(store, work, "handed")
    assert again is None, "an attempt ends once"
    assert claimed_again == [], "and a stale end frees no slot"

    now = time.time()
    item = [(first, 1, success_json("7"), "handed", 0.0, ended.place, "ended")]
    assert store.run(lambda tx: store.finish_succeeded(tx, item, now, "w1"))() == [(first, 1)]
    assert pool.status(first) == workpool.Finished(workpool.Success(7))
    assert pool.status(third).state == "pending"


def test_an_ended_attempt_that_failed_is_retried_and_one_whose_worker_died_is_rescued(app):
    """The paths that read the row first (failures, the rescuer) take an ended row
    as they take a running one: a retry puts it back to pending; a lost one (its
    worker's lease expired) is found by ``lost_work`` and rescued."""
    from workpool.core.decide import Raised
    from workpool.core.retry import DEFAULT_RETRY
    from workpool.runtime.completion import Changes

    store = app.store
    app.pool("ends").configure(max_parallelism=2)
    ids = new_work_ids(2)
    retried = [
        NewWork(i, "ends", "action", "noop", "{}", None, None, DEFAULT_RETRY, None, 0.0, 0.0)
        for i in ids
    ]
    store.run(lambda tx: store.insert_work(tx, retried))
    claimed = store.run(lambda tx: store.claim(tx, "ends", 2, "w1", time.time()))
    for work in claimed:
        ended, _, _ = end_and_claim(store, work, "ends")
        assert ended is not None
    failing, lost = sorted(claimed, key=lambda w: w.id)

    def fail(tx):
        changes = Changes()
        row = store.load_many_for_update(tx, [failing.id])[failing.id]
        assert row.state == "ended"
        assert app.completion.complete(tx, row, Raised("boom"), time.time(), changes)
        changes.flush(store, tx, "w1", time.time())

    store.run(fail)
    status = app.pool("ends").status(failing.id)
    assert status.state == "pending" and status.previous_attempts == 1

    later = time.time() + 3600  # "w1" never sent a heartbeat: its lease is long gone
    found = store.run(lambda tx: store.lost_work(tx, ["ends"], later, 10))
    assert [(w.id, w.state) for w in found] == [(lost.id, "ended")]
    assert sorted(ids) == sorted([failing.id, lost.id])
