"""Finishing work: record an attempt's outcome, run on_complete, cancel, rescue lost work.

Every function here runs inside a store write transaction that the caller
owns, on a row the caller read with ``load_for_update`` (or a locked batch
read), so the compare-and-set in the store makes stale calls do nothing.
"""

from __future__ import annotations

import json
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from workpool.core.decide import HANDLER_RETRY, AttemptOutcome, Finish, Raised, RetryAt, decide
from workpool.core.errors import describe_error
from workpool.core.results import Canceled, Failed, Result, result_from_json, result_to_json
from workpool.observability import events
from workpool.runtime.registry import Registry
from workpool.store.base import ActiveWork, Counters, Store, Tx

# A mutation or query whose worker vanished never committed and runs again; after
# this many lost runs in a row it is failed, so one poisoned item cannot loop forever.
MAX_LOST_RUNS = 5
WORKER_LOST = "worker lost"


@dataclass
class Tally:
    """Counters gathered inside one transaction, written with it (per pool, per worker)."""

    by_pool: dict[str, Counters] = field(default_factory=dict)

    def add(self, pool: str, counters: Counters) -> None:
        self.by_pool[pool] = self.by_pool.get(pool, Counters()) + counters

    def flush(self, store: Store, tx: Tx, worker_id: str, now: float) -> None:
        bucket = int(now // 60)
        for pool, counters in self.by_pool.items():
            store.add_counters(tx, pool, worker_id, bucket, counters)
        self.by_pool.clear()


def _counted(result: Result) -> Counters:
    match result.kind:
        case "success":
            return Counters(completed=1, succeeded=1)
        case "failed":
            return Counters(completed=1, failed=1)
        case _:
            return Counters(completed=1, canceled=1)


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
        tally: Tally,
        duration: float | None = None,
    ) -> bool:
        """Record the end of ``work``'s current attempt; False if it was stale."""
        if work.state != "running":
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
        if work.started_at is not None:
            lag = max(work.started_at - work.due_at, 0.0)
            tally.add(work.pool, Counters(lag_count=1, lag_sum=lag, lag_max=lag))
        match decision:
            case RetryAt(due_at, error):
                if not self.store.retry(tx, work, due_at, error):
                    return False
                tally.add(work.pool, Counters(completed=1, retries=1))
                events.completed(
                    level,
                    pool=work.pool,
                    work_id=work.id,
                    fn_name=work.fn_name,
                    status="retrying",
                    attempts=work.attempt,
                    duration=duration,
                    error=error,
                )
                return True
            case Finish(result):
                if not self.finish(tx, work, result, now):
                    return False
                tally.add(work.pool, _counted(result))
                events.completed(
                    level,
                    pool=work.pool,
                    work_id=work.id,
                    fn_name=work.fn_name,
                    status=result.kind,
                    attempts=work.attempt,
                    duration=duration,
                    error=result.error if isinstance(result, Failed) else None,
                )
                return True
        return False

    def finish(self, tx: Tx, work: ActiveWork, result: Result, now: float) -> bool:
        """Run on_complete (if any) and record ``work`` finished with ``result``.

        A raising handler rolls back to its savepoint and hands the work to a
        later handler retry; the result itself is fixed from here on.
        """
        result_json = result_to_json(result)
        if work.on_complete is None:
            return self.store.finish(tx, work, result_json, now)
        error = self._run_handler(tx, work, result)
        if error is None:
            return self.store.finish(tx, work, result_json, now)
        failures = work.handler_failures + 1
        final = failures >= HANDLER_RETRY.max_attempts
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
            return self.store.finish(tx, work, result_json, now, handler_error=error[0])
        due_at = now + HANDLER_RETRY.delay(failures, self.rand())
        return self.store.hand_to_handler(tx, work, result_json, due_at, failures, error[0])

    def _run_handler(self, tx: Tx, work: ActiveWork, result: Result) -> tuple[str, str] | None:
        """Call on_complete in a savepoint; the error and traceback if it raised."""
        assert work.on_complete is not None
        spec = self.registry.get(work.on_complete)
        if spec is None or spec.kind != "mutation":
            text = f"on_complete {work.on_complete!r} is not a mutation registered in this App"
            return text, ""
        context = None if work.context is None else json.loads(work.context)
        try:
            with self.store.savepoint(tx):
                spec.fn(tx, work_id=work.id, context=context, result=result)
        except Exception as exc:
            return describe_error(exc), traceback.format_exc()
        return None

    def retry_handler(self, tx: Tx, work: ActiveWork, now: float) -> bool:
        """A later try of the on_complete of ``completing`` work."""
        if work.state != "completing" or work.result is None:
            return False
        return self.finish(tx, work, result_from_json(work.result), now)

    def cancel(self, tx: Tx, work: ActiveWork, now: float, tally: Tally) -> bool:
        """Cancel: pending work never starts; running work is not retried."""
        match work.state:
            case "pending":
                tally.add(work.pool, _counted(Canceled()))
                events.completed(
                    self.pool_level(work.pool),
                    pool=work.pool,
                    work_id=work.id,
                    fn_name=work.fn_name,
                    status="canceled",
                    attempts=work.attempt,
                    duration=None,
                )
                if work.on_complete is None:
                    return self.store.finish(tx, work, result_to_json(Canceled()), now)
                # The handler runs in a worker, which has it registered; the caller may not.
                return self.store.hand_to_handler(
                    tx, work, result_to_json(Canceled()), now, 0, "canceled"
                )
            case "running" if not work.cancel_requested:
                return self.store.flag_cancel(tx, work)
        return False

    def rescue(self, tx: Tx, work: ActiveWork, now: float, tally: Tally) -> bool:
        """Work whose worker vanished: a failed attempt (actions) or a re-run (mutations)."""
        events.worker_event(
            "work_lost",
            30,
            pool=work.pool,
            work_id=work.id,
            fn_name=work.fn_name,
            attempt=work.attempt,
            worker_id=work.worker_id,
        )
        if work.kind == "action":
            return self.complete(tx, work, Raised(WORKER_LOST), now, tally)
        if work.cancel_requested:  # the lost run never committed: nothing ran
            tally.add(work.pool, _counted(Canceled()))
            return self.finish(tx, work, Canceled(), now)
        if work.lost_count + 1 < MAX_LOST_RUNS:
            return self.store.retry(tx, work, now, WORKER_LOST, lost=True)
        return self.complete(
            tx,
            work,
            Raised(f"{WORKER_LOST} {work.lost_count + 1} times", retryable=False),
            now,
            tally,
        )
