"""Group commit of small writes from concurrent threads (``Combiner``), on both stores.

Callers that arrive while another's transaction is open share the next one; a body
that fails it sends every caller back to run its own alone, so each meets only its
own error (the store unavailable fails them all); an interrupted waiter leaves the
queue without stalling it. The App uses
it for small enqueues where the store says it pays (SQLite); the mechanism itself
is store-neutral and tested on both.
"""

from __future__ import annotations

import signal
import threading
from collections import Counter
from typing import Any

import pytest

from conftest import Recorder, run_until_idle, store_kind, wait_for
from workpool.core.errors import StoreUnavailableError
from workpool.store.combine import Combiner


class _Held:
    """A leader whose transaction stays open until ``release``: callers queue behind it."""

    def __init__(self, combiner: Combiner, table: Any) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.combiner = combiner

        def body(tx: Any) -> str:
            table.insert(tx, "leader")
            self.entered.set()
            assert self.go.wait(30)
            return "leader"

        self.thread = threading.Thread(target=combiner.run, args=(body,), daemon=True)

    def __enter__(self) -> _Held:
        self.thread.start()
        assert self.entered.wait(30)
        return self

    def queued(self, count: int) -> None:
        wait_for(lambda: len(self.combiner._queue) == count, timeout=30)

    def release(self) -> None:
        self.go.set()

    def __exit__(self, *exc: object) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _call(combiner: Combiner, body: Any, out: dict[str, Any], key: str) -> threading.Thread:
    def target() -> None:
        try:
            out[key] = combiner.run(body)
        except Exception as exc:  # the caller's own error, checked by the test
            out[key] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _inserting(table: Any, key: str, txs: dict[str, Any], fail: bool = False) -> Any:
    def body(tx: Any) -> str:
        txs.setdefault(key, []).append(tx)
        table.insert(tx, key)
        if fail:
            raise ValueError(f"body {key} refuses")
        return key.upper()

    return body


def test_callers_queued_behind_a_transaction_share_the_next_one(app, user_table):
    combiner = Combiner(app.store)
    txs: dict[str, Any] = {}
    out: dict[str, Any] = {}
    with _Held(combiner, user_table) as held:
        threads = [_call(combiner, _inserting(user_table, k, txs), out, k) for k in "bcd"]
        held.queued(3)
        # Nothing queued has run, and the leader's transaction is still open (a read:
        # a write would wait for the leader's lock on SQLite).
        assert app.run(user_table.count, readonly=True) == 0
        held.release()
        for thread in threads:
            thread.join(30)
    assert out == {"b": "B", "c": "C", "d": "D"}
    assert [k for k, _ in user_table.rows()] == ["b", "c", "d", "leader"]
    # One transaction for the three, each body run once in it.
    assert all(len(txs[k]) == 1 for k in "bcd")
    assert txs["b"][0] is txs["c"][0] is txs["d"][0]


def test_a_failing_body_fails_only_its_own_caller(app, user_table):
    combiner = Combiner(app.store)
    txs: dict[str, Any] = {}
    out: dict[str, Any] = {}
    with _Held(combiner, user_table) as held:
        threads = [
            _call(combiner, _inserting(user_table, k, txs, fail=k == "c"), out, k) for k in "bcd"
        ]
        held.queued(3)
        held.release()
        for thread in threads:
            thread.join(30)
    assert out["b"] == "B" and out["d"] == "D"
    assert isinstance(out["c"], ValueError) and "body c refuses" in str(out["c"])
    # The shared transaction rolled back whole; each body ran again alone (b and d
    # landed once each, c failed again); c's insert is nowhere.
    assert Counter(k for k, _ in user_table.rows()) == {"b": 1, "d": 1, "leader": 1}
    shared = txs["c"][0]
    assert len(txs["c"]) == 2 and txs["c"][1] is not shared
    alone = {id(txs[k][-1]) for k in "bcd"}
    assert len(alone) == 3 and id(shared) not in alone


