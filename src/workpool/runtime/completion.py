"""Finishing work: record an attempt's outcome, run on_complete, cancel, rescue lost work.

Every function here runs inside a store write transaction that the caller
owns, on rows the caller read under lock in that transaction (SQLite: the
write lock; PostgreSQL: ``FOR UPDATE``). Their state and attempt were checked
then, so the writes can be gathered in ``Changes`` and applied in a few
batched statements at the end; the store still writes them as compare-and-sets.
"""

from __future__ import annotations

import json
import logging
import random
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from workpool.core import histogram
from workpool.core.decide import (
    HANDLER_RETRY,
    AttemptOutcome,
    Raised,
    RetryAt,
    Succeeded,
    decide,
)
from workpool.core.errors import describe_error
from workpool.core.results import (
    Canceled,
    Failed,
    Result,
    Success,
    result_from_json,
    result_to_json,
    success_json,
)
from workpool.core.states import RECORDABLE
from workpool.observability import events
from workpool.runtime.registry import Registry
from workpool.store.base import (
    ActiveWork,
    ClaimedWork,
    Counters,
    Finishing,
    Handing,
    Retrying,
    Store,
    Tx,
    minute_of,
)

# A mutation or query whose worker vanished never committed and runs again; after
# this many lost runs in a row it is failed, so one poisoned item cannot loop forever.
MAX_LOST_RUNS = 5
WORKER_LOST = "worker lost"
CORRUPT_CONTEXT = "stored context is corrupt"


class HandlerRaised(Exception):
    """An on_complete raised during an optimistic batch: redo it with savepoints.

    ``work_id`` is None when the error cannot be pinned on one handler: a database
    error inside a pipeline may belong to an earlier statement than the one read.
    """

    def __init__(self, work_id: str | None, error: str, trace: str) -> None:
        super().__init__(error)
        self.work_id = work_id
        self.error = error
        self.trace = trace


@dataclass
class Changes:
    """State changes and counters gathered in one transaction, written at its end."""

    finished: list[Finishing] = field(default_factory=list)
    retried: list[Retrying] = field(default_factory=list)
    handed: list[Handing] = field(default_factory=list)
    tallies: dict[str, Tally] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)
    direct: dict[str, int] = field(default_factory=dict)  # rows finished directly, per pool
    # Optimistic: handlers run without a savepoint each (two round trips saved per
    # item on PostgreSQL); the first one that raises aborts the whole transaction
    # with HandlerRaised and the caller redoes the batch with savepoints.
    optimistic: bool = False
    # Handler failures already seen in an aborted optimistic pass: recorded as such
    # without calling the handler again, so each failure is one try.
    known_failures: dict[str, tuple[str, str]] = field(default_factory=dict)

    def claim(self, work: ActiveWork) -> bool:
        """True the first time ``work`` is changed in this transaction."""
        if work.id in self.touched:
            return False
        self.touched.add(work.id)
        return True

    def tally(self, pool: str) -> Tally:
        tally = self.tallies.get(pool)
        if tally is None:
            tally = self.tallies[pool] = Tally()
        return tally

    def freed(self) -> dict[str, int]:
        """Rows per pool that leave ``running`` (or ``pending``) in this transaction;
        an ``ended`` row gave its slot up before."""
        freed = dict(self.direct)
        works = [f.work for f in self.finished] + [r.work for r in self.retried]
        for work in works + [h.work for h in self.handed]:
            if work.state != "ended":
                freed[work.pool] = freed.get(work.pool, 0) + 1
        return freed

    def requeued(self) -> set[str]:
        """Pools that get pending (retry) or handler work in this transaction."""
        return {r.work.pool for r in self.retried} | {h.work.pool for h in self.handed}

    def flush(
        self,
        store: Store,
        tx: Tx,
        worker_id: str,
        now: float,
        *,
        wake: bool = True,
        rows: bool = True,
    ) -> None:
        """Write the gathered changes; ``wake=False``: the caller notifies (see the
        completer, which first claims for the freed slots itself); ``rows=False``:
        the caller has written the rows with ``write_rows``."""
        if wake:
            # Freed slots, retries and handler work concern the other workers too:
            # wake them at commit (PostgreSQL NOTIFY; SQLite workers see any commit).
            woken = set(self.freed()) | self.requeued()
            if woken:
                store.notify(tx, sorted(woken))
        if rows:
            self.write_rows(store, tx, now)
        bucket = minute_of(now)
        for pool, tally in self.tallies.items():
            store.add_counters(tx, pool, worker_id, bucket, tally.counters())
        self.finished, self.retried, self.handed = [], [], []
        self.tallies, self.touched, self.direct = {}, set(), {}

    def write_rows(self, store: Store, tx: Tx, now: float, *, at_commit: bool = False) -> None:
        """The gathered state changes (finishes, retries, handler hand-offs);
        ``at_commit``: nothing in ``tx`` reads these rows again (``Tx.defer``)."""
        store.finish_many(tx, self.finished, now, at_commit=at_commit)
        store.retry_many(tx, self.retried, at_commit=at_commit)
        store.hand_many(tx, self.handed, at_commit=at_commit)


