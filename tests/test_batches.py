"""Batches: their order, and SQLite's statements over JSON arrays against its per-row ones.

A batch's ids ascend in the order of its items, so a batch runs first to last
(claims take due work by due time, then id). SQLite writes a batch's work rows and
finishes its successes with statements over JSON arrays when its JSON functions
are there, and row by row when they are not: both must store the same thing.
"""

from __future__ import annotations

import time

import pytest

import workpool
from conftest import run_until_idle
from workpool.core.ids import new_work_ids
from workpool.core.results import success_json
from workpool.pool import STREAM_CHUNK
from workpool.store.base import NewBatch, NewWork

ODD_TEXT = 'quote " backslash \\ newline \n é 雪 \u2028 {"not": "json"}'


def test_a_batch_runs_in_the_order_of_its_items(app, rec):
    @app.action(name="step")
    def step(i: int) -> None:
        rec.add(i=i)

    pool = app.pool("fifo", max_parallelism=1)
    ids = pool.enqueue_action_batch(step, [{"i": i} for i in range(40)])
    assert ids == sorted(ids)
    run_until_idle(app, concurrency=1)
    assert rec.values("i") == list(range(40))


def test_a_new_batch_is_the_sequence_of_its_items():
    ids = new_work_ids(3)
    batch = NewBatch(
        ids, ['{"i": 0}', '{"i": 1}', '{"i": 2}'], "p", "action", "f", "h", '{"c": 1}', None,
        5.0, 10.0, 9.0,
    )  # fmt: skip
    items = [
        NewWork(w, "p", "action", "f", f'{{"i": {k}}}', "h", '{"c": 1}', None, 5.0, 10.0, 9.0)
        for k, w in enumerate(ids)
    ]
    assert len(batch) == 3
    assert list(batch) == items
    assert batch[-1] == items[2]
    tail = batch[1:]
    assert isinstance(tail, NewBatch)
    assert list(tail) == items[1:]


def test_a_batch_of_small_and_big_args_comes_back_whole(app, rec):
    """One enqueue whose args fall on both sides of the size up to which a store
    keeps them in the work row, with a context for its handler: every item runs
    with its own args, and its handler gets the context."""

    @app.action(name="sized")
    def sized(i: int, text: str) -> int:
        rec.add(i=i, size=len(text))
        return i

    @app.mutation(name="sized_done")
    def sized_done(tx, work_id, context, result):
        rec.add(done=result.return_value, context=context)

    sizes = [0, 10, 480, 505, 520, 4_000, 9_000, 20_000]
    pool = app.pool("sized")
    args = [{"i": i, "text": ODD_TEXT + "x" * size} for i, size in enumerate(sizes)]
    context = {"note": ODD_TEXT}
    ids = pool.enqueue_action_batch(sized, args, on_complete=sized_done, context=context)
    run_until_idle(app)
    ran = sorted((c["i"], c["size"]) for c in rec.calls if "size" in c)
    assert ran == [(i, len(ODD_TEXT) + size) for i, size in enumerate(sizes)]
    done = sorted((c["done"], c["context"] == context) for c in rec.calls if "done" in c)
    assert done == [(i, True) for i in range(len(sizes))]
    for i, work_id in enumerate(ids):
        assert pool.status(work_id) == workpool.Finished(workpool.Success(i))


@pytest.fixture(params=[True, False], ids=["json", "per-row"])
def sqlite_app(request, tmp_path):
    """A SQLite app whose statements over JSON arrays are on or off."""
    app = workpool.App(f"sqlite:///{tmp_path / 'workpool.db'}")
    app._migrate()
    app.store._json = request.param
    try:
        yield app
    finally:
        app.close()


def test_a_batch_is_stored_and_finished_alike_with_or_without_json(sqlite_app, rec):
    app = sqlite_app

    @app.action(name="echo")
    def echo(i: int, text: str) -> object:
        rec.add(i=i)
        return {"i": i, "text": text} if i % 3 else None

    pool = app.pool("alike")
    same = pool.enqueue_action_batch(echo, [{"i": i, "text": ODD_TEXT} for i in range(30)])
    # Rows that differ in more than their ids (timeouts, due times): only the
    # store's own insert makes such a batch.
    now = time.time()
    mixed = [
        NewWork(
            work_id,
            "alike",
            "action",
            "echo",
            f'{{"i": {100 + k}, "text": "t{k}"}}',
            None,
            None,
            None,
            None if k % 2 else 30.0,
            now - k,
            now,
        )
        for k, work_id in enumerate(new_work_ids(10))
    ]
    app.store.run(lambda tx: app.store.insert_work(tx, mixed))
    assert pool.status(same[0]).state == "pending"
    run_until_idle(app)
    assert sorted(rec.values("i")) == list(range(30)) + list(range(100, 110))
    for i, work_id in enumerate(same):
        expected = {"i": i, "text": ODD_TEXT} if i % 3 else None
        assert pool.status(work_id) == workpool.Finished(workpool.Success(expected))
    for k, item in enumerate(mixed):
        expected = {"i": 100 + k, "text": f"t{k}"} if (100 + k) % 3 else None
        assert pool.status(item.id) == workpool.Finished(workpool.Success(expected))
    assert pool.stats().succeeded == 40


