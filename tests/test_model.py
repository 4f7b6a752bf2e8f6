"""Model-based test of the work state machine, on both stores.

A hypothesis ``RuleBasedStateMachine`` interleaves enqueue, claim, completion
(success, retryable and non-retryable failure), retries becoming due, cancel
(pending, running, duplicate, ``cancel_all``), lease expiry with the rescuer,
stale completions, on_complete handler failures and retries, pausing, and
clock advances -- and compares the store with a small reference model after
every step.

The library is driven *below* the worker threads, so a run is deterministic:
claims go through ``store.claim``, outcomes through ``Completion.complete``
exactly as ``Worker._record_in`` (actions) and ``Worker._run_in_tx``
(mutations) do, lost work through ``store.lost_work`` + ``Completion.rescue``
as ``Maintenance.rescue`` does, handler retries through ``store.due_handlers``
+ ``Completion.retry_handler``. The clock is injected (``app.clock``) and the
jitter is fixed (``rand=lambda: 0.5``: a retry waits exactly
``initial_backoff * base**(n-1)``).

The model is written from PRODUCT.md, docs/design.md and core/decide.py; it
does not call the library to predict the library.

Plain tests of ``core.decide.decide`` and ``core.states.TRANSITIONS`` are at the
end of the file.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import workpool
from workpool import Canceled, Failed, Finished, Pending, RetryBehavior, Running, Success
from workpool.core.decide import Finish, Raised, RetryAt, Succeeded, decide
from workpool.core.errors import NonRetryableError, describe_error
from workpool.core.states import RECORDABLE, TRANSITIONS, WorkState, allowed
from workpool.runtime.completion import Changes, Completion, HandlerRaised
from workpool.store.base import (
    ActiveWork,
    ClaimedWork,
    Finishing,
    Handing,
    Retrying,
    WorkerInfo,
)

pytestmark = pytest.mark.timeout(240)

T0 = 1_700_000_000.0  # the fake clock starts here (exact binary fractions stay exact)
LEASE = 10.0
POOL = "model"
LIVE_WORKERS = ("w1", "w2")
GHOST = "ghost"  # claims under a worker id that never had a lease row
RESCUER = "rescuer"
HANDLER_ERROR = "RuntimeError: handler boom"
HANDLER_TRIES = 5  # core.decide.HANDLER_RETRY.max_attempts, per docs/design.md
HANDLER_BACKOFF = 0.5  # first handler retry after 0.5 s, then doubling
MAX_LOST_RUNS = 5  # a mutation lost this many times in a row fails
TABLES = ("work", "finished", "payloads", "pools", "workers", "counters", "duties")
BIG_WINDOW = 4 * 365 * 86_400.0  # the largest stats window: counters from the whole run


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@dataclass
class HandlerLog:
    """What the on_complete handler saw: calls (also rolled back ones) and commits."""

    calls: Counter[str] = field(default_factory=Counter)
    commits: Counter[str] = field(default_factory=Counter)
    results: dict[str, Any] = field(default_factory=dict)


# Work ids are made deterministic (time-ordered like UUIDv7) so that hypothesis
# replays a failing example exactly: claims break due-time ties by id.
ID_COUNTER = [0]


def next_work_ids(count: int) -> list[str]:
    first = ID_COUNTER[0] + 1
    ID_COUNTER[0] += count
    return [f"01000000-0000-7000-8000-{n:012x}" for n in range(first, first + count)]


# How often the interesting paths ran (read by a debugging session, never asserted).
COVERAGE: Counter[str] = Counter()

# The handler is registered once per App; it reports to the machine running now.
LOG: list[HandlerLog] = [HandlerLog()]


def on_done(tx: workpool.Tx, work_id: str, context: Any, result: workpool.Result) -> None:
    log = LOG[0]
    log.calls[work_id] += 1
    if log.calls[work_id] <= context["fail"]:
        raise RuntimeError("handler boom")

    def committed() -> None:
        log.commits[work_id] += 1
        log.results[work_id] = result

    tx.after_commit.append(committed)


def act(**kwargs: Any) -> None:  # never called: outcomes are injected
    raise AssertionError("the model test runs no attempt")


def mut(tx: workpool.Tx, **kwargs: Any) -> None:  # never called either
    raise AssertionError("the model test runs no attempt")


@dataclass
class Item:
    """The model of one work item."""

    wid: str
    kind: str  # action | mutation
    retry: RetryBehavior | None
    handler_fails: int | None  # None: no on_complete; else the handler raises this often
    due_at: float
    enqueued_at: float
    state: str = "pending"  # pending | running | ended | completing | finished
    attempt: int = 0
    started_at: float | None = None
    worker: str | None = None
    cancel_requested: bool = False
    last_error: str | None = None
    result: workpool.Result | None = None
    handler_failures: int = 0
    handler_error: str | None = None
    lost_count: int = 0
    canceled_pending: bool = False


@dataclass
class Tally:
    completed: int = 0
    succeeded: int = 0
    failed: int = 0
    retries: int = 0
    canceled: int = 0

    def count(self, result: workpool.Result) -> None:
        self.completed += 1
        if isinstance(result, Success):
            self.succeeded += 1
        elif isinstance(result, Failed):
            self.failed += 1
        else:
            self.canceled += 1


OUTCOME_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=6),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)
OUTCOMES = st.one_of(
    st.tuples(st.just("ok"), OUTCOME_VALUES),
    st.tuples(st.just("raise"), st.booleans()),  # (raise, retryable)
)
RETRY_BEHAVIORS = st.builds(
    RetryBehavior,
    max_attempts=st.integers(1, 4),
    initial_backoff=st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]),
    base=st.sampled_from([1.0, 2.0, 3.0]),
)
RETRY_OPTIONS = st.one_of(st.none(), st.booleans(), RETRY_BEHAVIORS)
DELAYS = st.one_of(
    st.just(("none", 0.0)),
    st.tuples(st.just("after"), st.sampled_from([-5.0, 0.0, 0.0, 0.5, 1.0, 4.0, 30.0])),
    st.tuples(st.just("at"), st.sampled_from([-2 * 365 * 86_400.0, -100.0, -0.5, 0.0, 2.0, 8.0])),
    st.tuples(st.just("at_datetime"), st.sampled_from([-50.0, 0.0, 3.0])),
)


class WorkModel(RuleBasedStateMachine):
    app: ClassVar[workpool.App]

    def __init__(self) -> None:
        super().__init__()
        app = self.app
        store = app.store
        prefix = getattr(store, "table_prefix", "")
        app.run(lambda tx: [tx.execute(f"DELETE FROM {prefix}{t}") for t in TABLES])
        self.store = store
        self.clock = Clock()
        app.clock = self.clock
        self.log = HandlerLog()
        LOG[0] = self.log
        ID_COUNTER[0] = 0
        self.completion = Completion(store, app.registry, lambda pool: "REPORT", rand=lambda: 0.5)
        self.items: dict[str, Item] = {}
        self.attempts: list[tuple[str, int, str]] = []  # every (id, attempt, kind) claimed
        self.snapshots: dict[tuple[str, int], ActiveWork] = {}
        self.expires: dict[str, float] = {w: -math.inf for w in (*LIVE_WORKERS, GHOST)}
        self.tally = Tally()
        self.log_calls: dict[str, int] = {}
        self.limit = 0
        self.over_limit_ok = False
        self.pool: workpool.Pool

    # --- helpers --------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.clock.now

    def of_state(self, *states: str) -> list[Item]:
        return [i for i in self.items.values() if i.state in states]

    def stale_attempts(self) -> list[tuple[str, int, str]]:
        return [
            (wid, attempt, kind)
            for wid, attempt, kind in self.attempts
            if not (
                self.items[wid].state in ("running", "ended") and self.items[wid].attempt == attempt
            )
        ]

    def dump(self) -> tuple[Any, ...]:
        """Every row the state machine's operations could touch."""
        prefix = getattr(self.store, "table_prefix", "")

        def body(tx: workpool.Tx) -> tuple[Any, ...]:
            return tuple(
                sorted(tuple(r) for r in tx.execute(f"SELECT * FROM {prefix}{t}").fetchall())
                for t in ("work", "finished", "counters")
            )

        return self.app.run(body, readonly=True)

    def run_handler(self, item: Item) -> None:
        """Model: on_complete runs (or not) for a fixed result; finished or completing."""
        if item.handler_fails is None:
            item.state = "finished"
            return
        calls = self.log_calls[item.wid] = self.log_calls.get(item.wid, 0) + 1
        if calls > item.handler_fails:
            item.state = "finished"
            return
        failures = item.handler_failures + 1
        COVERAGE["handler_failed"] += 1
        if failures >= HANDLER_TRIES:
            COVERAGE["handler_given_up"] += 1
            item.state = "finished"
            item.handler_error = HANDLER_ERROR
            return
        item.state = "completing"
        item.handler_failures = failures
        item.due_at = self.now + HANDLER_BACKOFF * 2.0 ** (failures - 1)
        item.last_error = HANDLER_ERROR
        item.worker = None

    def finish(self, item: Item, result: workpool.Result) -> None:
        item.result = result
        item.worker = None
        self.run_handler(item)

    def attempt_ended(self, item: Item, outcome: tuple[Any, ...], error: str) -> None:
        """Model of decide() + the completer: an attempt of a running item ended."""
        if outcome[0] == "ok":
            result: workpool.Result = Success(outcome[1])
        else:
            retryable = outcome[1]
            if retryable and item.retry is not None and item.attempt < item.retry.max_attempts:
                if item.cancel_requested:
                    result = Canceled()
                else:
                    COVERAGE["retry"] += 1
                    self.tally.completed += 1
                    self.tally.retries += 1
                    delay = min(
                        item.retry.initial_backoff * item.retry.base ** (item.attempt - 1),
                        86_400.0,
                    )
                    item.state = "pending"
                    item.due_at = self.now + delay
                    item.last_error = error
                    item.worker = None
                    return
            else:
                result = Failed(error)
        COVERAGE[f"finish_{result.kind}_{item.kind}"] += 1
        self.tally.count(result)
        self.finish(item, result)

    def outcome_of(self, kind: str, outcome: tuple[Any, ...]) -> tuple[Any, str]:
        """The library's AttemptOutcome for a model outcome, as the worker builds it."""
        if outcome[0] == "ok":
            return Succeeded(outcome[1]), ""
        if kind == "mutation":  # a raising mutation is never retried
            error = describe_error(ValueError("mutation boom"))
            return Raised(error, retryable=False), error
        exc: Exception = ValueError("boom") if outcome[1] else NonRetryableError("stop now")
        return Raised(describe_error(exc), retryable=outcome[1]), describe_error(exc)

    def record(self, wid: str, attempt: int, kind: str, outcome: Any) -> bool:
        """Record an attempt's outcome exactly as the worker does; False if fenced off.

        Actions: ``Worker._record`` / ``_record_in`` -- an optimistic pass without
        savepoints, redone with the handler failure known if the handler raised.
        Mutations: ``Worker._run_in_tx``, which checks the row before running.
        """
        store, now = self.store, self.now

        def body(tx: workpool.Tx, optimistic: bool, known: dict[str, Any]) -> bool:
            if not optimistic:
                return attempt_body(tx, optimistic, known)
            with store.pipeline(tx):  # as the worker's optimistic pass
                return attempt_body(tx, optimistic, known)

        def attempt_body(tx: workpool.Tx, optimistic: bool, known: dict[str, Any]) -> bool:
            if kind == "action":
                current = store.load_many_for_update(tx, [wid]).get(wid)
            else:
                current = store.load_for_update(tx, wid)
            if current is None or current.state not in RECORDABLE or current.attempt != attempt:
                return False
            changes = Changes(optimistic=optimistic, known_failures=dict(known))
            done = self.completion.complete(tx, current, outcome, now, changes, 0.0)
            changes.flush(store, tx, LIVE_WORKERS[0], now)
            return done

        if kind != "action":
            return store.run(lambda tx: body(tx, False, {}))
        optimistic, known = True, {}
        while True:
            try:
                return store.run(partial(body, optimistic=optimistic, known=known))
            except HandlerRaised as raised:
                assert optimistic, "the second pass runs handlers in savepoints"
                COVERAGE["optimistic_redo"] += 1
                optimistic = False
                if raised.work_id is not None:
                    known[raised.work_id] = (raised.error, raised.trace)

    # --- setup ----------------------------------------------------------------------------
    @initialize(
        limit=st.integers(1, 3),
        retry_by_default=st.booleans(),
        default_retry=RETRY_BEHAVIORS,
    )
    def setup_pool(self, limit: int, retry_by_default: bool, default_retry: RetryBehavior) -> None:
        self.limit = limit
        self.retry_by_default = retry_by_default
        self.default_retry = default_retry
        self.pool = self.app.pool(
            POOL,
            max_parallelism=limit,
            retry_actions_by_default=retry_by_default,
            default_retry=default_retry,
        )
        self.pool.configure()  # store the config now
        for worker in LIVE_WORKERS:
            self.heartbeat(worker)

    # --- rules ----------------------------------------------------------------------------
    @rule(
        kind=st.sampled_from(["action", "action", "mutation"]),
        retry=RETRY_OPTIONS,
        handler_fails=st.one_of(st.none(), st.sampled_from([0, 0, 1, 2, 6])),
        delay=DELAYS,
        count=st.integers(1, 2),
    )
    def enqueue(
        self,
        kind: str,
        retry: Any,
        handler_fails: int | None,
        delay: tuple[str, float],
        count: int,
    ) -> None:
        now = self.now
        options: dict[str, Any] = {}
        how, seconds = delay
        if how == "after":
            options["run_after"] = seconds
            due = now + max(seconds, 0.0)
        elif how == "at":
            options["run_at"] = now + seconds
            due = now if seconds < -365 * 86_400.0 else now + seconds
        elif how == "at_datetime":
            options["run_at"] = datetime.fromtimestamp(now + seconds, UTC)
            due = now + seconds
        else:
            due = now
        if handler_fails is not None:
            options["on_complete"] = "on_done"
            options["context"] = {"fail": handler_fails}
        if kind == "action":
            options["retry"] = retry
            if retry is None:
                expected_retry = self.default_retry if self.retry_by_default else None
            elif retry is True:
                expected_retry = self.default_retry
            elif retry is False:
                expected_retry = None
            else:
                expected_retry = retry
            fn = act
        else:
            expected_retry = None
            fn = mut
        args = [{"n": i} for i in range(count)]
        if kind == "action":
            if count == 1:
                ids = [self.pool.enqueue_action(fn, args[0], **options)]
            else:
                ids = self.pool.enqueue_action_batch(fn, args, **options)
        elif count == 1:
            ids = [self.pool.enqueue_mutation(fn, args[0], **options)]
        else:
            ids = self.pool.enqueue_mutation_batch(fn, args, **options)
        assert len(ids) == count == len(set(ids))
        for wid in ids:
            assert wid not in self.items
            self.items[wid] = Item(wid, kind, expected_retry, handler_fails, due, now)

    @rule(worker=st.sampled_from([*LIVE_WORKERS, GHOST]), limit=st.integers(1, 4))
    def claim(self, worker: str, limit: int) -> None:
        self._claim(worker, limit)

    @precondition(
        lambda self: (
            len(self.of_state("running")) < self.limit
            and any(i.due_at <= self.now for i in self.of_state("pending"))
        )
    )
    @rule(worker=st.sampled_from(LIVE_WORKERS), outcome=OUTCOMES)
    def quick_attempt(self, worker: str, outcome: tuple[Any, ...]) -> None:
        """Claim one due item and record its outcome at once."""
        (work,) = self._claim(worker, 1)
        self._complete(self.items[work.id], outcome)

    @precondition(
        lambda self: (
            len(self.of_state("running")) < self.limit
            and any(i.due_at <= self.now for i in self.of_state("pending"))
        )
    )
    @rule()
    def attempt_lost(self) -> None:
        """A worker claims one item and dies at once; the rescuer finds it."""
        (work,) = self._claim(GHOST, 1)
        self.rescue()
        assert self.items[work.id].state != "running"

    def _claim(self, worker: str, limit: int) -> list[Any]:
        store, now = self.store, self.now

        def body(tx: workpool.Tx) -> list[Any]:
            config = store.load_pool(tx, POOL)
            assert config is not None and config.max_parallelism == self.limit
            return store.claim(tx, POOL, limit, worker, now)

        claimed = store.run(body)
        running = len(self.of_state("running"))
        due = sorted(
            (i for i in self.of_state("pending") if i.due_at <= now),
            key=lambda i: (i.due_at, i.wid),
        )
        expected = due[: max(0, min(limit, self.limit - running))]
        # Oldest due first (ties by id): the exact rows, in any order.
        assert sorted(c.id for c in claimed) == sorted(i.wid for i in expected), (
            claimed,
            expected,
        )
        ids = [c.id for c in claimed]
        assert len(ids) == len(set(ids))
        COVERAGE["claims_nonempty" if claimed else "claims_empty"] += 1
        for work in claimed:
            item = self.items[work.id]
            assert not item.canceled_pending, "canceled pending work was claimed"
            assert item.state == "pending"
            assert (work.pool, work.kind, work.fn_name) == (
                POOL,
                item.kind,
                "act" if item.kind == "action" else "mut",
            )
            assert work.attempt == item.attempt + 1
            assert work.due_at == item.due_at
            assert work.started_at == now
            item.state = "running"
            item.attempt += 1
            item.started_at = now
            item.worker = worker
            self.attempts.append((work.id, work.attempt, item.kind))
        if claimed:
            assert len(self.of_state("running")) <= self.limit
            snap = store.run(lambda tx: store.load_many_for_update(tx, ids))
            for wid, row in snap.items():
                self.snapshots[(wid, row.attempt)] = row
        return claimed

    @precondition(lambda self: bool(self.of_state("running", "ended")))
    @rule(data=st.data(), outcome=OUTCOMES)
    def complete(self, data: st.DataObject, outcome: tuple[Any, ...]) -> None:
        live = sorted(self.of_state("running", "ended"), key=lambda i: i.wid)
        item = data.draw(st.sampled_from(live), label="item")
        self._complete(item, outcome)

    @precondition(lambda self: any(i.kind == "action" for i in self.of_state("running")))
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        """An action returned and its worker gave its slot on (``Worker._hand_over``):
        the attempt is ended, its outcome recorded later (``complete``), or never if
        its worker dies (``rescue``)."""
        running = sorted(
            (i for i in self.of_state("running") if i.kind == "action"), key=lambda i: i.wid
        )
        item = data.draw(st.sampled_from(running), label="item")
        assert item.started_at is not None
        work = ClaimedWork(item.wid, POOL, "action", "act", "{}", item.attempt, None, 0.0, 0.0)
        ended = self.store.run(lambda tx: self.store.end_attempt(tx, work))()
        assert ended is not None and (ended.id, ended.state) == (item.wid, "ended")
        again = self.store.run(lambda tx: self.store.end_attempt(tx, work))()
        assert again is None, "an attempt ends once"
        COVERAGE["ended"] += 1
        item.state = "ended"

    def _complete(self, item: Item, outcome: tuple[Any, ...]) -> None:
        attempt_outcome, error = self.outcome_of(item.kind, outcome)
        if item.kind == "mutation" and outcome[0] == "raise":
            outcome = ("raise", False)
        assert self.record(item.wid, item.attempt, item.kind, attempt_outcome)
        self.attempt_ended(item, outcome, error)

    def stale_snapshots(self) -> list[tuple[str, int]]:
        return [
            key
            for key in sorted(self.snapshots)
            if not (self.items[key[0]].state == "running" and self.items[key[0]].attempt == key[1])
        ]

    @precondition(lambda self: bool(self.stale_attempts()))
    @rule(data=st.data(), how=st.sampled_from(["record", "record", "finish", "retry", "hand"]))
    def stale(self, data: st.DataObject, how: str) -> None:
        """A late or duplicate outcome of an attempt that already ended changes nothing.

        ``record`` goes through the worker's path (checked under lock); the others
        call the store's compare-and-set writes directly with a stale row.
        """
        before = self.dump()
        calls = dict(self.log.calls)
        if how == "record":
            wid, attempt, kind = data.draw(st.sampled_from(self.stale_attempts()), label="stale")
            outcome = data.draw(OUTCOMES, label="outcome")
            attempt_outcome, _ = self.outcome_of(kind, outcome)
            assert not self.record(wid, attempt, kind, attempt_outcome)
        else:
            work = self.snapshots[data.draw(st.sampled_from(self.stale_snapshots()))]
            store, now = self.store, self.now
            result = '{"kind": "failed", "error": "stale"}'

            def body(tx: workpool.Tx) -> None:
                if how == "finish":
                    store.finish_many(tx, [Finishing(work, "failed", result)], now)
                elif how == "retry":
                    store.retry_many(tx, [Retrying(work, now, "stale")])
                else:
                    store.hand_many(tx, [Handing(work, result, now, 1, "stale")])

            store.run(body)
        COVERAGE["stale_" + how] += 1
        assert self.dump() == before
        assert dict(self.log.calls) == calls

    @precondition(lambda self: bool(self.items))
    @rule(data=st.data(), how=st.sampled_from(["one"] * 8 + ["unknown", "all", "all_before"]))
    def cancel(self, data: st.DataObject, how: str) -> None:
        if how == "unknown":
            assert self.pool.cancel(str(uuid.uuid4())) is False
            return
        if how == "one":
            running = sorted(self.of_state("running", "ended"), key=lambda i: i.wid)
            if running and data.draw(st.booleans(), label="a running one"):
                item = data.draw(st.sampled_from(running))
            else:
                item = data.draw(st.sampled_from(sorted(self.items.values(), key=lambda i: i.wid)))
            COVERAGE[f"cancel_{item.state}"] += 1
            changed = self.pool.cancel(item.wid)
            assert changed == self.cancel_in_model(item), (item, changed)
            return
        cutoff = self.now
        kwargs: dict[str, Any] = {}
        if how == "all_before":
            times = sorted({i.enqueued_at for i in self.items.values()})
            cutoff = kwargs["before"] = data.draw(st.sampled_from(times), label="before")
        expected = sum(
            self.cancel_in_model(item) for item in self.items.values() if item.enqueued_at <= cutoff
        )
        assert self.pool.cancel_all(**kwargs) == expected
        COVERAGE["cancel_all"] += 1

    def cancel_in_model(self, item: Item) -> bool:
        if item.state == "pending":
            item.canceled_pending = True
            item.result = Canceled()
            self.tally.count(Canceled())
            if item.handler_fails is None:
                item.state = "finished"
            else:  # the handler runs later, in a worker
                item.state = "completing"
                item.due_at = self.now
                item.handler_failures = 0
                item.last_error = "canceled"
                item.worker = None
            return True
        if item.state in ("running", "ended") and not item.cancel_requested:
            item.cancel_requested = True
            return True
        return False

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0, 16.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @rule(worker=st.sampled_from(LIVE_WORKERS), leave=st.sampled_from([False, False, True]))
    def worker_lease(self, worker: str, leave: bool) -> None:
        """Renew a worker's lease, or delete its row (normal exit: its work is lost at once)."""
        if leave:
            self.store.run(lambda tx: self.store.remove_worker(tx, worker))
            self.expires[worker] = -math.inf
        else:
            self.heartbeat(worker)

    def heartbeat(self, worker: str) -> None:
        now = self.now
        info = WorkerInfo(id=worker, host="model", pid=1, pools=[POOL])
        self.store.run(lambda tx: self.store.heartbeat(tx, info, now, now + LEASE))
        self.expires[worker] = now + LEASE

    @rule(what=st.sampled_from(["tick", "tick", "rescue", "handlers", "settle_handlers"]))
    def maintenance(self, what: str) -> None:
        """A maintenance tick (rescue, then due handler retries), or one of its halves.

        ``settle_handlers``: time passes with only handler retries happening, until
        every completing item has finished (at most 6 rounds).
        """
        now = self.now
        lost, due = self.store.run(
            lambda tx: self.store.maintenance_due(tx, [POOL], now), readonly=True
        )
        assert (lost, due) == (
            any(self.expires[i.worker or GHOST] <= now for i in self.of_state("running", "ended")),
            min((i.due_at for i in self.of_state("completing") if i.due_at <= now), default=None),
        )
        # Asked up to a later time: the earliest handler retry due by then.
        within = 1.5
        assert self.store.run(
            lambda tx: self.store.maintenance_due(tx, [POOL], now, lost=False, within=within),
            readonly=True,
        ) == (
            False,
            min(
                (i.due_at for i in self.of_state("completing") if i.due_at <= now + within),
                default=None,
            ),
        )
        if what in ("tick", "rescue"):
            self.rescue()
        if what in ("tick", "handlers"):
            self.retry_handlers()
        if what == "settle_handlers":
            for _ in range(6):
                completing = self.of_state("completing")
                if not completing:
                    break
                self.clock.now = max(self.now, min(i.due_at for i in completing))
                self.retry_handlers()

    def rescue(self) -> None:
        """Maintenance.rescue: running work whose worker's lease expired."""
        store, now = self.store, self.now

        def body(tx: workpool.Tx) -> list[str]:
            changes = Changes()
            lost = store.lost_work(tx, [POOL], now, 100)
            for work in lost:
                assert self.completion.rescue(tx, work, now, changes)
            changes.flush(store, tx, RESCUER, now)
            return [w.id for w in lost]

        rescued = store.run(body)
        expected = [
            i for i in self.of_state("running", "ended") if self.expires[i.worker or GHOST] <= now
        ]
        assert sorted(rescued) == sorted(i.wid for i in expected)
        for item in expected:
            COVERAGE[f"rescued_{item.kind}"] += 1
            if item.kind == "action":
                self.attempt_ended(item, ("raise", True), "worker lost")
            elif item.cancel_requested:  # the lost run never committed
                self.tally.count(Canceled())
                self.finish(item, Canceled())
            elif item.lost_count + 1 < MAX_LOST_RUNS:  # runs again, not a failed attempt
                item.lost_count += 1
                item.state = "pending"
                item.due_at = now
                item.last_error = "worker lost"
                item.worker = None
            else:
                error = f"worker lost {item.lost_count + 1} times"
                self.attempt_ended(item, ("raise", False), error)

    def retry_handlers(self) -> None:
        """Maintenance.retry_handlers: on_complete of completing work that is due."""
        store, now = self.store, self.now

        def body(tx: workpool.Tx) -> list[str]:
            changes = Changes()
            due = store.due_handlers(tx, [POOL], now, 100)
            for work in due:
                assert self.completion.retry_handler(tx, work, now, changes)
            changes.flush(store, tx, RESCUER, now)
            return [w.id for w in due]

        ran = store.run(body)
        expected = [i for i in self.of_state("completing") if i.due_at <= now]
        assert sorted(ran) == sorted(i.wid for i in expected)
        for item in expected:
            COVERAGE["handler_retry"] += 1
            self.run_handler(item)

    @rule(limit=st.integers(0, 3))
    def configure(self, limit: int) -> None:
        self.pool.configure(max_parallelism=limit)
        self.limit = limit
        if len(self.of_state("running")) > limit:
            self.over_limit_ok = True  # lowering the limit never stops running work

    # --- invariants -----------------------------------------------------------------------
    def expected_status(self, item: Item, running: int) -> workpool.Status:
        if item.state == "finished":
            return Finished(item.result, item.handler_error)
        if item.state in ("running", "ended"):
            return Running(item.attempt - 1, item.attempt, item.started_at)
        if item.state == "completing":
            return Running(item.attempt, item.attempt, item.started_at)
        if item.due_at > self.now:
            reason = "backoff" if item.attempt > 0 else "scheduled"
            return Pending(item.attempt, reason, item.due_at, item.last_error)
        if self.limit == 0:
            reason = "paused"
        elif running >= self.limit:
            reason = "waiting_for_slot"
        else:
            reason = "due"
        return Pending(item.attempt, reason, item.due_at, item.last_error, running, self.limit)

    @invariant()
    def statuses_match(self) -> None:
        if not hasattr(self, "pool"):
            return
        ids = sorted(self.items)
        unknown = str(uuid.uuid4())
        statuses = self.pool.status_batch([*ids, unknown])
        running = len(self.of_state("running"))
        for wid, status in zip(ids, statuses, strict=False):
            assert status == self.expected_status(self.items[wid], running), (
                self.items[wid],
                status,
            )
        assert statuses[-1] == Finished(None)

    @invariant()
    def parallelism_holds(self) -> None:
        if not hasattr(self, "pool"):
            return
        running = self.pool.stats().running
        assert running == len(self.of_state("running"))
        if running <= self.limit:
            self.over_limit_ok = False
        assert running <= self.limit or self.over_limit_ok

    @invariant()
    def on_complete_exactly_once(self) -> None:
        for wid, commits in self.log.commits.items():
            assert commits <= 1, f"on_complete of {wid} committed {commits} times"
        for item in self.items.values():
            want = int(
                item.state == "finished"
                and item.handler_fails is not None
                and item.handler_error is None
            )
            assert self.log.commits[item.wid] == want, (item, self.log.commits[item.wid])
            if want:
                assert self.log.results[item.wid] == item.result
            assert self.log.calls[item.wid] == self.log_calls.get(item.wid, 0)

    @invariant()
    def stats_match(self) -> None:
        if not hasattr(self, "pool"):
            return
        stats = self.pool.stats(window=BIG_WINDOW)
        pending = self.of_state("pending")
        assert (
            stats.max_parallelism,
            stats.running,
            stats.backlog,
            stats.scheduled,
            stats.completing,
            stats.finished,
        ) == (
            self.limit,
            len(self.of_state("running")),
            sum(i.due_at <= self.now for i in pending),
            sum(i.due_at > self.now for i in pending),
            len(self.of_state("completing", "ended")),
            len(self.of_state("finished")),
        )
        t = self.tally
        assert (stats.completed, stats.succeeded, stats.failed, stats.retries, stats.canceled) == (
            t.completed,
            t.succeeded,
            t.failed,
            t.retries,
            t.canceled,
        )


