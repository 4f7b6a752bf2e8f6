"""The worker: claims due work within the global limits, runs it, records the outcomes.

Threads of one worker process (each loop owns its own store connection):
  dispatcher   (the caller's thread) claims attempts when local capacity is free
  executor     runs actions (threads / one event loop) and mutations/queries
  completer    records action outcomes in batches, with on_complete, per transaction;
               while it is idle, a sync action's own thread records its outcome
  maintenance  heartbeats, rescues lost work, retries handlers, reports, prunes
  watcher      turns other processes' commits into wake-ups
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from types import FrameType
from typing import Any, cast

from workpool.core.decide import AttemptOutcome, Raised, Succeeded
from workpool.core.errors import describe_error, is_non_retryable
from workpool.core.states import RECORDABLE
from workpool.observability import events
from workpool.runtime.completion import Changes, Completion, HandlerRaised
from workpool.runtime.context import reset_current, set_current
from workpool.runtime.executor import Executor
from workpool.runtime.maintenance import Maintenance
from workpool.runtime.registry import FnSpec, Registry
from workpool.store.base import (
    UNSURE,
    ActiveWork,
    ClaimedWork,
    PoolConfig,
    Store,
    Tx,
    Watcher,
    WorkerInfo,
)

_PAUSED = PoolConfig("", max_parallelism=0)
IDLE_POLL_S = 1.0  # longest sleep without a wake-up: covers missed notifications
# An idle poll whose look finds nothing reads the configs and the next due time again
# only this often; in between it sleeps to the due time its last read gave. There
# those reads matter only for a notification missed: the look finds due work itself,
# so such work still starts within a poll of its due time, and a config change whose
# notification was missed is seen within this long.
POLL_READS_S = 5.0
# Executor threads started with the worker, idle before its first claim: that
# claim's first attempt starts at once, not after a thread start (on SQLite it began
# 6 ms after the claim, behind the next claim; now 1 ms). Only one: a worker starts
# no more threads than its work needs, and any work needs one.
WARM_THREADS = 1
# How stale the configs a claim goes by may be (new, paused or resumed pools; log
# levels). Limits are not among them: each claim reads its pool's under the lock.
CONFIG_READ_S = 0.1
# The longest a stop waits for the watcher thread, and the poll of a worker run until
# idle while another worker's work runs: that work's end wakes nobody when it frees
# slots with no work due, so an idle exit would otherwise wait out IDLE_POLL_S.
SHORT_POLL_S = 0.05
# Up to this many characters of a claim's args are decoded in one parse (see
# _decoded_args); a claim of more decodes each attempt's args apart.
JOINED_ARGS_MAX = 100_000
# A pool's slots are shared among the live workers that serve it (``_share``):
# a worker past its share leaves a slot it frees to the others for this long, then
# takes it itself if none did; and once it had to, it keeps what it takes for
# SHARE_OFF_S (the others are busy elsewhere, or dead and not yet expired).
SHARE_GRACE_S = 0.05
SHARE_OFF_S = 5.0
# After a hand-over (``_hand_over``) found no work to start, a pool's slots go back
# through records again for this long: at a trickle, each job's end would otherwise
# cost a transaction more.
HAND_DRY_S = 0.05
# Hand-overs are a transaction each where records are one per batch: a worker hands
# slots over only while its actions end at least this many hand-overs' time apart
# (both smoothed), so that they take at most about half of one thread's time. At a
# limit of 5 (20 ms actions) ends come 4-8 ms apart against hand-overs of 0.4-0.7
# ms (SQLite) and 1-1.9 ms (PostgreSQL); at a limit of 50, 0.8 ms apart, where a
# hand-over each cut the limit workload's share of the ideal 80 -> 42-61 % on
# PostgreSQL and 81 -> 71-80 % on SQLite.
HAND_BUDGET = 2.0
HAND_EWMA = 0.2  # weight of the newest interval or hand-over in the smoothed ones


_Task = tuple[FnSpec, ClaimedWork, dict[str, Any]]  # a function to call, its attempt and args


@dataclass
class _InFlight:
    work: ClaimedWork
    deadline: float | None  # monotonic time of the attempt's timeout
    reported: bool = False


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    pools: Sequence[str] | None = None
    concurrency: int = 10
    lease: float = 15.0
    until_idle: bool = False
    shutdown_grace: float = 30.0


class Worker:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        options: WorkerOptions,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.registry = registry
        self.options = options
        self.clock = clock
        self.info = WorkerInfo(
            id=str(uuid.uuid4()),
            host=socket.gethostname(),
            pid=os.getpid(),
            pools=list(options.pools or []),
        )
        self.configs: dict[str, PoolConfig] = {}
        self.completion = Completion(store, registry, self.pool_level)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.force = threading.Event()
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, int], _InFlight] = {}
        self._outcomes: queue.SimpleQueue[tuple[ClaimedWork, AttemptOutcome, float] | None] = (
            queue.SimpleQueue()
        )
        self._unrecorded: set[tuple[str, int]] = set()  # outcomes queued or being written
        # Held by whoever records actions' outcomes: the completer, or the thread of a
        # sync action that ended while the completer was idle (see ``_ended``).
        self._leader = threading.Lock()
        self._completer_idle = False  # the completer waits for outcomes, none queued
        self._reserved = 0  # local slots held by a claim in progress (dispatcher, recorder)
        self._dry = False  # the dispatcher's last claim found nothing
        # When the store last showed this worker a change of its pools (a commit or a
        # notification, seen by the watcher) or it started work (monotonic): the
        # maintenance loop looks for handler retries less often while nothing happens.
        self.stirred_at = time.monotonic()
        self._configs_due = 0.0  # when a claim reads the configs again (monotonic)
        self._parked = False  # the dispatcher sleeps the idle poll until the completer wakes it
        # Set while it is not parked: only then do the watcher's wake-ups matter.
        self._unparked = threading.Event()
        self._recheck = False  # it is woken only to look, not to claim
        # Its last sleep was the idle poll's whole length, with no wake-up: it only
        # covers a missed notification, so it looks before it claims (one read, where
        # a claim on PostgreSQL is a transaction of four statements and its COMMIT).
        self._polled = False
        # The next due time the last sleep-time read gave (the clock's), and when an
        # idle poll that found nothing reads it again (monotonic; POLL_READS_S).
        self._next_due: float | None = None
        self._poll_reads_due = 0.0
        self._watcher: Watcher | None = None  # the watch loop's, for stop() to interrupt
        self._turns = itertools.count()  # which pool a claim's shares start from
        # The pools each live worker serves (read by the maintenance loop) and, per
        # pool, how many of them serve it, this one included.
        self._peer_pools: list[list[str]] = []
        self._peers: dict[str, int] = {}
        self._grace_at: float | None = None  # when the dispatcher takes held-back slots
        self._held: set[str] = set()  # the pools whose slots were held back for others
        self._unshared: dict[str, float] = {}  # pool -> until when shares do not cap it
        self._dry_hands: dict[str, float] = {}  # pool -> until when it hands no slot over
        # Smoothed, in seconds: the interval between sync actions' ends, when the last
        # ended, and how long a hand-over takes (``_hands_over``).
        self._end_gap = 0.0
        self._last_end = 0.0
        self._hand_time = 0.001
        self._handing = threading.Lock()  # held by the one hand-over at a time
        # Actions whose on_complete work met a database error in a pipelined pass
        # (a handler that uses COPY or a named cursor, which a pipeline refuses, or
        # one whose SQL fails): their batches skip the pipeline, or every one of
        # them would run its handlers twice.
        self._unpipelined: set[str] = set()
        # Mutations that raised here: their batches give each call a savepoint from
        # the start, rather than roll back and run again with savepoints each time.
        self._savepointed: set[str] = set()
        self.executor: Executor | None = None
        self.maintenance = Maintenance(self)

    # --- public -----------------------------------------------------------------------------
    def pool_level(self, pool: str) -> str:
        config = self.configs.get(pool)
        return config.log_level if config is not None else "REPORT"

    def served(self) -> list[str]:
        if self.options.pools is not None:
            return list(self.options.pools)
        return sorted(self.configs)

    def stop(self) -> None:
        """Stop claiming; running work finishes within the shutdown grace."""
        if self.stopping.is_set():
            self.force.set()
        self.stopping.set()
        self.wake.set()
        self._interrupt_watcher()

    def _interrupt_watcher(self) -> None:
        watcher = self._watcher
        if watcher is not None:
            watcher.interrupt()

    def run(self) -> None:
        restore = self._install_signals()
        self.store.migrate()
        self.executor = Executor(self.options.concurrency)
        self.executor.warm(WARM_THREADS)
        self.configs = {c.name: c for c in self.store.run(self.store.load_pools, readonly=True)}
        self.maintenance.heartbeat(self.clock())
        threads = [
            threading.Thread(target=self._complete_loop, name="workpool-completer", daemon=True),
            threading.Thread(target=self.maintenance.run, name="workpool-maintenance", daemon=True),
            threading.Thread(target=self._watch_loop, name="workpool-watcher", daemon=True),
        ]
        for thread in threads:
            thread.start()
        events.worker_event(
            "worker_started",
            events.REPORT,
            worker_id=self.info.id,
            pid=self.info.pid,
            pools=self.options.pools,
            concurrency=self.options.concurrency,
        )
        try:
            with self.store.batch_writes():
                self._dispatch_loop()
        finally:
            self._shutdown(threads)
            restore()

    # --- dispatcher -------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        backoff = 0.0
        while not self.stopping.is_set():
            self.wake.clear()
            try:
                wait = self._dispatch_once()
                backoff = 0.0
            except Exception as exc:
                # The loop restarts with backoff: a failing store never spins a core.
                backoff = min(max(backoff * 2, 0.05), 5.0)
                events.worker_event(
                    "claim_failed",
                    40,
                    worker_id=self.info.id,
                    error=describe_error(exc),
                    retry_in=backoff,
                )
                self.stopping.wait(backoff)
                continue
            if wait is None:
                return
            if wait > 0:
                self._polled = not self.wake.wait(wait) and wait >= IDLE_POLL_S

    def _dispatch_once(self) -> float | None:
        """Claim and start what fits; how long to wait for a wake-up (None: idle, leave)."""
        held: set[str] = set()
        with self._lock:
            if self._grace_at is not None:
                wait = self._grace_at - time.monotonic()
                if wait > 0:
                    return wait  # the other workers' turn at the slots held back for them
            recheck, self._recheck = self._recheck, False
            polled, self._polled = self._polled, False
            # Whoever records these outcomes (the completer, or an action's own thread)
            # claims for the freed slots in that transaction, then wakes us: a claim of
            # our own now would only compete. With every slot busy, a finishing
            # attempt's record wakes us. Either way we are parked: the record must wake
            # us even if its claim found all there was, to compute when the next work
            # is due.
            free = 0 if self._unrecorded else self._reserve_locked()
            self._parked = free <= 0
            if self._parked:
                self._unparked.clear()
            else:
                self._unparked.set()
                if self._grace_at is not None:  # due: this claim takes what is still free
                    held, self._held, self._grace_at = self._held, set(), None
        if free <= 0:
            return IDLE_POLL_S
        claimed: list[ClaimedWork] = []
        more = False
        try:
            # After a claim that found nothing (SQLite), or when the completer's claim
            # just took all there was, look before taking the claim lock: a worker
            # whose pools are full must not make the busy ones wait. An idle poll's
            # look goes with the maintenance loop's reads (below), and no claim.
            look = (self._dry and self.store.look_before_claim) or recheck
            found = not polled and (
                not look or self.store.run(self._claimable, readonly=True, snapshot=False)
            )
            if found:
                claimed, more = self.store.run(lambda tx: self._claim_in(tx, free=free))()
                self._start_all(claimed)
                taken = held.intersection(work.pool for work in claimed)
                if taken:
                    # Nobody took them: the other workers are busy elsewhere, or gone.
                    until = time.monotonic() + SHARE_OFF_S
                    self._unshared.update(dict.fromkeys(taken, until))
                if claimed and not more:
                    # Let the threads just handed work take the GIL before the read
                    # that says how long to sleep, not after it: a job's start after
                    # its enqueue, PostgreSQL, hand-over to its thread 0.22-0.26 ->
                    # 0.11-0.13 ms. (That read in the claim's own round trip saved
                    # the same and made the claim 0.15-0.35 ms longer.)
                    time.sleep(0)
        finally:
            self._unreserve(free)
        self._dry = not claimed
        if more:
            return 0.0
        # A claim that got less than it asked for took all that was due (or all the
        # limits allow): another one now would find nothing.
        if self.options.until_idle:
            if self._idle():
                return None
            return min(self._sleep_time(), SHORT_POLL_S)
        if not polled:
            return self._sleep_time()
        if time.monotonic() < self._poll_reads_due:
            # An idle poll: nothing was heard since the last read, so the due time
            # it gave still holds. (An idle worker on PostgreSQL sent these two
            # reads every second, 20 of its 92 statements in 10 s.)
            wait = self._until(self._next_due)
        else:
            wait = self._sleep_time()
        # Whether a claim would get work is asked by the maintenance loop's round,
        # which goes now, with its own reads in one round trip, and wakes us if so:
        # the server's process wakes once a second at rest, not three to five times
        # (see Maintenance.look).
        self.maintenance.look()
        return wait

    def peers_seen(self, workers: list[list[str]]) -> None:
        """The pools each live worker serves (empty: all), as the maintenance loop read
        them (every PEERS_EVERY_S; PEERS_QUIET_S in a quiet worker)."""
        self._peer_pools, self._peers = workers, {}

    def _share(self, pool: str, now: float) -> int | None:
        """This worker's share of ``pool``'s limit: the limit over the live workers
        that serve the pool, rounded up; None when shares do not cap it (one worker,
        a share of at least this worker's concurrency, or a pool let go of them).

        Without shares, the worker that claims first keeps every slot: its records
        refill the slots they free, and the others find none. With the default limit
        and concurrency (10 and 10) and CPU-bound actions, a pool then ran on one
        process's GIL however many workers served it. A share only defers: slots held
        back are taken after SHARE_GRACE_S by their own worker if nobody else did.
        """
        peers = self._peers.get(pool)
        if peers is None:
            peers = self._peers[pool] = sum(
                1 for pools in self._peer_pools if not pools or pool in pools
            )
        config = self.configs.get(pool)
        if peers <= 1 or config is None or self._unshared.get(pool, 0.0) > now:
            return None
        share = -(-config.max_parallelism // peers)
        return share if share < self.options.concurrency else None

    def _hold_back(self, rooms: dict[str, int], freed: dict[str, int]) -> None:
        """Cap a record's refill of each pool at what this worker's share leaves
        (``_share``). Slots it frees and may not refill are left to the other workers
        (the record notifies them); the dispatcher takes them itself after
        SHARE_GRACE_S if they are still free then. (The dispatcher's own claims are
        not capped: they take what nobody else has, as a worker that starts, or
        outlives the others, must.)"""
        now = time.monotonic()
        shares = {pool: share for pool in rooms if (share := self._share(pool, now)) is not None}
        if not shares:
            return
        with self._lock:  # one pass over the attempts in flight, whatever the pools
            mine = Counter(entry.work.pool for entry in self._inflight.values())
        held = set()
        for pool, share in shares.items():
            left = max(share - mine[pool], 0)
            if left >= rooms[pool]:
                continue
            rooms[pool] = left
            if left < freed.get(pool, 0):
                held.add(pool)
        if held:
            with self._lock:
                self._held |= held
                if self._grace_at is None:
                    self._grace_at = now + SHARE_GRACE_S
            self.wake.set()  # to wait out the grace, not an idle poll

    def _claimable(self, tx: Tx) -> bool:
        return self.store.claimable(tx, self.options.pools, self.clock())

    def _reserve(self, most: int | None = None) -> int:
        """Hold every free local slot (at most ``most``) for one claim; how many."""
        with self._lock:
            return self._reserve_locked(most)

    def _reserve_locked(self, most: int | None = None) -> int:
        free = max(self.options.concurrency - len(self._inflight) - self._reserved, 0)
        if most is not None:
            free = min(free, most)
        self._reserved += free
        return free

    def _unreserve(self, count: int) -> None:
        with self._lock:
            self._reserved -= count

    def _start_all(self, claimed: list[ClaimedWork], keep: bool = False) -> _Task | None:
        """Hand claimed attempts to the executor; async actions start on the loop together.

        Runs per claimed attempt, so what can be done once per batch is: one lock for
        the in-flight table, one log-level check per pool. ``keep``: the first sync
        action is returned, not submitted, for the calling thread to run.
        """
        if not claimed:
            return None
        now = self.stirred_at = time.monotonic()
        with self._lock:
            for work in claimed:
                deadline = None if work.timeout is None else now + work.timeout
                self._inflight[(work.id, work.attempt)] = _InFlight(work, deadline)
        self.maintenance.nudge()  # its timeouts are enforced at a stirred worker's pace
        levels = {pool: self.pool_level(pool) for pool in {work.pool for work in claimed}}
        logged = {p: level for p, level in levels.items() if events.shown(logging.INFO, level)}
        executor = self.executor
        assert executor is not None
        coros = []
        in_tx: list[_Task] = []
        specs: dict[str, FnSpec | None] = {}
        kept: _Task | None = None
        with executor.submitting() as submit:
            for work, args in zip(claimed, _decoded_args(claimed), strict=True):
                if work.pool in logged:
                    events.started(
                        logged[work.pool],
                        pool=work.pool,
                        work_id=work.id,
                        fn_name=work.fn_name,
                        attempt=work.attempt,
                        start_lag=work.started_at - work.due_at,
                    )
                if work.fn_name not in specs:
                    specs[work.fn_name] = self.registry.get(work.fn_name)
                spec = self._runnable(work, specs[work.fn_name], args)
                if spec is None:
                    continue
                assert isinstance(args, dict)
                if work.kind != "action":
                    in_tx.append((spec, work, args))
                elif spec.is_async:
                    coros.append(self._run_async(spec, work, args))
                elif keep and kept is None:
                    kept = (spec, work, args)
                else:
                    submit(partial(self._run_sync, spec, work, args))
        if coros:
            executor.submit_async(coros)
        if in_tx:  # one transaction for the claim's calls: measured best on both stores
            executor.submit(partial(self._run_in_tx, in_tx))
        return kept

    def _claim_in(
        self, tx: Tx, *, free: int, freed: dict[str, int] | None = None
    ) -> Callable[[], tuple[list[ClaimedWork], bool]]:
        """Claim up to ``free`` attempts in ``tx``; they may start once it commits.
        ``freed``: slots per pool that ``tx`` frees; other workers are woken for
        those this claim may leave free while work is due.

        Answers, when the returned function is called after the COMMIT, the claimed
        attempts and whether more may be claimable now: a pool gave all that was
        asked of it (its share or the batch cap, not its limit or its due work,
        stopped the claim), a pool with work got no share, or the configs read here
        show a pool to claim from that this claim skipped. Every claim runs with the
        COMMIT, in its round trip on PostgreSQL; a worker of one pool reads nothing
        before it, one of many pools reads which have work (``claim_rooms``).
        """
        freed = freed or {}
        if free <= 0:
            if freed:
                self.store.notify(tx, sorted(freed))
            return lambda: ([], False)
        # The configs are read with the claims, so which pools to claim from comes
        # from the previous read. That is safe: each claim reads its pool's limit
        # itself, under the claim lock. A pool that this read shows newly claimable
        # (created, resumed) is claimed from at once: ``more``. They are read at most
        # every CONFIG_READ_S: a claim of a worker of 3,000 pools spent more on
        # reading and parsing every pool's config than on its work.
        configs = None
        if time.monotonic() >= self._configs_due:
            self._configs_due = time.monotonic() + CONFIG_READ_S
            configs = self.store.load_pools_later(tx)
        served = self._active_pools()
        now = self.clock()
        if len(served) == 1:
            # The usual claim, whose pool needs no read first: on PostgreSQL it runs
            # after this transaction's finishes, with the COMMIT, so the pool's limit
            # has room for the slots they freed.
            rooms = {served[0]: free}
        else:
            # With many pools, one read finds those with due work and room (counting
            # the slots this transaction frees), so no claim lock is taken for a pool
            # that has nothing to give and the free slots are shared among the rest.
            # A worker of all pools reads them all: no list of every pool's name.
            pools = None if self.options.pools is None else served
            found = self.store.claim_rooms(tx, pools, now) if served else {}
            rooms = {p: n + freed.get(p, 0) for p, n in found.items()}
        if freed:
            self._hold_back(rooms, freed)
        batch = self.store.worker_batch
        asks = _shares({p: min(n, batch) for p, n in rooms.items()}, free, next(self._turns))
        # Every claim goes with the COMMIT, in the one global lock order (sorted).
        claims = self.store.claim_many_later(tx, asks, self.info.id, now)
        unfilled = sorted(p for p, n in freed.items() if n > asks.get(p, 0))
        if unfilled:
            self.store.notify(tx, unfilled)
        skipped = any(n > 0 and p not in asks for p, n in rooms.items())

        def answer() -> tuple[list[ClaimedWork], bool]:
            by_pool = claims()
            got = [(p, n, by_pool[p]) for p, n in sorted(asks.items())]
            claimed = [work for _, _, works in got for work in works]
            if configs is not None:
                self.configs = {c.name: c for c in configs()}
            # More may be due in a pool that gave all it was asked while it had room
            # for more (the share or the batch cap stopped it), that the store's
            # limit on a claim's bytes of args stopped, or that got no share. (A
            # claim that took its share of a burst left the rest to the others.)
            cut = any(
                len(works) == n < rooms[p] or (len(works) < n and self.store.claim_cut(works))
                for p, n, works in got
            )
            short = len(claimed) < free and (skipped or cut)
            return claimed, short or self._active_pools() != served

        return answer

    def _active_pools(self) -> list[str]:
        """The served pools that are not paused, sorted: pool claim locks are taken in
        this one global order, so two workers can never deadlock on them."""
        return sorted(p for p in self.served() if self.configs.get(p, _PAUSED).max_parallelism)

    def _sleep_time(self) -> float:
        """How long to sleep: until the next due work, at most ``IDLE_POLL_S``.

        The configs are read again here: work scheduled in a pool created since the
        last claim (which is what reads them otherwise) is due at a time only this
        read can see, and polling would start it up to ``IDLE_POLL_S`` late.
        """
        active = self._active_pools()
        now = self.clock()

        def read(tx: Tx) -> tuple[list[PoolConfig], float | None]:
            configs = self.store.load_pools(tx)
            names = {c.name for c in configs}
            pools = self.options.pools if self.options.pools is not None else sorted(names)
            served = [p for p in pools if p in names]
            return configs, self.store.next_due(tx, served, now) if served else None

        configs, next_due = self.store.run(read, readonly=True, snapshot=False)
        self.configs = {c.name: c for c in configs}
        self._next_due, self._poll_reads_due = next_due, time.monotonic() + POLL_READS_S
        if self._active_pools() != active:
            return 0.0  # a pool created or resumed since the claim: claim from it now
        return self._until(next_due)

    def _until(self, next_due: float | None) -> float:
        """The sleep until ``next_due`` (the clock's; None: nothing due later), at
        most IDLE_POLL_S."""
        if next_due is None:
            # Nothing due later. Due work that the claim left is held by a pool at its
            # limit or paused: what changes that (a slot freed and not refilled, a
            # resume, a new limit) wakes us; polling would only hammer the claim lock.
            return IDLE_POLL_S
        return min(max(next_due - self.clock(), 0.001), IDLE_POLL_S)

    def _idle(self) -> bool:
        with self._lock:
            if self._inflight or self._unrecorded:
                return False
        active = [
            p for p in self.served() if p in self.configs and self.configs[p].max_parallelism > 0
        ]
        if not active:
            return True
        return self.store.run(lambda tx: self.store.active_count(tx, active), readonly=True) == 0

    def _watch_loop(self) -> None:
        watcher: Watcher | None = None
        while not self.stopping.is_set():
            try:
                if watcher is None:
                    watcher = self._watcher = self.store.watcher()
                # A parked dispatcher is woken by whoever records the outcomes it
                # waits for (completer, mutation batch): a commit seen meanwhile would
                # only wake it to park again. On SQLite a busy worker's own commits are
                # such commits: its probe read data_version every 0.5 ms and its
                # dispatcher woke for each, 85 us of CPU a job when running one job at
                # a time. What changed meanwhile is seen at the first look after the
                # dispatcher unparks. (PostgreSQL's listener costs nothing while it
                # waits; resting it cost start latency.)
                if watcher.polls and not self._unparked.wait(SHORT_POLL_S):
                    continue
                # A watcher that blocks on a socket waits long: stop() interrupts it.
                if watcher.wait(SHORT_POLL_S if watcher.polls else IDLE_POLL_S):
                    self.stirred_at = time.monotonic()
                    self.wake.set()
                    self.maintenance.nudge()
            except Exception as exc:
                events.worker_event("watch_failed", 30, error=describe_error(exc))
                self.stopping.wait(1.0)
        if watcher is not None:
            watcher.close()

    # --- running attempts -------------------------------------------------------------------
    def _runnable(
        self, work: ClaimedWork, spec: FnSpec | None, args: dict[str, Any] | Exception
    ) -> FnSpec | None:
        """The function of ``work``, already in flight, whose ``args`` were decoded
        from its row (an exception if they could not be); None if it cannot start
        (it is then failed)."""
        if spec is None or spec.kind != work.kind:
            reason = f"{work.kind} {work.fn_name!r} is not registered in this worker's App"
            self._ended(work, Raised(reason, retryable=False), 0.0)
            return None
        if isinstance(args, Exception):
            reason = f"stored args are corrupt: {describe_error(args)}"
            self._ended(work, Raised(reason, retryable=False), 0.0)
            return None
        return spec

    def _run_sync(self, spec: FnSpec, work: ClaimedWork, args: dict[str, Any]) -> None:
        task: _Task | None = (spec, work, args)
        while task is not None:  # the next one, when this thread claimed it (``_ended``)
            spec, work, args = task
            token = set_current(work.id, work.pool, work.fn_name, work.attempt)
            started = time.monotonic()
            try:
                outcome = _returned(spec.fn(**args))
            except BaseException as exc:  # SystemExit from user code too: never stall the pool
                outcome = Raised(describe_error(exc), retryable=not is_non_retryable(exc))
            finally:
                reset_current(token)
            task = self._ended(work, outcome, time.monotonic() - started, inline=True)

    async def _run_async(self, spec: FnSpec, work: ClaimedWork, args: dict[str, Any]) -> None:
        token = set_current(work.id, work.pool, work.fn_name, work.attempt)
        started = time.monotonic()
        try:
            if work.timeout is None:
                outcome = _returned(await spec.fn(**args))
            else:
                try:
                    async with asyncio.timeout(work.timeout):
                        outcome = _returned(await spec.fn(**args))
                except TimeoutError:
                    if time.monotonic() - started < work.timeout:
                        raise
                    outcome = _timed_out(work.timeout)
        except BaseException as exc:  # never leave the attempt unreported
            outcome = Raised(describe_error(exc), retryable=not is_non_retryable(exc))
        finally:
            reset_current(token)
        self._ended(work, outcome, time.monotonic() - started)

    def _run_in_tx(self, items: list[_Task]) -> None:
        """Mutations and queries: each call commits with its completion, or neither does.

        A batch shares one transaction: one lock of its rows, one commit, and the
        claim for the slots it frees, as the completer does for actions. A query's
        writes are always taken back (a savepoint each). Mutations run first without
        savepoints, which cost PostgreSQL two round trips a call; if one raises, the
        transaction rolls back whole and runs again with a savepoint per call, so a
        failing call takes back only its own writes.
        """
        keys = [(work.id, work.attempt) for _, work, _ in items]
        look = True
        try:
            look = self._commit_calls(items, keys)
        except Exception as exc:
            if len(items) > 1 and not self.store.is_transient(exc):
                # The batch could not commit (a deferred constraint, say): alone, each
                # call commits or not on its own, and a bad one cannot sink the rest.
                for item in items:
                    self._run_in_tx([item])
                return
            # Not committed: the lease hands these to a rescuer, which runs them again.
            for _, work, _ in items:
                events.worker_event(
                    "mutation_not_recorded", 40, work_id=work.id, error=describe_error(exc)
                )
        finally:
            with self._lock:
                for key in keys:
                    self._inflight.pop(key, None)
            self._recorded(keys, look)

    def _commit_calls(self, items: list[_Task], keys: list[tuple[str, int]]) -> bool:
        """Run and record ``items``, claiming for the freed slots; whether the
        dispatcher should look for work (see ``_record``)."""
        reserved = [0]  # local slots held for the claim, set by the last pass
        try:
            optimistic = not any(spec.name in self._savepointed for spec, _, _ in items)
            known: dict[str, Raised] = {}
            while True:
                try:
                    answer = self.store.run(
                        partial(self._run_calls, items, keys, optimistic, known, reserved)
                    )
                    break
                except _CallRaised as raised:
                    optimistic = False
                    self._savepointed.add(raised.fn_name)
                    if raised.outcome is not None:
                        known[raised.work_id] = raised.outcome
            claimed, more = answer()
            self._start_all(claimed)
            return more or reserved[0] <= 0
        finally:
            self._unreserve(reserved[0])

    def _run_calls(
        self,
        items: list[_Task],
        keys: list[tuple[str, int]],
        optimistic: bool,
        known: dict[str, Raised],
        reserved: list[int],
        tx: Tx,
    ) -> Callable[[], tuple[list[ClaimedWork], bool]]:
        """One pass of ``_run_in_tx``; ``known``: failures of calls not to make again.
        The answer is ``_claim_in``'s."""
        rows = self.store.load_many_for_update(tx, [work.id for _, work, _ in items])
        changes = Changes()
        live = []
        for spec, work, args in items:
            current = rows.get(work.id)
            if current is None or current.state != "running" or current.attempt != work.attempt:
                continue  # stale: rescued and re-run elsewhere
            live.append((spec, work, args, current))
        shared = optimistic and self.store.savepoints_cost
        ran = self._run_queries(live, tx) if shared else {}
        for spec, work, args, current in live:
            if work.id in ran:
                outcome, duration = ran[work.id]
            else:
                started = time.monotonic()
                outcome = known.get(work.id) or self._call(spec, work, args, tx, optimistic)
                duration = time.monotonic() - started
            self.completion.complete(tx, current, outcome, self.clock(), changes, duration)
        # The calls are done: their slots are for the claim below, and the dispatcher
        # waits for it. Not before: while slow calls run, it claims for other slots.
        with self._lock:
            for key in keys:
                self._inflight.pop(key, None)
            self._unrecorded.update(keys)
        self._unreserve(reserved[0])
        reserved[0] = 0 if self.stopping.is_set() else self._reserve()
        return self._write_and_claim(tx, changes, self.clock(), reserved[0])

    def _write_and_claim(
        self, tx: Tx, changes: Changes, now: float, free: int
    ) -> Callable[[], tuple[list[ClaimedWork], bool]]:
        """Write ``changes`` with the COMMIT and claim up to ``free`` attempts after
        them, so the claim's running count has the slots they freed; the answer is
        ``_claim_in``'s. Used by every transaction that ends attempts in a worker."""
        changes.write_rows(self.store, tx, now, at_commit=True)
        freed, requeued = changes.freed(), changes.requeued()
        changes.flush(self.store, tx, self.info.id, now, wake=False, rows=False)
        if requeued:
            self.store.notify(tx, sorted(requeued))
        # Other workers are woken for retries, and for freed slots only where this
        # claim may leave them empty while work is due: otherwise every finish
        # would send them to the claim lock for nothing.
        return self._claim_in(tx, free=free, freed=freed)

    def _run_queries(
        self,
        live: list[tuple[FnSpec, ClaimedWork, dict[str, Any], ActiveWork]],
        tx: Tx,
    ) -> dict[str, tuple[AttemptOutcome, float]]:
        """The batch's queries, before its mutations, in one read-only block (a
        savepoint costs PostgreSQL two round trips: one each made queries drain at
        1.7k/s); their outcomes and durations. A query that writes, or meets any
        database error, sends the batch to the redo, which gives each call its own
        savepoint, where a query's writes are rolled back as before. (Only the first,
        optimistic pass runs this, so no call in it has a known outcome yet.)"""
        queries = [(spec, work, args) for spec, work, args, _ in live if spec.kind == "query"]
        ran: dict[str, tuple[AttemptOutcome, float]] = {}
        if len(queries) < 2:
            return ran
        with self.store.read_only(tx):
            for spec, work, args in queries:
                started = time.monotonic()
                outcome = self._call(spec, work, args, tx, optimistic=True, shared=True)
                ran[work.id] = (outcome, time.monotonic() - started)
        return ran

    def _call(
        self,
        spec: FnSpec,
        work: ClaimedWork,
        args: dict[str, Any],
        tx: Tx,
        optimistic: bool,
        shared: bool = False,
    ) -> AttemptOutcome:
        """One mutation or query; ``shared``: a query in ``_run_queries``' block."""
        token = set_current(work.id, work.pool, work.fn_name, work.attempt)
        try:
            if shared or (optimistic and spec.kind == "mutation"):
                return _returned(spec.fn(tx, **args))
            # A query's writes are discarded: it reads, its value goes to on_complete.
            with self.store.savepoint(tx, keep=spec.kind == "mutation"):
                return _returned(spec.fn(tx, **args))
        except BaseException as exc:
            if self.store.is_transient(exc):
                raise  # the whole transaction is retried
            failed = Raised(describe_error(exc), retryable=False)
            from_database = self.completion.from_database(exc)
            if shared and from_database:
                # A write refused by the read-only block, or an error that aborted it.
                raise _CallRaised(work.id, spec.name, None) from exc
            if optimistic and spec.kind == "mutation":
                # A database error may be an earlier call's, which caught it and went
                # on in an aborted transaction: the redo, with savepoints, tells.
                raise _CallRaised(work.id, spec.name, None if from_database else failed) from exc
            return failed
        finally:
            reset_current(token)

    def _report(self, work: ClaimedWork, outcome: AttemptOutcome, duration: float) -> None:
        """Queue an action's outcome for the completer; the first report of an attempt wins."""
        with self._lock:
            entry = self._inflight.get((work.id, work.attempt))
            if entry is None or entry.reported:
                return
            entry.reported = True
            self._unrecorded.add((work.id, work.attempt))
        self._outcomes.put((work, outcome, duration))

    def _ended(
        self, work: ClaimedWork, outcome: AttemptOutcome, duration: float, inline: bool = False
    ) -> _Task | None:
        """An attempt ended without a transaction of its own (an action returned, or
        it could not start): ``_report`` and the release of its slot under one lock.

        The dispatcher is not woken: the completer claims for this slot when it
        records the outcome, and wakes it then. ``inline``: called on the thread
        that ran a sync action. In a pool whose limit binds, that thread first gives
        the slot to the next attempt (``_hand_over``) and returns the sync action it
        claimed, to run next. Otherwise, if the completer is idle, it records the
        outcome itself and returns a sync action its claim took: two thread
        wake-ups fewer between a job's end and the next one's start, which is what
        a pool at its limit waits for. A busy completer gets the outcome for its
        next batch (group commit), as before.
        """
        key = (work.id, work.attempt)
        now = time.monotonic()
        with self._lock:
            entry = self._inflight.pop(key, None)
            fresh = entry is not None and not entry.reported
            if fresh:
                self._unrecorded.add(key)
            if inline:
                if self._last_end:
                    gap = min(now - self._last_end, 1.0)
                    self._end_gap += HAND_EWMA * (gap - self._end_gap)
                self._last_end = now
        if not fresh:
            self.wake.set()  # reported at its timeout, recorded since: the slot is free now
            return None
        item = (work, outcome, duration)
        if inline and self._hands_over(work) and self._handing.acquire(blocking=False):
            try:
                return self._hand_over(item)
            finally:
                self._handing.release()
        if inline and self._completer_idle and self._leader.acquire(blocking=False):
            try:
                with self.store.batch_writes():
                    return self._lead([item], keep=True)
            finally:
                self._leader.release()
        self._outcomes.put(item)
        return None

    def _hands_over(self, work: ClaimedWork) -> bool:
        """Whether the slot of ``work``, a sync action that just ended, goes to the
        next attempt before its outcome is recorded (``_hand_over``): in a pool whose
        limit binds before this worker's concurrency does, where the last hand-over
        found work to start, while actions end far enough apart (HAND_BUDGET)."""
        config = self.configs.get(work.pool)
        return (
            config is not None
            and 0 < config.max_parallelism <= self.options.concurrency
            and self._end_gap >= HAND_BUDGET * self._hand_time
            and self._dry_hands.get(work.pool, 0.0) <= time.monotonic()
            and not self.stopping.is_set()
        )

    def _hand_over(self, item: tuple[ClaimedWork, AttemptOutcome, float]) -> _Task | None:
        """Give the slot of an attempt that ended to the next one first, and record
        its outcome after: returns a sync action claimed for this thread to run.

        A pool at its limit waits for each slot's hand-over. A record's transaction
        (the outcome, its counters and finished row, on_complete) takes 0.5-0.6 ms of
        CPU on SQLite and 1.3-1.8 ms on PostgreSQL before the next attempt can start;
        this one only ends the attempt (``Store.end_attempt``: running -> ended) and
        claims, in one statement on PostgreSQL. The limit stays exact: the ended row
        no longer counts, and the attempt it ended has returned. The outcome goes to
        the completer, whose record takes the ended row as it takes a running one.
        """
        work = item[0]
        kept = None
        free = self._reserve(1)
        started = time.monotonic()
        try:
            if free > 0:
                ended, claimed = self.store.run(partial(self._end_in, work=work, free=free))()
                # A slow one (a connection's first call plans its function) raises
                # the estimate by at most a fifth.
                took = min(time.monotonic() - started, 2 * self._hand_time)
                self._hand_time += HAND_EWMA * (took - self._hand_time)
                # None: the row was not running, which a retry after a COMMIT whose
                # reply was lost also finds: the record reads which it is.
                item = (ended or replace(work, state=UNSURE), item[1], item[2])
                if not claimed:
                    self._dry_hands[work.pool] = time.monotonic() + HAND_DRY_S
                kept = self._start_all(claimed, keep=True)
        except Exception as exc:
            # Not ended, or (a COMMIT whose reply was lost) ended without our knowing.
            # Recorded as "running", a row that was ended would be missed by the
            # record's compare-and-set and later given back by the orphan check as a
            # claim that never ran: an action that ran would run again.
            item = (replace(work, state=UNSURE), item[1], item[2])
            events.worker_event(
                "hand_over_failed", 30, worker_id=self.info.id, error=describe_error(exc)
            )
        finally:
            self._unreserve(free)
        self._outcomes.put(item)
        return kept

    def _end_in(
        self, tx: Tx, *, work: ClaimedWork, free: int
    ) -> Callable[[], tuple[ClaimedWork | None, list[ClaimedWork]]]:
        ended = self.store.end_attempt(tx, work)
        claim = self._claim_in(tx, free=free, freed={work.pool: 1})

        def answer() -> tuple[ClaimedWork | None, list[ClaimedWork]]:
            return ended(), claim()[0]

        return answer

    def inflight_keys(self) -> set[tuple[str, int]]:
        """Attempts this worker is running or has outcomes of that are not yet recorded."""
        with self._lock:
            return set(self._inflight) | self._unrecorded

    def expire_timeouts(self) -> None:
        """Fail sync attempts past their timeout (their threads cannot be killed)."""
        now = time.monotonic()
        with self._lock:
            late = [
                e
                for e in self._inflight.values()
                if e.deadline is not None and not e.reported and now >= e.deadline
            ]
        for entry in late:
            if entry.work.kind == "action" and entry.work.timeout is not None:
                self._report(entry.work, _timed_out(entry.work.timeout), entry.work.timeout)

    # --- completer --------------------------------------------------------------------------
    def _complete_loop(self) -> None:
        with self.store.batch_writes():
            self._complete_outcomes()

    def _complete_outcomes(self) -> None:
        while True:
            self._completer_idle = True
            first = self._outcomes.get()
            self._completer_idle = False
            if first is None:
                return
            with self._leader:
                self._lead([first])

    def _lead(
        self, batch: list[tuple[ClaimedWork, AttemptOutcome, float]], keep: bool = False
    ) -> _Task | None:
        """Record ``batch`` and the outcomes queued behind it, with ``_leader`` held;
        ``keep``: return a sync action the claim took for the caller to run, rather
        than submit it."""
        while len(batch) < self.store.worker_batch:
            try:
                item = self._outcomes.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._outcomes.put(None)
                break
            batch.append(item)
        # The slots these outcomes freed are refilled in the same transaction: one
        # commit instead of two, and no wake-up between a finish and the next start.
        free = 0 if self.stopping.is_set() else self._reserve()
        look, kept = True, None
        try:
            look, kept = self._record(batch, free, keep)
        finally:
            self._unreserve(free)
        if free <= 0 and all(work.state == "ended" for work, _, _ in batch):
            # Their slots went to other attempts already (``_hand_over``): with every
            # local slot busy, a look for work would only park the dispatcher again.
            look = False
        self._recorded([(w.id, w.attempt) for w, _, _ in batch], look)
        return kept

    def _recorded(self, keys: list[tuple[str, int]], look: bool) -> None:
        """Attempts whose outcomes a transaction has recorded (completer, an action's
        own thread, mutation batch); ``look``: whether the dispatcher should look for work.

        The dispatcher may have waited for this record: a parked one is woken by it
        alone (the watcher lets commits pass meanwhile). When the record's claim
        took all the pools would give, a claim of its own would find nothing and, on
        PostgreSQL, hold the claim lock that other workers' completers wait for: it
        only looks (a read) and then sleeps until the next work is due.
        """
        with self._lock:
            self._unrecorded.difference_update(keys)
            # A parked dispatcher that would find no free slot only parks again (a
            # pool at its limit, whose records refill each slot, woke it at every
            # one): whoever ends or records the attempts holding them wakes it then.
            parked = (
                self._parked
                and not self._unrecorded
                and self._reserved + len(self._inflight) < self.options.concurrency
            )
            wake = look or self.options.until_idle or parked
            if not look and self._parked:
                self._recheck = True
        if wake:
            self.wake.set()

    def _record(
        self,
        batch: list[tuple[ClaimedWork, AttemptOutcome, float]],
        free: int = 0,
        keep: bool = False,
    ) -> tuple[bool, _Task | None]:
        """Record a batch of outcomes in one transaction, claiming up to ``free`` new
        attempts in it; on a non-transient error, one transaction per item (and no
        claim), so a single bad item cannot block the others.

        Returns whether the dispatcher should look for work (False only when the
        claim took all that the served pools would give), and with ``keep`` a sync
        action the claim took, not submitted, for the caller to run.
        """
        delay = 0.05
        optimistic = True
        known: dict[str, tuple[str, str]] = {}
        while True:
            try:
                answer = self.store.run(
                    partial(
                        self._record_in,
                        batch=batch,
                        optimistic=optimistic,
                        known=known,
                        free=free,
                    )
                )
                claimed, more = answer()
                kept = self._start_all(claimed, keep)
                return more or free <= 0, kept
            except HandlerRaised as raised:
                # That transaction rolled back whole: redo it with a savepoint per
                # handler, recording this failure without calling the handler again.
                optimistic = False
                if raised.work_id is not None:
                    known[raised.work_id] = (raised.error, raised.trace)
                continue
            except Exception as exc:
                if self.force.is_set():
                    return True, None  # leaving now: lease expiry hands these to a rescuer
                if len(batch) > 1 and not self.store.is_transient(exc):
                    for item in batch:
                        self._record([item])
                    return True, None
                events.worker_event(
                    "complete_failed",
                    40,
                    worker_id=self.info.id,
                    error=describe_error(exc),
                    retry_in=delay,
                )
                if len(batch) == 1 and not self.store.is_transient(exc):
                    work, _, duration = batch[0]
                    reason = f"could not record the result: {describe_error(exc)}"
                    batch = [(work, Raised(reason, retryable=False), duration)]
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _record_in(
        self,
        tx: Tx,
        *,
        batch: list[tuple[ClaimedWork, AttemptOutcome, float]],
        optimistic: bool = False,
        known: dict[str, tuple[str, str]] | None = None,
        free: int = 0,
    ) -> Callable[[], tuple[list[ClaimedWork], bool]]:
        handled = {work.fn_name for work, _, _ in batch if work.on_complete is not None}
        if not optimistic or not handled or handled & self._unpipelined:
            return self._record_body(tx, batch, optimistic, known, free)
        # The optimistic pass runs the on_complete handlers in the pipeline with the
        # store's own statements: on PostgreSQL their statements then cost one round
        # trip in all rather than one each. A database error there may surface at a
        # later read than its statement's, so any one sends the batch to the redo,
        # which runs each handler in its own savepoint, outside any pipeline.
        try:
            with self.store.pipeline(tx):
                return self._record_body(tx, batch, optimistic, known, free)
        except HandlerRaised as raised:
            if raised.work_id is None:
                self._unpipelined |= handled
            raise
        except Exception as exc:
            if self.store.is_transient(exc) or not self.completion.from_database(exc):
                raise
            self._unpipelined |= handled
            raise HandlerRaised(None, describe_error(exc), "") from exc

    def _record_body(
        self,
        tx: Tx,
        batch: list[tuple[ClaimedWork, AttemptOutcome, float]],
        optimistic: bool,
        known: dict[str, tuple[str, str]] | None,
        free: int = 0,
    ) -> Callable[[], tuple[list[ClaimedWork], bool]]:
        """Record ``batch`` and claim for the freed slots; the answer, read after the
        COMMIT, is ``_claim_in``'s. On PostgreSQL a batch of plain successes is one
        round trip: the finish, the counters, the claim and the COMMIT go together."""
        now = self.clock()
        changes = Changes(optimistic=optimistic, known_failures=dict(known or {}))
        simple: list[tuple[ClaimedWork, Succeeded, float]] = []
        rest: list[tuple[ClaimedWork, AttemptOutcome, float]] = []
        for work, outcome, duration in batch:
            # A success's on_complete runs on the short path too while the pass is
            # optimistic; the redo after a handler raised gives each its savepoint.
            if (
                type(outcome) is Succeeded
                and work.kind == "action"
                and (optimistic or work.on_complete is None)
                and work.state != UNSURE
            ):
                simple.append((work, outcome, duration))
            else:
                rest.append((work, outcome, duration))
        if rest:  # on_complete (user code) may run here: in a pipeline only if optimistic
            rows = self.store.load_many_for_update(tx, [work.id for work, _, _ in rest])
            for work, outcome, duration in rest:
                current = rows.get(work.id)
                if (
                    current is None
                    or current.state not in RECORDABLE
                    or current.attempt != work.attempt
                ):
                    continue  # stale completion: fenced by attempt number
                self.completion.complete(tx, current, outcome, now, changes, duration)
        # Nothing below is read before the COMMIT: the writes go with it, and the
        # claim after them, so the running count it reads has our freed slots.
        log = None
        if simple:
            log = self.completion.finish_succeeded(tx, simple, now, changes, self.info.id)
        claim = self._write_and_claim(tx, changes, now, free)

        def answer() -> tuple[list[ClaimedWork], bool]:
            if log is not None:
                log()
            return claim()

        return answer

    # --- lifecycle --------------------------------------------------------------------------
    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: FrameType | None) -> None:
            self.stop()

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        self.stopping.set()
        self._interrupt_watcher()
        deadline = time.monotonic() + self.options.shutdown_grace
        while time.monotonic() < deadline and not self.force.is_set():
            with self._lock:
                # Recording too: a batch of mutations may be committing its calls.
                if not self._inflight and not self._unrecorded:
                    break
            time.sleep(0.01)
        self._outcomes.put(None)
        threads[0].join(timeout=max(deadline - time.monotonic(), 5.0))
        self.maintenance.stop()
        for thread in threads[1:]:
            thread.join(timeout=5.0)
        if self.executor is not None:
            self.executor.shutdown()
        with self._lock:
            abandoned = len(self._inflight)
        try:
            # Without our row, a rescuer sees anything still running here as lost at once.
            self.store.run(lambda tx: self.store.remove_worker(tx, self.info.id))
        except Exception as exc:
            events.worker_event("deregister_failed", 30, error=describe_error(exc))
        events.worker_event(
            "worker_stopped", events.REPORT, worker_id=self.info.id, abandoned=abandoned
        )


_RETURNED_NONE = Succeeded(None, "null")


def _shares(rooms: dict[str, int], free: int, turn: int) -> dict[str, int]:
    """Split ``free`` slots among pools with ``rooms`` (the most each may take):
    evenly, what one cannot take going to the others, and the remainder to the
    pools from the ``turn``-th on, so a worker with fewer slots than pools with work
    serves them all in turn."""
    names = sorted(p for p, n in rooms.items() if n > 0)
    if names:
        start = turn % len(names)
        names = names[start:] + names[:start]
    asks = dict.fromkeys(names, 0)
    left = free
    while left > 0 and names:
        each = max(1, left // len(names))
        for name in list(names):
            take = min(each, rooms[name] - asks[name], left)
            asks[name] += take
            left -= take
            if asks[name] == rooms[name]:
                names.remove(name)
            if left == 0:
                break
    return {p: n for p, n in asks.items() if n > 0}


def _decoded_args(claimed: Sequence[ClaimedWork]) -> Iterable[dict[str, Any] | Exception]:
    """Each attempt's args as a dict, or the error that decoding them met.

    One parse for the whole claim, of its args joined into a JSON array: a call of
    ``json.loads`` per attempt cost 1.5 us against 0.2. Not for big args, whose
    copy and parse at once cost more than the calls and held up the claim's first
    start (50 of 800 KB: drain 90 -> 60 jobs/s): apart, as they are needed, an
    attempt starts while the next one's args are decoded. Args that do not decode each
    to one object (a corrupt row) send the claim to a parse per attempt, which
    finds them. (Rows written to decode together into as many objects as there
    are rows, while none decodes alone, would run with those objects: only someone
    who can write the table can make them, and could as well write any args.)
    """
    texts = [work.args for work in claimed]
    joined = None
    if sum(map(len, texts)) <= JOINED_ARGS_MAX:
        with suppress(ValueError, RecursionError):
            joined = json.loads("[" + ",".join(texts) + "]")
    if (
        isinstance(joined, list)
        and len(joined) == len(claimed)
        and all(type(args) is dict for args in joined)
    ):
        return cast(list[dict[str, Any] | Exception], joined)
    return map(_decode_one, texts)


def _decode_one(text: str) -> dict[str, Any] | Exception:
    try:
        args = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep JSON
        return exc
    if not isinstance(args, dict):
        return ValueError("args are not a JSON object")
    return args


def _returned(value: object) -> AttemptOutcome:
    if value is None:
        return _RETURNED_NONE
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return Raised(f"return value is not JSON-serialisable: {exc}", retryable=False)
    return Succeeded(value, encoded)


class _CallRaised(Exception):
    """A mutation (or a query's database error) raised in a pass without savepoints:
    roll back, redo with them.

    ``outcome`` is its recorded failure, or None when the redo must call it again
    to learn whose error it was.
    """

    def __init__(self, work_id: str, fn_name: str, outcome: Raised | None) -> None:
        super().__init__(work_id)
        self.work_id = work_id
        self.fn_name = fn_name
        self.outcome = outcome


def _timed_out(seconds: float) -> Raised:
    return Raised(f"timed out after {seconds:g} s")
