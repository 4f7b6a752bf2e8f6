"""Pool: the client calls on one named pool (enqueue, status, cancel, configure, stats)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, ParamSpec, TypeVar

from workpool.core.errors import InvalidArgumentError, InvalidTypeError, show
from workpool.core.ids import new_work_ids
from workpool.core.results import (
    Finished,
    Pending,
    PendingReason,
    Running,
    Status,
    WorkInfo,
    result_from_json,
)
from workpool.core.retry import DEFAULT_RETRY, RetryBehavior, resolve_retry
from workpool.core.states import RECORDABLE
from workpool.core.validation import (
    check_args,
    check_int,
    check_log_level,
    check_max_parallelism,
    check_seconds,
    check_timeout,
    encode_json,
    resolve_due_at,
)
from workpool.observability import events
from workpool.observability.stats import PoolStats, counters_stats, pool_stats
from workpool.runtime.completion import Changes
from workpool.store.base import (
    Counters,
    FnKind,
    NewBatch,
    PoolConfig,
    StatusRow,
    Tx,
    WouldWait,
)

if TYPE_CHECKING:
    from workpool.app import App

P = ParamSpec("P")
R = TypeVar("R")
# Items canceled per transaction by cancel_all. Convex's 64 is bounded by its
# transaction limits; ours only by how long a page holds the write lock (SQLite) and
# its rows (PostgreSQL, whose claims skip them). A page costs PostgreSQL some 3.5 ms
# however small (its round trips and commit): cancel_all of 200,000 pending took
# 16.0 s in pages of 64 and 7.0 s in pages of 512 (SQLite 4.2 -> 3.2 s; one page
# holds SQLite's write lock about 8 ms).
CANCEL_PAGE = 512
# Rows of a batch enqueue built and inserted at a time, in its one transaction: a
# batch of 1M held all its rows, statements and parameters at once (0.6-0.8 GB on
# top of the caller's own list).
ENQUEUE_CHUNK = 10_000
# Rows a statement of a streamed batch holds (see Store.streams_inserts): the server
# inserts one while the next is checked and built.
STREAM_CHUNK = 250
# Enqueues of up to this many items, each in a transaction of its own, share one
# with other threads' that come at the same time (see Combiner): a bigger batch
# already spreads its commit over its items and would make the others wait.
COMBINE_MAX_ITEMS = 100
CLIENT_ID = "client"  # worker id under which client-side cancels are counted


def _async_twin(
    fn: Callable[Concatenate[Pool, P], R],
) -> Callable[Concatenate[Pool, P], Awaitable[R]]:
    """The ``_async`` twin of a client method: the same code on a worker thread."""

    async def twin(self: Pool, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, self, *args, **kwargs)

    twin.__name__ = f"{fn.__name__}_async"
    twin.__doc__ = f"Async twin of :meth:`Pool.{fn.__name__}`."
    return twin


def check_pool_options(
    max_parallelism: object = None,
    retry_actions_by_default: object = None,
    default_retry: object = None,
    log_level: object = None,
    status_ttl: object = None,
) -> dict[str, Any]:
    """Validate pool options; the ones given, ready to overlay a PoolConfig."""
    options: dict[str, Any] = {}
    if max_parallelism is not None:
        options["max_parallelism"] = check_max_parallelism(max_parallelism)
    if retry_actions_by_default is not None:
        if not isinstance(retry_actions_by_default, bool):
            raise InvalidTypeError(
                f"retry_actions_by_default must be a bool, got {show(retry_actions_by_default)}"
            )
        options["retry_actions_by_default"] = retry_actions_by_default
    if default_retry is not None:
        if not isinstance(default_retry, RetryBehavior):
            raise InvalidTypeError(
                f"default_retry must be a RetryBehavior, got {show(default_retry)}"
            )
        options["default_retry"] = default_retry
    if log_level is not None:
        options["log_level"] = check_log_level(log_level)
    if status_ttl is not None:
        options["status_ttl"] = check_seconds(status_ttl, "status_ttl")
    return options


class Pool:
    """A named pool. Options given to ``app.pool`` overwrite the stored config on first use."""

    def __init__(self, app: App, name: str, options: dict[str, Any]) -> None:
        self.app = app
        self.name = name
        self._options = options
        self._applied = not options
        # The stored config as this Pool last read or wrote it: an enqueue made with
        # it checks it in the insert instead of reading it first (PostgreSQL: one
        # round trip instead of two). A stale one costs a second transaction only.
        self._known: PoolConfig | None = None

    # --- config ---------------------------------------------------------------------------
    def _config(self, tx: Tx) -> PoolConfig:
        store = self.app.store
        stored = store.load_pool(tx, self.name)
        if not self._applied or stored is None:
            wanted = self._overlay(stored or PoolConfig(self.name))
            if wanted != stored:
                store.save_pool(tx, wanted)
            tx.after_commit.append(self._mark_applied)
            return wanted
        return stored

    def _overlay(self, stored: PoolConfig) -> PoolConfig:
        """``stored`` with this Pool's options; a run-time pause outlives a declared limit.

        A worker restarting with ``app.pool("x", max_parallelism=10)`` must not undo
        an operator's ``pause()``: the declared limit becomes the one ``resume()``
        restores.
        """
        wanted = PoolConfig(**{**_fields(stored), **self._options})
        if stored.paused_from is not None and wanted.max_parallelism > 0:
            wanted = replace(wanted, max_parallelism=0, paused_from=wanted.max_parallelism)
        return wanted

    def _view(self, tx: Tx) -> PoolConfig:
        """The config as it is or will be once this Pool's options apply; writes nothing."""
        stored = self.app.store.load_pool(tx, self.name) or PoolConfig(self.name)
        return stored if self._applied else self._overlay(stored)

    def _mark_applied(self) -> None:
        self._applied = True

    def configure(self, /, **options: Any) -> PoolConfig:
        """Change the stored config at run time (``max_parallelism=0`` pauses everywhere)."""
        unknown = set(options) - {
            "max_parallelism",
            "retry_actions_by_default",
            "default_retry",
            "log_level",
            "status_ttl",
        }
        if unknown:
            raise InvalidTypeError(f"configure() got unknown options: {', '.join(sorted(unknown))}")
        given = check_pool_options(**options)

        def body(tx: Tx) -> PoolConfig:
            current = self._config(tx)
            config = PoolConfig(**{**_fields(current), **given})
            if config.max_parallelism == 0 and current.max_parallelism > 0:
                config = replace(config, paused_from=current.max_parallelism)
            elif config.max_parallelism > 0:
                config = replace(config, paused_from=None)
            self.app.store.save_pool(tx, config)
            self.app.store.notify(tx, [self.name])
            return config

        self._known = config = self.app.run(body)
        return config

    def pause(self) -> PoolConfig:
        """Stop starting work everywhere (running work finishes); same as max_parallelism=0."""
        return self.configure(max_parallelism=0)

    def resume(self) -> PoolConfig:
        """Undo ``pause``: restore the limit the pool had before it was paused."""

        def body(tx: Tx) -> int:
            config = self._config(tx)
            if config.max_parallelism > 0:
                return config.max_parallelism
            return config.paused_from or PoolConfig(self.name).max_parallelism

        return self.configure(max_parallelism=self.app.run(body))

    def history(self, minutes: int = 60) -> list[tuple[float, PoolStats]]:
        """Per-minute completions of the last ``minutes``: (minute start, counters as stats)."""
        check_int(minutes, "minutes", 1, 1440)
        store = self.app.store

        def body(tx: Tx) -> list[tuple[float, PoolStats]]:
            config = self._view(tx)
            now = self.app.clock()
            first = int(now // 60) - minutes + 1
            rows = dict(store.history(tx, self.name, first))
            return [
                (bucket * 60.0, counters_stats(config, rows.get(bucket, Counters()), 60.0))
                for bucket in range(first, first + minutes)
            ]

        return self.app.run(body, readonly=True)

    def recent_failures(self, limit: int = 20) -> list[WorkInfo]:
        """The newest finished items of this pool whose result is Failed."""
        check_int(limit, "limit", 1, 1000)
        return self.app.run(
            lambda tx: self.app.store.recent_failures(tx, self.name, limit), readonly=True
        )

    def stats(self, window: float = 60.0) -> PoolStats:
        """Live numbers: backlog, running, limit, and completions over ``window`` seconds."""
        window = check_seconds(window, "window", minimum=1.0)
        store = self.app.store

        def body(tx: Tx) -> PoolStats:
            return pool_stats(store, tx, self._view(tx), self.app.clock(), window)

        return self.app.run(body, readonly=True)

    # --- enqueue --------------------------------------------------------------------------
    def enqueue_action(
        self,
        fn: Callable[..., Any] | str,
        args: dict[str, Any] | None = None,
        *,
        retry: bool | RetryBehavior | None = None,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        timeout: float | None = None,
        tx: Any = None,
    ) -> str:
        """Enqueue one action; returns its work id."""
        return self._enqueue(
            "action", fn, [args], retry, on_complete, context, run_at, run_after, timeout, tx
        )[0]

    def enqueue_action_batch(
        self,
        fn: Callable[..., Any] | str,
        args_list: Sequence[dict[str, Any]],
        *,
        retry: bool | RetryBehavior | None = None,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        timeout: float | None = None,
        tx: Any = None,
    ) -> list[str]:
        """Enqueue one action per args dict, atomically; ids in input order."""
        return self._enqueue(
            "action",
            fn,
            _as_list(args_list),
            retry,
            on_complete,
            context,
            run_at,
            run_after,
            timeout,
            tx,
        )

    def enqueue_mutation(
        self,
        fn: Callable[..., Any] | str,
        args: dict[str, Any] | None = None,
        *,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        tx: Any = None,
    ) -> str:
        """Enqueue one mutation: it runs exactly once in effect, inside the store transaction."""
        return self._enqueue(
            "mutation", fn, [args], None, on_complete, context, run_at, run_after, None, tx
        )[0]

    def enqueue_mutation_batch(
        self,
        fn: Callable[..., Any] | str,
        args_list: Sequence[dict[str, Any]],
        *,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        tx: Any = None,
    ) -> list[str]:
        return self._enqueue(
            "mutation",
            fn,
            _as_list(args_list),
            None,
            on_complete,
            context,
            run_at,
            run_after,
            None,
            tx,
        )

    def enqueue_query(
        self,
        fn: Callable[..., Any] | str,
        args: dict[str, Any] | None = None,
        *,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        tx: Any = None,
    ) -> str:
        """Enqueue one query; its return value goes to on_complete."""
        return self._enqueue(
            "query", fn, [args], None, on_complete, context, run_at, run_after, None, tx
        )[0]

    # The single enqueues' twins are written out: they may run on the event loop
    # itself (_enqueue_async), where the other twins always go to a thread.
    async def enqueue_action_async(
        self,
        fn: Callable[..., Any] | str,
        args: dict[str, Any] | None = None,
        *,
        retry: bool | RetryBehavior | None = None,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        timeout: float | None = None,
        tx: Any = None,
    ) -> str:
        """Async twin of :meth:`Pool.enqueue_action`."""
        return await self._enqueue_async(
            "action", fn, args, on_complete, context, run_at, run_after, retry, timeout, tx
        )

    async def enqueue_mutation_async(
        self,
        fn: Callable[..., Any] | str,
        args: dict[str, Any] | None = None,
        *,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        tx: Any = None,
    ) -> str:
        """Async twin of :meth:`Pool.enqueue_mutation`."""
        return await self._enqueue_async(
            "mutation", fn, args, on_complete, context, run_at, run_after, tx=tx
        )

    async def enqueue_query_async(
        self,
        fn: Callable[..., Any] | str,
        args: dict[str, Any] | None = None,
        *,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        tx: Any = None,
    ) -> str:
        """Async twin of :meth:`Pool.enqueue_query`."""
        return await self._enqueue_async(
            "query", fn, args, on_complete, context, run_at, run_after, tx=tx
        )

    def enqueue_query_batch(
        self,
        fn: Callable[..., Any] | str,
        args_list: Sequence[dict[str, Any]],
        *,
        on_complete: Callable[..., Any] | str | None = None,
        context: Any = None,
        run_at: datetime | float | None = None,
        run_after: float | None = None,
        tx: Any = None,
    ) -> list[str]:
        return self._enqueue(
            "query",
            fn,
            _as_list(args_list),
            None,
            on_complete,
            context,
            run_at,
            run_after,
            None,
            tx,
        )

    def _enqueue(
        self,
        kind: FnKind,
        fn: object,
        args_list: list[Any],
        retry: object,
        on_complete: object,
        context: object,
        run_at: object,
        run_after: object,
        timeout: object,
        tx: object,
    ) -> list[str]:
        job = self._prepare(
            kind, fn, args_list, retry, on_complete, context, run_at, run_after, timeout, tx
        )
        return job.done(job.run())

    async def _enqueue_async(
        self,
        kind: FnKind,
        fn: object,
        args: object,
        on_complete: object,
        context: object,
        run_at: object,
        run_after: object,
        retry: object = None,
        timeout: object = None,
        tx: object = None,
    ) -> str:
        """A single enqueue's ``_async`` twin. Without a ``tx`` it is one small write in
        a transaction of its own, which the store may run from the event loop itself
        (SQLite: ``Store.without_waiting``; PostgreSQL: ``Store.run_async``): a
        hand-off to a thread and back costs two wake-ups, as much as the write or more
        (one task: SQLite 3.5-3.9k -> 12.9-14.7k calls/s, PostgreSQL 1.6-1.8k ->
        2.6-2.9k; 8 tasks on PostgreSQL 3.8k -> 4.4-5.0k). Should the store find it would wait,
        it has sent nothing, and the same enqueue, with the same ids, goes to a thread
        as every other twin does: the loop never waits for a lock."""
        job = self._prepare(
            kind, fn, [args], retry, on_complete, context, run_at, run_after, timeout, tx
        )
        app, store = self.app, self.app.store
        if job.alone and app._loop_may_write():
            with suppress(WouldWait):
                if store.writes_without_waiting:
                    with store.without_waiting():
                        return job.done(job.run())[0]
                got = (await store.run_async(job.body))()
                if got is not None:  # else the stored config changed: read it on a thread
                    return job.done(got)[0]
        return job.done(await asyncio.to_thread(job.run))[0]

    def _prepare(
        self,
        kind: FnKind,
        fn: object,
        args_list: list[Any],
        retry: object,
        on_complete: object,
        context: object,
        run_at: object,
        run_after: object,
        timeout: object,
        tx: object,
    ) -> _Enqueue:
        """An enqueue checked and made ready to run; it has written nothing."""
        # Bad input changes nothing: it is checked before the first write, or (args of
        # a streamed batch) rolls back the writes before it.
        registry = self.app.registry
        spec = registry.lookup(fn, kind)
        handler = None
        if on_complete is not None:
            handler = registry.lookup(on_complete, "mutation", "on_complete").name
        # Checked even without a handler (bad input is an error), but only stored for one.
        checked_context = encode_json(context, "context")
        context_json = checked_context if handler is not None else None
        if kind == "action":
            resolve_retry(retry, default=DEFAULT_RETRY, retry_by_default=False)
        timeout_s = check_timeout(timeout)
        store = self.app.store
        # A batch in a transaction of its own, to a store that overlaps the two, is
        # checked and built chunk by chunk while the server inserts the chunk before.
        stream = tx is None and store.streams_inserts and len(args_list) > STREAM_CHUNK
        payloads = [] if stream else _payloads(args_list)
        now = self.app.clock()
        due_at = resolve_due_at(run_at, run_after, now)
        ids = new_work_ids(len(args_list))
        # An enqueue in a transaction of its own may send its insert with the COMMIT;
        # in the caller's transaction the rows must be there for what follows.
        alone = tx is None

        def made(config: PoolConfig, start: int, texts: list[str]) -> NewBatch:
            behavior = None
            if kind == "action":
                behavior = resolve_retry(
                    retry,
                    default=config.default_retry,
                    retry_by_default=config.retry_actions_by_default,
                )
            return NewBatch(
                ids=ids[start : start + len(texts)],
                args=texts,
                pool=self.name,
                kind=kind,
                fn_name=spec.name,
                on_complete=handler,
                context=context_json,
                retry=behavior,
                timeout=timeout_s,
                due_at=due_at,
                enqueued_at=now,
            )

        def items(config: PoolConfig, start: int) -> NewBatch:
            return made(config, start, payloads[start : start + ENQUEUE_CHUNK])

        def streamed(tx: Tx, read: bool = False) -> Callable[[], PoolConfig | None]:
            known = None if read else self._known
            config = self._config(tx) if known is None else known
            answers = []
            with store.pipeline(tx):
                for start in range(0, len(ids), STREAM_CHUNK):
                    chunk = made(config, start, _payloads(args_list[start : start + STREAM_CHUNK]))
                    if known is None:
                        store.insert_work(tx, chunk, at_commit=False)
                    else:
                        answers.append(
                            store.insert_work_if(
                                tx, chunk, known, notify=start == 0, at_commit=False
                            )
                        )
                if known is None:
                    store.notify(tx, [self.name])
            same = [answer() for answer in answers]
            if all(same):
                return lambda: config
            if any(same):  # the config changed between two chunks: insert none of them
                raise _StaleConfig
            return lambda: None

        def body(tx: Tx, read: bool = False) -> Callable[[], PoolConfig | None]:
            known = None if read else self._known
            rest = range(ENQUEUE_CHUNK, len(ids), ENQUEUE_CHUNK)
            # A batch of several chunks inserts each as it is built, not with the
            # COMMIT, so that no chunk's rows wait for it in memory.
            at_commit = alone and tx.depth == 0 and not rest
            if known is not None:
                # The config this Pool last saw, checked by the insert itself: on
                # PostgreSQL one statement instead of a read and an insert.
                inserted = store.insert_work_if(
                    tx, items(known, 0), known, notify=True, at_commit=at_commit
                )
                if rest and inserted():
                    for start in rest:
                        store.insert_work(tx, items(known, start), at_commit=False)
                return lambda: known if inserted() else None
            config = self._config(tx)
            for start in range(0, max(len(ids), 1), ENQUEUE_CHUNK):
                store.insert_work(tx, items(config, start), at_commit=at_commit)
            store.notify(tx, [self.name])
            return lambda: config

        def run() -> PoolConfig:
            if stream:
                got: PoolConfig | None = None
                with suppress(_StaleConfig):
                    got = self.app.run(streamed)()
                if got is None:  # the stored config changed since this Pool last saw it
                    got = self.app.run(lambda t: streamed(t, read=True))()
            else:
                got = self.app.run(body, tx=tx, combine=len(ids) <= COMBINE_MAX_ITEMS)()
                if got is None:
                    got = self.app.run(lambda t: body(t, read=True), tx=tx)()
            assert got is not None  # a run that reads the config always answers it
            return got

        def done(config: PoolConfig) -> list[str]:
            # Kept even from the caller's transaction, which may roll back: every
            # insert made with it checks it against the stored config.
            self._known = config
            if events.LEVELS.get(config.log_level, events.REPORT) <= events.INFO:
                for work_id in ids:
                    events.enqueued(
                        config.log_level,
                        pool=self.name,
                        work_id=work_id,
                        fn_name=spec.name,
                        kind=kind,
                        due_at=due_at,
                    )
            return ids

        return _Enqueue(body, run, done, alone and not stream)

    # --- status ---------------------------------------------------------------------------
    def status(self, work_id: str, *, tx: Any = None) -> Status:
        """Pending(...) | Running(...) | Finished(result); unknown ids answer Finished(None)."""
        return self.status_batch([work_id], tx=tx)[0]

    def status_batch(self, work_ids: Sequence[str], *, tx: Any = None) -> list[Status]:
        ids = _check_ids(work_ids)

        def body(tx: Tx) -> list[Status]:
            rows = self.app.store.statuses(tx, ids)
            now = self.app.clock()
            return [self._status(rows.get(i), now) for i in ids]

        # One statement per 500 ids reads what they need: no snapshot to hold.
        return self.app.run(body, tx=tx, readonly=True, snapshot=False)

    def _status(self, row: StatusRow | None, now: float) -> Status:
        if row is None:
            return Finished(None)
        if row.finished is not None:
            return Finished(result_from_json(row.finished.result), row.finished.handler_error)
        work = row.active
        assert work is not None
        if work.state in RECORDABLE:  # ended: its outcome is not recorded yet
            return Running(work.attempt - 1, work.attempt, work.started_at)
        if work.state == "completing":
            return Running(work.attempt, work.attempt, work.started_at)
        reason: PendingReason
        running = limit = None
        if work.due_at > now:
            reason = "backoff" if work.attempt > 0 else "scheduled"
        else:
            assert row.occupancy is not None  # read with every pending row
            running, stored = row.occupancy
            limit = PoolConfig(work.pool).max_parallelism if stored is None else stored
            reason = "paused" if limit == 0 else "waiting_for_slot" if running >= limit else "due"
        return Pending(work.attempt, reason, work.due_at, work.last_error, running, limit)

    # --- cancel ---------------------------------------------------------------------------
    def cancel(self, work_id: str, *, tx: Any = None) -> bool:
        """Cancel one item: pending work never starts, running work is not retried.

        True if this call changed something; unknown, finished or already canceled
        work is left alone (duplicate cancels are harmless).
        """
        ids = _check_ids([work_id])
        return self.app.run(lambda t: self._cancel(t, ids) > 0, tx=tx)

    def cancel_all(
        self, *, before: datetime | float | None = None, limit: int | None = None
    ) -> int:
        """Cancel pending and running work enqueued at or before ``before`` (default now).

        ``limit`` caps how many items are canceled in all: running work first, then
        pending work in the order it would start. Work is canceled in transactions
        of a bounded size. Returns how many items were canceled.
        """
        if limit is not None:
            check_int(limit, "limit", 1)
        if before is None:
            cutoff = self.app.clock()
        elif isinstance(before, datetime):
            if before.tzinfo is None:
                raise InvalidArgumentError("before must be an aware datetime")
            cutoff = before.timestamp()
        else:
            cutoff = check_seconds(before, "before", maximum=float("inf"))  # unix time
        total = 0
        while limit is None or total < limit:
            page = CANCEL_PAGE if limit is None else min(CANCEL_PAGE, limit - total)

            def body(tx: Tx, page: int = page) -> tuple[int, int]:
                ids = self.app.store.cancelable_ids(tx, self.name, cutoff, page)
                return len(ids), self._cancel(tx, ids)

            seen, canceled = self.app.run(body)
            total += canceled
            if seen < page:
                break
        return total

    def _cancel(self, tx: Tx, ids: Sequence[str]) -> int:
        store = self.app.store
        changes = Changes()
        now = self.app.clock()
        changed = 0
        for work in store.load_many_for_update(tx, ids).values():
            if work.pool == self.name:
                changed += self.app.completion.cancel(tx, work, now, changes)
        changes.flush(store, tx, CLIENT_ID, now)
        if changed:
            store.notify(tx, [self.name])
        return changed

    enqueue_action_batch_async = _async_twin(enqueue_action_batch)
    enqueue_mutation_batch_async = _async_twin(enqueue_mutation_batch)
    enqueue_query_batch_async = _async_twin(enqueue_query_batch)
    status_async = _async_twin(status)
    status_batch_async = _async_twin(status_batch)
    cancel_async = _async_twin(cancel)
    cancel_all_async = _async_twin(cancel_all)
    configure_async = _async_twin(configure)
    pause_async = _async_twin(pause)
    resume_async = _async_twin(resume)
    history_async = _async_twin(history)
    recent_failures_async = _async_twin(recent_failures)
    stats_async = _async_twin(stats)

    def __repr__(self) -> str:
        return f"Pool({self.name!r})"


def _fields(config: PoolConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in PoolConfig.__slots__}


def _as_list(args_list: object) -> list[Any]:
    if isinstance(args_list, str | bytes | dict) or not isinstance(args_list, Sequence):
        raise InvalidTypeError(f"args_list must be a list of args dicts, got {show(args_list)}")
    return list(args_list)


def _check_ids(work_ids: object) -> list[str]:
    if isinstance(work_ids, str | bytes) or not isinstance(work_ids, Sequence):
        raise InvalidTypeError(f"work ids must be a list of str, got {show(work_ids)}")
    for work_id in work_ids:
        if not isinstance(work_id, str):
            raise InvalidTypeError(f"a work id must be a str, got {show(work_id)}")
    return list(work_ids)


def _payloads(args_list: Sequence[Any]) -> list[str]:
    """Each args dict checked and serialised."""
    return [encode_json(check_args(args), "args") for args in args_list]


class _Enqueue(NamedTuple):
    """An enqueue checked and ready: ``run`` writes it (retried, on the calling
    thread) and answers the pool's config, ``body`` is what ``run`` runs in its
    transaction, ``done`` notes the config and answers the ids. ``alone``: a small
    write in a transaction of its own."""

    body: Callable[[Tx], Callable[[], PoolConfig | None]]
    run: Callable[[], PoolConfig]
    done: Callable[[PoolConfig], list[str]]
    alone: bool


class _StaleConfig(Exception):
    """A streamed batch met two pool configs: its transaction rolls back whole."""