def test_state_machine_matches_the_model(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workpool.pool, "new_work_ids", next_work_ids)
    app = workpool.App(store_url)
    try:
        app.action(name="act")(act)
        app.mutation(name="mut")(mut)
        app.mutation(name="on_done")(on_done)
        WorkModel.app = app
        run_state_machine_as_test(
            WorkModel,
            settings=settings(
                # SQLite is cheap: most of the exploration happens there; PostgreSQL
                # runs the same model with fewer examples (~0.1 s per example).
                max_examples=150 if store_url.startswith("sqlite") else 50,
                stateful_step_count=50,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        app.close()


# --- core.decide, by hand and as a property ---------------------------------------------------

R3 = RetryBehavior(max_attempts=3, initial_backoff=0.25, base=2.0)


def test_decide_success_finishes_even_when_canceled() -> None:
    for cancel in (False, True):
        decision = decide(
            Succeeded(7), attempt=1, retry=R3, cancel_requested=cancel, now=100.0, rand=0.5
        )
        assert decision == Finish(Success(7))


def test_decide_retryable_failure_retries_with_exact_backoff() -> None:
    for attempt, wait in ((1, 0.25), (2, 0.5)):
        decision = decide(
            Raised("boom"), attempt=attempt, retry=R3, cancel_requested=False, now=100.0, rand=0.5
        )
        assert decision == RetryAt(100.0 + wait, "boom")


def test_decide_jitter_spans_half_to_one_and_a_half() -> None:
    low = decide(Raised("e"), attempt=2, retry=R3, cancel_requested=False, now=0.0, rand=0.0)
    high = decide(Raised("e"), attempt=2, retry=R3, cancel_requested=False, now=0.0, rand=0.999)
    assert isinstance(low, RetryAt) and isinstance(high, RetryAt)
    assert low.due_at == pytest.approx(0.25)
    assert high.due_at == pytest.approx(0.5 * 1.499)


def test_decide_last_attempt_fails_with_the_error() -> None:
    decision = decide(Raised("boom"), attempt=3, retry=R3, cancel_requested=False, now=1.0, rand=0)
    assert decision == Finish(Failed("boom"))


def test_decide_non_retryable_and_no_policy_fail_at_once() -> None:
    assert decide(
        Raised("stop", retryable=False),
        attempt=1,
        retry=R3,
        cancel_requested=False,
        now=1.0,
        rand=0.5,
    ) == Finish(Failed("stop"))
    assert decide(
        Raised("boom"), attempt=1, retry=None, cancel_requested=False, now=1.0, rand=0.5
    ) == Finish(Failed("boom"))


def test_decide_canceled_work_is_not_retried_but_keeps_a_final_failure() -> None:
    assert decide(
        Raised("boom"), attempt=1, retry=R3, cancel_requested=True, now=1.0, rand=0.5
    ) == Finish(Canceled())
    # A failure that would not have been retried anyway reports its real result.
    assert decide(
        Raised("boom"), attempt=3, retry=R3, cancel_requested=True, now=1.0, rand=0.5
    ) == Finish(Failed("boom"))
    assert decide(
        Raised("stop", retryable=False),
        attempt=1,
        retry=R3,
        cancel_requested=True,
        now=1.0,
        rand=0.5,
    ) == Finish(Failed("stop"))


def test_decide_caps_absurd_backoff_at_a_day() -> None:
    huge = RetryBehavior(max_attempts=100, initial_backoff=1000.0, base=10.0)
    decision = decide(
        Raised("e"), attempt=50, retry=huge, cancel_requested=False, now=0.0, rand=0.5
    )
    assert decision == RetryAt(86_400.0, "e")


@settings(max_examples=300, deadline=None)
@given(
    succeeded=st.booleans(),
    retryable=st.booleans(),
    attempt=st.integers(1, 12),
    retry=st.one_of(st.none(), RETRY_BEHAVIORS),
    cancel=st.booleans(),
    now=st.floats(0, 4e9, allow_nan=False),
    rand=st.floats(0, 1, exclude_max=True),
)
def test_decide_property(
    succeeded: bool,
    retryable: bool,
    attempt: int,
    retry: RetryBehavior | None,
    cancel: bool,
    now: float,
    rand: float,
) -> None:
    outcome = Succeeded("v") if succeeded else Raised("err", retryable)
    decision = decide(
        outcome, attempt=attempt, retry=retry, cancel_requested=cancel, now=now, rand=rand
    )
    if succeeded:
        assert decision == Finish(Success("v"))
        return
    retries_left = retryable and retry is not None and attempt < retry.max_attempts
    if not retries_left:
        assert decision == Finish(Failed("err"))
    elif cancel:
        assert decision == Finish(Canceled())
    else:
        assert isinstance(decision, RetryAt) and retry is not None
        assert decision.error == "err"
        nominal = min(retry.initial_backoff * retry.base ** (attempt - 1), 86_400.0)
        assert now + 0.5 * nominal - 1e-6 <= decision.due_at <= now + 1.5 * nominal + 1e-6


# --- core.states.TRANSITIONS, by name ---------------------------------------------------------

P, R, C, F = WorkState.PENDING, WorkState.RUNNING, WorkState.COMPLETING, WorkState.FINISHED
E = WorkState.ENDED

EXPECTED_TRANSITIONS = {
    "claim": ({P}, R),
    "end": ({R}, E),
    "retry": ({R, E}, P),
    "finish": ({R, E}, F),
    "finish_handler_failed": ({R, E}, C),
    "cancel_pending": ({P}, F),
    "cancel_pending_with_handler": ({P}, C),
    "rescue_retry": ({R, E}, P),
    "rescue_finish": ({R, E}, F),
    "rescue_handler_failed": ({R, E}, C),
    "finalize": ({C}, F),
    "finalize_failed": ({C}, C),
}


def test_transitions_are_the_documented_ones() -> None:
    assert {name: (set(src), dst) for name, (src, dst) in TRANSITIONS.items()} == (
        EXPECTED_TRANSITIONS
    )


@pytest.mark.parametrize("name", sorted(EXPECTED_TRANSITIONS))
def test_allowed_follows_the_table(name: str) -> None:
    sources, _ = EXPECTED_TRANSITIONS[name]
    for state in WorkState:
        assert allowed(name, state) == (state in sources)


def test_only_claim_starts_work() -> None:
    """The exact global limit rests on this: nothing but a claim adds a running row."""
    into_running = [name for name, (_, dst) in TRANSITIONS.items() if dst == R]
    assert into_running == ["claim"]


def test_finished_is_terminal_and_reachable_from_every_state() -> None:
    assert all(F not in sources for sources, _ in TRANSITIONS.values())
    reach = {F}
    changed = True
    while changed:
        changed = False
        for sources, dst in TRANSITIONS.values():
            if dst in reach and not sources <= reach:
                reach |= sources
                changed = True
    assert reach == set(WorkState)


def test_running_never_goes_back_to_pending_without_retry_or_rescue() -> None:
    back = {name for name, (src, dst) in TRANSITIONS.items() if R in src and dst == P}
    assert back == {"retry", "rescue_retry"}


def test_ended_leaves_only_as_running_does() -> None:
    """An ended attempt's outcome is recorded exactly as a running one's would be."""
    for name, (sources, _) in TRANSITIONS.items():
        if name != "end":
            assert (E in sources) == (R in sources), name


def test_unknown_transition_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        allowed("teleport", P)


@pytest.mark.parametrize("op", ["finish", "retry", "hand"])
def test_store_writes_on_a_finished_row_change_nothing(app, op: str) -> None:
    """A plain repro of the stale_store_write rule: CAS writes of a finished attempt."""
    app.action(name="act")(act)
    pool = app.pool("cas", max_parallelism=1)
    wid = pool.enqueue_action("act")
    store = app.store
    claimed = store.run(lambda tx: store.claim(tx, "cas", 1, "w", app.clock()))
    assert [c.id for c in claimed] == [wid]
    snapshot = store.run(lambda tx: store.load_for_update(tx, wid))
    assert snapshot is not None
    completion = Completion(store, app.registry, lambda p: "REPORT", rand=lambda: 0.5)

    def done(tx: workpool.Tx) -> None:
        changes = Changes()
        assert completion.complete(tx, snapshot, Succeeded(1), app.clock(), changes)
        changes.flush(store, tx, "w", app.clock())

    store.run(done)
    assert pool.status(wid) == Finished(Success(1))
    failed = '{"kind": "failed", "error": "late"}'

    def late(tx: workpool.Tx) -> None:
        if op == "finish":
            store.finish_many(tx, [Finishing(snapshot, "failed", failed)], app.clock())
        elif op == "retry":
            store.retry_many(tx, [Retrying(snapshot, app.clock(), "late")])
        else:
            store.hand_many(tx, [Handing(snapshot, failed, app.clock(), 1, "late")])

    store.run(late)
    assert pool.status(wid) == Finished(Success(1))
    assert pool.stats().finished == 1 and pool.stats().running == 0