def test_a_success_of_a_stale_attempt_finishes_nothing_with_or_without_json(sqlite_app):
    app = sqlite_app
    store = app.store

    @app.action(name="noop")
    def noop() -> None:
        return None

    pool = app.pool("stale")
    first, second = pool.enqueue_action_batch(noop, [{}, {}])
    claimed = store.run(lambda tx: store.claim(tx, "stale", 2, "w1", time.time()))
    assert sorted(w.id for w in claimed) == [first, second]

    def finish(items):
        stored = [
            (w, attempt, success_json(value), "stale", 0.0, None, "running")
            for w, attempt, value in items
        ]
        return store.run(lambda tx: store.finish_succeeded(tx, stored, time.time(), "w"))()

    # A wrong attempt number, and an id that is not there: nothing is finished.
    assert finish([(first, 2, '"late"'), ("no-such-id", 1, "1")]) == []
    assert pool.status(first).state == "running"
    assert finish([(first, 1, '"on time"'), (second, 1, "null")]) == [(first, 1), (second, 1)]
    assert pool.status(first) == workpool.Finished(workpool.Success("on time"))
    assert pool.status(second) == workpool.Finished(workpool.Success(None))
    assert finish([(first, 1, '"again"')]) == []  # finished once only
    assert pool.status(first) == workpool.Finished(workpool.Success("on time"))


def test_outcomes_with_on_complete_are_finished_alike_with_or_without_json(sqlite_app, rec):
    """Failures, cancels and successes with on_complete go through finish_many."""
    app = sqlite_app

    @app.action(name="mixed")
    def mixed(i: int) -> int:
        if i % 4 == 1:
            raise workpool.NonRetryableError(f"no {i}: {ODD_TEXT}")
        return i

    @app.mutation(name="seen")
    def seen(tx, work_id, context, result):
        rec.add(work_id=work_id, context=context, kind=result.kind)

    pool = app.pool("outcomes")
    ids = pool.enqueue_action_batch(
        mixed, [{"i": i} for i in range(24)], on_complete=seen, context={"c": ODD_TEXT}
    )
    canceled = ids[3::8]
    for work_id in canceled:
        pool.cancel(work_id)
    run_until_idle(app)
    assert sorted(rec.values("work_id")) == sorted(ids)  # each handler once
    assert rec.values("context") == [{"c": ODD_TEXT}] * len(ids)
    for i, work_id in enumerate(ids):
        status = pool.status(work_id)
        assert status.state == "finished"
        if work_id in canceled:
            assert status.result == workpool.Canceled()
        elif i % 4 == 1:
            assert status.result == workpool.Failed(f"no {i}: {ODD_TEXT}")
        else:
            assert status.result == workpool.Success(i)
    stats = pool.stats()
    assert (stats.succeeded, stats.failed, stats.canceled) == (15, 6, 3)


# A batch bigger than one statement's chunk (PostgreSQL streams it: each chunk is
# checked and built while the server inserts the one before).
BIG = STREAM_CHUNK * 3 + 7


def _stored(app) -> int:
    return app.pool("big").stats().backlog


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"x": object()}, workpool.InvalidTypeError),
        ({"not-a-name": 1}, workpool.InvalidArgumentError),
    ],
)
def test_a_big_batch_with_a_bad_item_in_its_last_chunk_stores_nothing(app, bad, error):
    @app.action(name="noop")
    def noop(i: int = 0, **_: object) -> None:
        pass

    pool = app.pool("big")
    pool.enqueue_action(noop, {"i": -1})  # the Pool now knows the stored config
    args = [{"i": i} for i in range(BIG)]
    args[-2] = bad
    with pytest.raises(error):
        pool.enqueue_action_batch(noop, args)
    assert _stored(app) == 1
    ids = pool.enqueue_action_batch(noop, args[:-2])
    assert len(set(ids)) == BIG - 2
    assert _stored(app) == BIG - 1


@pytest.mark.parametrize("when", ["before", "between"])
def test_a_big_batch_meets_a_config_change(app, store_url, when):
    @app.action(name="noop")
    def noop(i: int) -> None:
        pass

    pool = app.pool("big", max_parallelism=3)
    pool.enqueue_action(noop, {"i": -1})
    store = app.store
    if when == "between" and not store.streams_inserts:
        pytest.skip("SQLite: a batch's transaction holds the one write lock throughout")
    other = workpool.App(store_url)
    insert_work_if = store.insert_work_if
    calls = 0

    def then_reconfigure(*args, **kwargs):
        # Another process changes the pool's config after the first chunk went out.
        nonlocal calls
        calls += 1
        answer = insert_work_if(*args, **kwargs)
        if calls == 1:
            other.pool("big").configure(max_parallelism=5)
        return answer

    if when == "before":
        other.pool("big").configure(max_parallelism=5)
    else:
        store.insert_work_if = then_reconfigure
    try:
        ids = pool.enqueue_action_batch(noop, [{"i": i} for i in range(BIG)])
    finally:
        store.__dict__.pop("insert_work_if", None)
        other.close()
    assert len(set(ids)) == BIG
    assert _stored(app) == BIG + 1  # each item once: the chunks before the change too
    assert [pool.status(i).state for i in (ids[0], ids[-1])] == ["pending", "pending"]
    assert pool._known is not None and pool._known.max_parallelism == 5