def test_the_store_unavailable_fails_every_caller_of_the_transaction(app, user_table):
    # The store's fault, not a body's: nobody runs again alone, and each caller
    # gets an error of its own.
    combiner = Combiner(app.store)
    txs: dict[str, Any] = {}
    out: dict[str, Any] = {}

    def down(tx: Any) -> str:
        txs.setdefault("down", []).append(tx)
        raise StoreUnavailableError("the store went away")

    with _Held(combiner, user_table) as held:
        threads = [_call(combiner, _inserting(user_table, k, txs), out, k) for k in "bc"]
        held.queued(2)
        threads.append(_call(combiner, down, out, "down"))
        held.queued(3)
        held.release()
        for thread in threads:
            thread.join(30)
    assert all(isinstance(out[k], StoreUnavailableError) for k in ("b", "c", "down"))
    assert len({id(out[k]) for k in ("b", "c", "down")}) == 3
    assert all(len(txs[k]) == 1 for k in ("b", "c", "down"))
    assert [k for k, _ in user_table.rows()] == ["leader"]


def test_a_single_failing_body_runs_once(app, user_table):
    combiner = Combiner(app.store)
    txs: dict[str, Any] = {}
    with pytest.raises(ValueError, match="body x refuses"):
        combiner.run(_inserting(user_table, "x", txs, fail=True))
    assert len(txs["x"]) == 1
    assert user_table.count() == 0
    assert combiner.run(_inserting(user_table, "y", txs)) == "Y"  # the next caller leads


class _Interrupted(Exception):
    pass


def test_an_interrupted_waiter_leaves_the_queue_and_the_others_go_on(app, user_table):
    combiner = Combiner(app.store)
    txs: dict[str, Any] = {}
    out: dict[str, Any] = {}

    def interrupt(signum: int, frame: Any) -> None:
        if len(combiner._queue) != 1:  # this thread has not queued yet: look again later
            signal.setitimer(signal.ITIMER_REAL, 0.02)
            return
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with _Held(combiner, user_table) as held:
            signal.setitimer(signal.ITIMER_REAL, 0.02)
            with pytest.raises(_Interrupted):
                combiner.run(_inserting(user_table, "m", txs))  # queues, then is interrupted
            assert len(combiner._queue) == 0
            later = _call(combiner, _inserting(user_table, "n", txs), out, "n")
            held.queued(1)
            held.release()
            later.join(30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert out == {"n": "N"}
    assert "m" not in txs  # it left before any transaction took it
    assert [k for k, _ in user_table.rows()] == ["leader", "n"]
    assert combiner.run(_inserting(user_table, "o", txs)) == "O"


def test_enqueues_from_many_threads_each_land_once_with_their_own_args(app, rec):
    @app.action(name="note")
    def note(i: int) -> None:
        rec.add(i=i)

    pool = app.pool("crowd", max_parallelism=50)
    enqueued, transactions = Recorder(), Recorder()
    real_run = app.store.run

    def counted_run(fn: Any, **kw: Any) -> Any:
        transactions.add()
        return real_run(fn, **kw)

    app.store.run = counted_run  # counts the transactions; the store itself is real

    def producer(base: int) -> None:
        for k in range(40):
            enqueued.add(id=pool.enqueue_action("note", {"i": base + k}))

    threads = [threading.Thread(target=producer, args=(t * 1000,)) for t in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    del app.store.run
    ids = enqueued.values("id")
    assert len(set(ids)) == 480
    assert {pool.status(i).state for i in ids} == {"pending"}
    run_until_idle(app, pools=["crowd"], concurrency=20)
    assert sorted(rec.values("i")) == sorted(t * 1000 + k for t in range(12) for k in range(40))
    if store_kind(app.url) == "sqlite":
        assert app.store.combines_writes
        assert len(transactions.calls) < 480  # some enqueues shared a commit
    else:
        assert not app.store.combines_writes
        assert len(transactions.calls) >= 480