def _success_json(outcome: Succeeded) -> str:
    """The stored result of a success, without encoding the value a second time."""
    if outcome.encoded is None:
        return result_to_json(Success(outcome.value))
    return success_json(outcome.encoded)


class Tally:
    """One pool's counters in one transaction, summed in place: this runs per attempt."""

    __slots__ = ("ended", "hist", "lag_count", "lag_max", "lag_sum")

    def __init__(self) -> None:
        self.ended = {"success": 0, "failed": 0, "canceled": 0, "retry": 0}
        self.lag_count = 0
        self.lag_sum = 0.0
        self.lag_max = 0.0
        self.hist = [0] * len(histogram.LAG_BOUNDS)

    def end(self, kind: str, count: int = 1) -> None:
        """Attempts ended: ``success``, ``failed``, ``canceled`` or ``retry``."""
        self.ended[kind] += count

    def lags(self, seconds: list[float]) -> None:
        """The start lags of attempts that ended."""
        if not seconds:
            return
        self.lag_count += len(seconds)
        self.lag_sum += sum(seconds)
        self.lag_max = max(self.lag_max, *seconds)
        hist, bucket = self.hist, histogram.bucket
        for value in seconds:
            hist[bucket(value)] += 1

    def counters(self) -> Counters:
        ended = self.ended
        return Counters(
            completed=sum(ended.values()),
            succeeded=ended["success"],
            failed=ended["failed"],
            retries=ended["retry"],
            canceled=ended["canceled"],
            lag_count=self.lag_count,
            lag_sum=self.lag_sum,
            lag_max=self.lag_max,
            lag_hist=tuple(self.hist),
        )


