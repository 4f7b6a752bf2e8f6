"""App: the composition root. It owns the store, the function registry and the pools."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar, overload
from urllib.parse import urlsplit

from workpool.core.errors import InvalidArgumentError, InvalidTypeError, show
from workpool.core.results import WorkInfo
from workpool.core.validation import check_int, check_name, check_seconds
from workpool.observability import events
from workpool.pool import Pool, check_pool_options
from workpool.runtime.completion import Completion
from workpool.runtime.registry import Registry
from workpool.runtime.worker import Worker, WorkerOptions
from workpool.store import Store, Tx, open_store
from workpool.store.base import FnKind, PoolConfig
from workpool.store.combine import Combiner

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
DEFAULT_URL = "sqlite:///workpool.db"
DEFAULT_CONCURRENCY = 10


class App:
    """Functions, pools and a store URL: ``App()`` uses $WORKPOOL_DATABASE_URL or SQLite."""

    def __init__(self, url: str | None = None, *, schema: str | None = None) -> None:
        if url is None:
            url = os.environ.get("WORKPOOL_DATABASE_URL") or DEFAULT_URL
        if schema is not None:
            check_name(schema, "schema")
        self.url = url
        self.store: Store = open_store(url, schema=schema)
        self._combiner = Combiner(self.store)
        self.registry = Registry()
        self.clock: Callable[[], float] = time.time
        self.completion = Completion(self.store, self.registry, self._pool_level)
        self._pools: dict[str, Pool] = {}
        self._workers: set[Worker] = set()
        # run_worker calls still building their Worker: a stop_workers meanwhile is
        # kept here for them (their startup reads the store, which may take a while).
        self._starting: set[threading.Event] = set()
        self._workers_lock = threading.Lock()
        self._ready = False
        self._ready_lock = threading.Lock()

    # --- registration -----------------------------------------------------------------------
    @overload
    def action(self, fn: F) -> F: ...
    @overload
    def action(self, fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...
    def action(self, fn: F | None = None, *, name: str | None = None) -> F | Callable[[F], F]:
        """Register an action: a plain or async function with side effects (at least once)."""
        return self._register("action", fn, name)

    @overload
    def mutation(self, fn: F) -> F: ...
    @overload
    def mutation(self, fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...
    def mutation(self, fn: F | None = None, *, name: str | None = None) -> F | Callable[[F], F]:
        """Register a mutation ``fn(tx, **args)``: runs inside the store transaction."""
        return self._register("mutation", fn, name)

    @overload
    def query(self, fn: F) -> F: ...
    @overload
    def query(self, fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...
    def query(self, fn: F | None = None, *, name: str | None = None) -> F | Callable[[F], F]:
        """Register a query ``fn(tx, **args)``: read-only; its value goes to on_complete."""
        return self._register("query", fn, name)

    def _register(self, kind: FnKind, fn: F | None, name: str | None) -> F | Callable[[F], F]:
        if fn is None:

            def decorate(f: F) -> F:
                self.registry.register(f, kind, name)
                return f

            return decorate
        self.registry.register(fn, kind, name)
        return fn

    # --- pools and transactions -------------------------------------------------------------
    def pool(
        self,
        name: str,
        *,
        max_parallelism: int | None = None,
        retry_actions_by_default: bool | None = None,
        default_retry: Any = None,
        log_level: str | None = None,
        status_ttl: float | None = None,
    ) -> Pool:
        """The pool ``name``; options given overwrite the stored config on first use."""
        check_name(name, "pool name")
        options = check_pool_options(
            max_parallelism, retry_actions_by_default, default_retry, log_level, status_ttl
        )
        pool = Pool(self, name, options)
        self._pools[name] = pool
        return pool

    def pools(self) -> list[Pool]:
        """Every pool stored in the database, plus those declared here."""
        stored = self.run(self.store.load_pools, readonly=True)
        names = sorted({c.name for c in stored} | set(self._pools))
        return [self._pools.get(n) or Pool(self, n, {}) for n in names]

    def inspect(self, work_id: str) -> WorkInfo | None:
        """Everything about one work item of any pool (None once unknown or expired)."""
        if not isinstance(work_id, str):
            raise InvalidTypeError(f"a work id must be a str, got {show(work_id)}")
        return self.run(lambda tx: self.store.work_info(tx, work_id), readonly=True)

    async def inspect_async(self, work_id: str) -> WorkInfo | None:
        return await asyncio.to_thread(self.inspect, work_id)

    def transaction(self) -> AbstractContextManager[Tx]:
        """Your own transaction: run SQL with ``tx.execute`` and enqueue with ``tx=tx``."""
        self._migrate()
        return self.store.transaction()

    def run(
        self,
        body: Callable[[Tx], T],
        *,
        tx: Any = None,
        readonly: bool = False,
        snapshot: bool = True,
        combine: bool = False,
    ) -> T:
        """Run ``body`` in the caller's transaction ``tx``, else in a new retried one
        (``snapshot``: see ``Store.transaction``). ``combine``: a write that may share
        its transaction with other threads' (see ``Combiner``): ``body`` must neither
        read what theirs write nor mind running again."""
        self._migrate()
        if tx is None:
            # A thread inside a transaction (an enqueue in a mutation) joins it instead.
            if (
                combine
                and self.store.combines_writes
                and not readonly
                and not self.store.in_transaction()
                and self.store.may_wait()  # a combined call may wait for another's
            ):
                return self._combiner.run(body)
            return self.store.run(body, readonly=readonly, snapshot=snapshot)
        if isinstance(tx, Tx):
            if tx.store is not self.store:
                raise InvalidArgumentError("tx belongs to another App's store")
            return body(tx)
        adopted = self.store.adopt(tx)
        if adopted is None:
            raise InvalidTypeError(
                f"tx must be a workpool Tx or a connection of this store's driver, got {show(tx)}"
            )
        return body(adopted)

    def _loop_may_write(self) -> bool:
        """Whether an ``_async`` enqueue may try its write from the calling thread (the
        event loop's, see ``Pool._enqueue_async``): the schema is migrated already,
        and the thread has no transaction open (an ``_async`` call runs apart from
        the caller's transaction, as it would on a worker thread)."""
        return self._ready and not self.store.in_transaction()

    def _migrate(self) -> None:
        if self._ready:
            return
        with self._ready_lock:
            if not self._ready:
                self.store.migrate()
                self._ready = True

    def _pool_level(self, pool: str) -> str:
        declared = self._pools.get(pool)
        if declared is not None and "log_level" in declared._options:
            return str(declared._options["log_level"])
        return PoolConfig(pool).log_level

    # --- workers ----------------------------------------------------------------------------
    def run_worker(
        self,
        pools: Sequence[str] | None = None,
        concurrency: int | None = None,
        until_idle: bool = False,
        *,
        lease: float = 15.0,
        shutdown_grace: float = 30.0,
    ) -> None:
        """Run a worker here until stopped (SIGTERM/SIGINT, ``stop_workers``) or idle.

        ``until_idle=True`` returns once the served pools hold no pending, running
        or completing work; a paused pool counts as idle.
        """
        asked_to_stop = threading.Event()
        with self._workers_lock:
            self._starting.add(asked_to_stop)
        try:
            worker = self._worker(pools, concurrency, until_idle, lease, shutdown_grace)
        finally:
            with self._workers_lock:
                self._starting.discard(asked_to_stop)
        with self._workers_lock:
            self._workers.add(worker)
            if asked_to_stop.is_set():
                worker.stop()
        try:
            worker.run()
        finally:
            with self._workers_lock:
                self._workers.discard(worker)

    async def run_worker_async(
        self,
        pools: Sequence[str] | None = None,
        concurrency: int | None = None,
        until_idle: bool = False,
        *,
        lease: float = 15.0,
        shutdown_grace: float = 30.0,
    ) -> None:
        await asyncio.to_thread(
            self.run_worker,
            pools,
            concurrency,
            until_idle,
            lease=lease,
            shutdown_grace=shutdown_grace,
        )

    def stop_workers(self) -> None:
        """Ask this App's running workers to stop claiming and leave gracefully;
        workers still starting stop as soon as they have started."""
        with self._workers_lock:
            for asked in self._starting:
                asked.set()
            for worker in self._workers:
                worker.stop()

    def _worker(
        self,
        pools: Sequence[str] | None,
        concurrency: int | None,
        until_idle: bool,
        lease: float,
        shutdown_grace: float,
    ) -> Worker:
        if pools is not None:
            if isinstance(pools, str | bytes) or not isinstance(pools, Sequence):
                raise InvalidTypeError(f"pools must be a list of pool names, got {show(pools)}")
            pools = [check_name(p, "pool name") for p in pools]
        if concurrency is None:
            concurrency = DEFAULT_CONCURRENCY
        # Each unit of concurrency is a thread: a five-digit count is a typo, not a plan.
        check_int(concurrency, "concurrency", 1, 10_000)
        if not isinstance(until_idle, bool):
            raise InvalidTypeError(f"until_idle must be a bool, got {show(until_idle)}")
        lease = check_seconds(lease, "lease", minimum=0.1, maximum=86_400.0)
        shutdown_grace = check_seconds(shutdown_grace, "shutdown_grace", maximum=86_400.0)
        self._migrate()
        # Declared pools exist in the store before the worker looks for work.
        for pool in list(self._pools.values()):
            if pools is None or pool.name in pools:
                self.run(pool._config)
        _default_logging()
        return Worker(
            self.store,
            self.registry,
            WorkerOptions(pools, concurrency, lease, until_idle, shutdown_grace),
            clock=self.clock,
        )

    def close(self) -> None:
        """Stop workers and release the store's connections."""
        self.stop_workers()
        self.store.close()

    def __repr__(self) -> str:
        parts = urlsplit(self.url)
        url = self.url.replace(f":{parts.password}@", ":***@") if parts.password else self.url
        return f"App({url!r})"


def _default_logging() -> None:
    """Print events to stderr when the application configured no logging at all."""
    logger = events.logger
    if logger.handlers or logging.getLogger().handlers:
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.DEBUG)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