class Completion:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        pool_level: Callable[[str], str],
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.store = store
        self.registry = registry
        self.pool_level = pool_level
        self.rand = rand

    def complete(
        self,
        tx: Tx,
        work: ActiveWork,
        outcome: AttemptOutcome,
        now: float,
        changes: Changes,
        duration: float | None = None,
    ) -> bool:
        """Record the end of ``work``'s current attempt; False if it was stale."""
        if work.state not in RECORDABLE or not changes.claim(work):
            return False
        decision = decide(
            outcome,
            attempt=work.attempt,
            retry=work.retry,
            cancel_requested=work.cancel_requested,
            now=now,
            rand=self.rand(),
        )
        level = self.pool_level(work.pool)
        tally = changes.tally(work.pool)
        if work.started_at is not None:
            tally.lags([max(work.started_at - work.due_at, 0.0)])
        # isinstance, not match: class patterns cost a few microseconds per item here.
        if isinstance(decision, RetryAt):
            changes.retried.append(Retrying(work, decision.due_at, decision.error))
            tally.end("retry")
            status = "retrying"
            error_text: str | None = decision.error
        else:
            result = decision.result
            encoded = _success_json(outcome) if type(outcome) is Succeeded else None
            self._finish(tx, work, result, now, changes, encoded)
            tally.end(result.kind)
            status = result.kind
            error_text = result.error if isinstance(result, Failed) else None
        events.completed(
            level,
            pool=work.pool,
            work_id=work.id,
            fn_name=work.fn_name,
            status=status,
            attempts=work.attempt,
            duration=duration,
            error=error_text,
        )
        return True

    def finish_succeeded(
        self,
        tx: Tx,
        batch: Sequence[tuple[ClaimedWork, Succeeded, float]],
        now: float,
        changes: Changes,
        worker_id: str,
    ) -> Callable[[], None]:
        """Actions that returned a value, with their durations; their on_complete
        handlers run here too while the pass is optimistic (``Changes.optimistic``).

        Whatever the row holds (retry policy, cancel flag), success finishes the
        work, so it is finished by a compare-and-set on (state, attempt) without
        reading the rows first; the store counts the ones that took. Without
        handlers that waits for the COMMIT. With them it runs at once: the rows it
        took are the attempts still current, now locked by it, and only their
        handlers run, with the name and context their claim read. Their slots count
        as freed in ``changes`` (a stale one frees none: at worst a needless
        wake-up). Calling the result, after the COMMIT, logs the ones that took.
        """
        # Sorted: rows are locked in one global order, as everywhere else.
        items = sorted(
            (
                w.id,
                w.attempt,
                _success_json(o),
                w.pool,
                max(w.started_at - w.due_at, 0.0),
                w.place,
                w.state,
            )
            for w, o, _ in batch
        )
        handled = any(w.on_complete is not None for w, _, _ in batch)
        finished = self.store.finish_succeeded(tx, items, now, worker_id, at_commit=not handled)
        held = Counter(work.pool for work, _, _ in batch if work.state != "ended")
        for pool, count in held.items():
            changes.direct[pool] = changes.direct.get(pool, 0) + count
        if handled:
            taken = set(finished())
            for work, outcome, _ in batch:
                if work.on_complete is not None and (work.id, work.attempt) in taken:
                    self._run_handler(
                        tx,
                        work.id,
                        work.on_complete,
                        work.context,
                        Success(outcome.value),
                        optimistic=True,
                    )
        return lambda: self._log_succeeded(batch, finished)

    def _log_succeeded(
        self,
        batch: Sequence[tuple[ClaimedWork, Succeeded, float]],
        finished: Callable[[], list[tuple[str, int]]],
    ) -> None:
        # Once per pool, not per attempt: whether its log level shows completions.
        shown = {
            pool
            for pool in {work.pool for work, _, _ in batch}
            if events.shown(logging.INFO, self.pool_level(pool))
        }
        if not shown:
            return
        done = set(finished())  # the others were stale: rescued, or canceled elsewhere
        for work, _, duration in batch:
            if work.pool in shown and (work.id, work.attempt) in done:
                events.completed(
                    self.pool_level(work.pool),
                    pool=work.pool,
                    work_id=work.id,
                    fn_name=work.fn_name,
                    status="success",
                    attempts=work.attempt,
                    duration=duration,
                )

    def _finish(
        self,
        tx: Tx,
        work: ActiveWork,
        result: Result,
        now: float,
        changes: Changes,
        result_json: str | None = None,
    ) -> None:
        """Run on_complete (if any) and record ``work`` finished with ``result``
        (``result_json``: its JSON, when the caller has it already).

        A raising handler rolls back to its savepoint and hands the work to a
        later handler retry; the result itself is fixed from here on.
        """
        if result_json is None:
            result_json = result_to_json(result)
        if work.on_complete is None:
            changes.finished.append(Finishing(work, result.kind, result_json))
            return
        error = changes.known_failures.get(work.id) or self._run_handler(
            tx, work.id, work.on_complete, work.context, result, changes.optimistic
        )
        if error is None:
            changes.finished.append(Finishing(work, result.kind, result_json))
            return
        failures = work.handler_failures + 1
        # A context that is not JSON will never decode: no point in retrying.
        final = failures >= HANDLER_RETRY.max_attempts or error[0].startswith(CORRUPT_CONTEXT)
        events.handler_failed(
            self.pool_level(work.pool),
            pool=work.pool,
            work_id=work.id,
            handler=work.on_complete,
            failures=failures,
            error=error[0],
            traceback=error[1],
            final=final,
        )
        if final:
            changes.finished.append(
                Finishing(work, result.kind, result_json, handler_error=error[0])
            )
            return
        due_at = now + HANDLER_RETRY.delay(failures, self.rand())
        changes.handed.append(Handing(work, result_json, due_at, failures, error[0]))

    def _run_handler(
        self,
        tx: Tx,
        work_id: str,
        on_complete: str | None,
        stored_context: str | None,
        result: Result,
        optimistic: bool,
    ) -> tuple[str, str] | None:
        """Call on_complete in a savepoint; the error and traceback if it raised."""
        assert on_complete is not None
        spec = self.registry.get(on_complete)
        if spec is None or spec.kind != "mutation":
            text = f"on_complete {on_complete!r} is not a mutation registered in this App"
            if optimistic:
                raise HandlerRaised(work_id, text, "")
            return text, ""
        try:
            # "null" is what an enqueue without a context stores: skip the parser.
            context = None if stored_context in (None, "null") else json.loads(stored_context)
        except (ValueError, RecursionError) as exc:
            text = f"{CORRUPT_CONTEXT}: {describe_error(exc)}"
            if optimistic:
                raise HandlerRaised(work_id, text, "") from exc
            return text, ""
        try:
            if optimistic:
                spec.fn(tx, work_id=work_id, context=context, result=result)
            else:
                with self.store.savepoint(tx):
                    spec.fn(tx, work_id=work_id, context=context, result=result)
        except Exception as exc:
            if self.store.is_transient(exc):
                raise  # the whole transaction is retried
            if optimistic:
                # The redo runs each handler in its own savepoint, so it finds out
                # whose a pipelined database error was.
                blamed = None if tx.pipelined and self.from_database(exc) else work_id
                raise HandlerRaised(blamed, describe_error(exc), traceback.format_exc()) from exc
            return describe_error(exc), traceback.format_exc()
        return None

    def from_database(self, exc: BaseException) -> bool:
        """Whether ``exc`` is, or was raised while handling, a database error."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            if self.store.is_database_error(current):
                return True
            seen.add(id(current))
            current = current.__cause__ or current.__context__
        return False

    def retry_handler(self, tx: Tx, work: ActiveWork, now: float, changes: Changes) -> bool:
        """A later try of the on_complete of ``completing`` work."""
        if work.state != "completing" or work.result is None or not changes.claim(work):
            return False
        self._finish(tx, work, result_from_json(work.result), now, changes)
        return True

    def cancel(self, tx: Tx, work: ActiveWork, now: float, changes: Changes) -> bool:
        """Cancel: pending work never starts; running work is not retried."""
        match work.state:
            case "pending" if changes.claim(work):
                changes.tally(work.pool).end("canceled")
                events.completed(
                    self.pool_level(work.pool),
                    pool=work.pool,
                    work_id=work.id,
                    fn_name=work.fn_name,
                    status="canceled",
                    attempts=work.attempt,
                    duration=None,
                )
                result = result_to_json(Canceled())
                if work.on_complete is None:
                    changes.finished.append(Finishing(work, "canceled", result))
                else:
                    # The handler runs in a worker, which has it registered; the caller may not.
                    changes.handed.append(Handing(work, result, now, 0, "canceled"))
                return True
            case "running" | "ended" if not work.cancel_requested:
                return self.store.flag_cancel(tx, work)
        return False

    def rescue(
        self, tx: Tx, work: ActiveWork, now: float, changes: Changes, *, never_ran: bool = False
    ) -> bool:
        """Work whose worker vanished: a failed attempt (actions) or a re-run (mutations).

        ``never_ran``: a live worker found its own claim that it never started (the
        claim committed but the connection died before the worker heard of it); that
        attempt goes back to pending like a lost mutation, without counting as failed.
        """
        events.worker_event(
            "work_lost",
            30,
            pool=work.pool,
            work_id=work.id,
            fn_name=work.fn_name,
            attempt=work.attempt,
            worker_id=work.worker_id,
            never_ran=never_ran,
        )
        if work.kind == "action" and not never_ran:
            return self.complete(tx, work, Raised(WORKER_LOST), now, changes)
        if work.cancel_requested:  # the lost run never committed: nothing ran
            if not changes.claim(work):
                return False
            changes.tally(work.pool).end("canceled")
            self._finish(tx, work, Canceled(), now, changes)
            return True
        if work.lost_count + 1 < MAX_LOST_RUNS:
            if not changes.claim(work):
                return False
            changes.retried.append(Retrying(work, now, WORKER_LOST, lost=True))
            return True
        lost = Raised(f"{WORKER_LOST} {work.lost_count + 1} times", retryable=False)
        return self.complete(tx, work, lost, now, changes)
