"""The maintenance loop of a worker: heartbeat, rescue, handler retries, report, prune.

``tick(now)`` does one round and is what tests step; ``run`` only loops and waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workpool.core.errors import describe_error
from workpool.core.states import WorkState
from workpool.observability import events
from workpool.observability.stats import pool_stats
from workpool.runtime.completion import Changes
from workpool.store.base import Tx

if TYPE_CHECKING:
    from workpool.runtime.worker import Worker

TICK_S = 0.1
RESCUE_EVERY_S = 0.5
ORPHANS_EVERY_S = 2.0
ORPHAN_AGE_S = 2.0  # a claim this old that the worker does not know of is orphaned
HANDLERS_EVERY_S = 0.1
# A quiet worker (no change of its pools seen, nothing started, for QUIET_S) looks for
# handler retries only this often, and when the last look said one is due by then:
# whatever makes one due sooner (a record whose handler failed, a cancel) notifies
# its pool, which stirs the workers. Its upkeep reads slow down too. An idle worker
# on PostgreSQL sent 21 statements a second, ten of them this look; now 11.
QUIET_S = 1.0
HANDLERS_QUIET_S = 1.0
UPKEEP_QUIET_S = 1.0
# A quiet worker reads its peers and looks for lost work this often: workers that
# start or stop, and leases that run out, are seen within a second, not half of one.
PEERS_QUIET_S = 1.0
RESCUE_QUIET_S = 1.0
# A quiet worker with nothing in flight has no timeouts to enforce, and its reads come
# at least this far apart: its loop sleeps until the next one is due, this long at
# most, and a stir (Maintenance.nudge) ends the sleep. An idle PostgreSQL worker's
# process used 5.8-6.0 ms of CPU a second with ten rounds a second, 3.9-4.0 with two
# (reads every 0.5 s), 2.6-3.0 with one and reads a second apart (with the
# dispatcher's idle poll a look, Worker._dispatch_once).
QUIET_TICK_S = 1.0
# A resting round's reads wait this long past their due time for the dispatcher's
# idle poll, which asks for its look in the round it starts (look): one transaction
# a second. On PostgreSQL a server process costs about as much CPU to wake as the
# reads it then runs.
REST_LATE_S = 0.25
REPORT_EVERY_S = 60.0
# A report counts the pool's rows, which costs the database about half a second of
# CPU at a million pending rows: a worker starting on a big backlog claims first.
REPORT_FIRST_S = 5.0
PRUNE_EVERY_S = 60.0
# When the duties are next due is read again when the earliest of them (of the
# worker's pools) falls due, after a pass that found one due, and at least this often:
# a turn moves only forward, but a pruner that ran out of its budget sets its pool's
# next turn sooner (PRUNE_AGAIN_S), and if it dies the others pick that up from here.
DUTY_TIMES_READ_S = 10.0
# Pools whose due duties one pass (a second) takes: 200 pools at 1-2 ms each keep the
# heartbeat prompt, and serve 6,000 pools' two duties a minute from one worker.
DUTY_POOLS_PER_PASS = 200
BATCH = 32  # rows rescued / handlers retried per transaction
PRUNE_BATCH = 500  # finished rows deleted per transaction
# Deleting per duties pass (a second), across its pools, on the thread that
# heartbeats: each due pool still gets one batch once it is spent. A pool whose
# expired rows outlast it takes its next turn a second later, not a minute: a
# fixed number of rows a minute fell behind any pool finishing over 170 a second.
PRUNE_BUDGET_S = 0.25
PRUNE_AGAIN_S = 1.0
COUNTER_RETENTION_S = 86_400.0
# Claims and the running count walk index entries of rows that have since moved
# on; until vacuum removes them each scan gets slower. Autovacuum wakes once a
# minute at best, so a worker tidies the hot table itself: every so often, and
# sooner under heavy churn, when the store says it holds many dead rows.
TIDY_EVERY_S = 15.0
TIDY_CHURN_EVERY_S = 1.0
# How often the hot table's needs are read (one catalog read) and, when its
# statistics no longer describe it, refreshed (one worker at a time).
UPKEEP_EVERY_S = 0.25
ANALYZE_EVERY_S = 5.0
# How often a worker copies the write-ahead log into the database (SQLite), so
# that no claim's commit has to: see WAL_BACKSTOP_PAGES. A quiet worker saw no
# commit for QUIET_S: what its last look left can wait for its next round.
CHECKPOINT_EVERY_S = 0.25
CHECKPOINT_QUIET_S = QUIET_TICK_S
# How often a worker reads which live workers serve which pools (one small read):
# the shares of pools' limits (Worker._share) follow workers that start or stop
# within this. (Until the first read, a tick after the worker starts, nothing is
# shared: its records refill as they did before shares.)
PEERS_EVERY_S = 0.5


class Maintenance:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.store = worker.store
        self._stop = threading.Event()
        # Set to end a resting loop's sleep early (nudge, stop).
        self._nudge = threading.Event()
        self._resting = False  # the loop sleeps past TICK_S (see _sleep_time)
        # How early a round takes duties: after a resting sleep, those due within half
        # of one go with the one that woke it. Their intervals are multiples of
        # QUIET_TICK_S, so after one such round they fall due together: an idle
        # worker wakes twice a second, not at each one's own time.
        self._early = 0.0
        # Since when heartbeats have been succeeding without a gap; None after a failure.
        self._connected_since: float | None = None
        self._next = {
            "heartbeat": 0.0,
            "rescue": 0.0,
            "orphans": 0.0,
            "duties": 0.0,
            "forget": 0.0,
            # Not at start: a worker starting on a big backlog would otherwise begin
            # by vacuuming or analysing it while it should be claiming.
            "tidy": worker.clock() + TIDY_EVERY_S,
            "upkeep": 0.0,
            "checkpoint": 0.0,
            "peers": 0.0,
        }
        self._report_from = worker.clock() + REPORT_FIRST_S
        self._handlers_read = 0.0  # when handler retries were last looked for
        self._handlers_at = 0.0  # when the earliest one is due, as that look saw it
        # The duties' next times as last read (duty_times), and when to read them again.
        self._times: dict[tuple[str, str], float] = {}
        self._times_until = 0.0
        self._looking = False  # the dispatcher's idle poll asked for a look (look)

    def stop(self) -> None:
        self._stop.set()
        self._nudge.set()

    def nudge(self) -> None:
        """The worker was stirred: a resting loop takes its next round now, at the
        pace of a stirred worker."""
        if self._resting:
            self._nudge.set()

    def look(self) -> None:
        """For the dispatcher's idle poll: the next round, now, also asks whether a
        claim would get work (``claimable``), and wakes the dispatcher if so."""
        self._looking = True
        self._nudge.set()  # also mid-round: then the next one follows at once

    def _quiet(self) -> bool:
        """No change of the worker's pools seen, and nothing started, for QUIET_S."""
        return time.monotonic() - self.worker.stirred_at >= QUIET_S

    def _sleep_time(self) -> float:
        """TICK_S; for a resting worker (quiet, nothing in flight or unrecorded), the
        time until its next duty is due, up to QUIET_TICK_S."""
        # Set before the look at stirred_at: a stir after that look sees it and nudges.
        self._resting = True
        if not self._quiet() or self.worker.inflight_keys():
            self._resting = False
            return TICK_S
        # The heartbeat and a handler retry due at a known time keep their times.
        reads = [at for name, at in self._next.items() if name != "heartbeat"]
        due = min(
            self._next["heartbeat"],
            self._handlers_at,
            min(*reads, self._handlers_read + HANDLERS_QUIET_S) + REST_LATE_S,
        )
        return min(max(due - self.worker.clock(), TICK_S), QUIET_TICK_S + REST_LATE_S)

    def run(self) -> None:
        # The first round waits a tick: the worker has just heartbeaten, nothing else
        # is due sooner, and its transactions (a second heartbeat, the duties' reads)
        # ran beside the first claim. On PostgreSQL a worker's first start came 10.6
        # ms after its start, now 9.6 (medians of 8).
        while True:
            self._nudge.wait(self._sleep_time())
            self._nudge.clear()
            self._early = QUIET_TICK_S / 2 if self._resting else 0.0
            self._resting = False
            if self._stop.is_set():
                return
            try:
                self.tick(self.worker.clock())
            except Exception as exc:
                events.worker_event(
                    "maintenance_failed",
                    40,
                    worker_id=self.worker.info.id,
                    error=describe_error(exc),
                )
                self._stop.wait(1.0)

    def _due(self, name: str, now: float, every: float) -> bool:
        if now + self._early < self._next[name]:
            return False
        self._next[name] = now + every
        return True

    def tick(self, now: float) -> None:
        self.worker.expire_timeouts()
        quiet = self._quiet()
        if self._due("heartbeat", now, self.worker.options.lease / 3):
            self.heartbeat(now)
        if self._due("checkpoint", now, CHECKPOINT_QUIET_S if quiet else CHECKPOINT_EVERY_S):
            self.store.checkpoint()
        peers = self._due("peers", now, PEERS_QUIET_S if quiet else PEERS_EVERY_S)
        rescue_every = RESCUE_QUIET_S if quiet else RESCUE_EVERY_S
        rescue = self._due("rescue", now, rescue_every) and self._settled(now)
        every = HANDLERS_QUIET_S if quiet else HANDLERS_EVERY_S
        handlers = now + self._early - self._handlers_read >= every or now >= self._handlers_at
        orphans = self._due("orphans", now, ORPHANS_EVERY_S)
        duties = self._due("duties", now, 1.0)
        upkeep = self._due("upkeep", now, UPKEEP_QUIET_S if quiet else UPKEEP_EVERY_S)
        # Once a minute per worker, not per pool: it is one DELETE for the store.
        forget = self._due("forget", now, PRUNE_EVERY_S)
        tidy = self._due("tidy", now, TIDY_EVERY_S)
        pools = [p for p in self.worker.served() if p in self.worker.configs]
        if not pools:
            # None of its pools is stored yet (nothing was enqueued to them): nothing
            # to read or do for them, and their turns pass. (Their times stayed due,
            # and a resting worker went round ten times a second until its first
            # work came.)
            rescue = handlers = orphans = duties = upkeep = forget = tidy = False
            self._handlers_read, self._handlers_at = now, float("inf")
        times = duties and now + self._early >= self._times_until
        looking, self._looking = self._looking, False
        store = self.store
        worker = self.worker

        def ask(tx: Tx) -> list[Callable[[], Any] | None]:
            # A handler retry and lost work are looked for with a read first: the
            # write transactions (on SQLite, the write lock) are taken only when there
            # is something to rescue or retry. Lost work means reading every running
            # row, so it is asked about only when a rescue is due: handler retries are
            # looked for five times as often while the worker is stirred. They are
            # asked for up to a quiet worker's next look, so one due before it is
            # looked for again when due, on time.
            return [
                store.live_workers_later(tx, now) if peers else None,
                store.maintenance_due_later(tx, pools, now, lost=rescue, within=HANDLERS_QUIET_S)
                if rescue or handlers
                else None,
                # Every pool this worker may have claimed from: served() grows only.
                store.running_of_later(tx, worker.info.id, worker.served()) if orphans else None,
                store.duty_times_later(tx) if times else None,
                store.upkeep_later(tx) if upkeep else None,
                store.claimable_later(tx, worker.options.pools, now) if looking else None,
            ]

        # The round's reads go at its end, together (Tx.defer): on PostgreSQL one
        # round trip, where each was one. At rest, with the dispatcher's look among
        # them, the server's process wakes for them once a second, not three to five
        # times; the time it takes to wake costs it as much CPU as the reads (an
        # idle worker's server process 0.10 -> 0.07 % of a core).
        asked: list[Callable[[], Any] | None] = [None] * 6
        if peers or rescue or handlers or orphans or times or upkeep or looking:
            asked = store.run(ask, readonly=True)
        answers = [None if answer is None else answer() for answer in asked]
        workers, lost_due, running, duty_times, need, claimable = answers
        if claimable:
            worker.wake.set()
        if workers is not None:
            worker.peers_seen(workers)
        if lost_due is not None:
            lost, due_at = lost_due
            self._handlers_read = now
            self._handlers_at = float("inf") if due_at is None else due_at
            if rescue and lost:
                self.rescue(pools, now)
            if due_at is not None and due_at <= now:
                self.retry_handlers(pools, now)
        if running is not None:
            self.adopt_orphans(now, running)
        if duties:
            if duty_times is not None:
                self._times_read(pools, now, duty_times)
            until = time.monotonic() + PRUNE_BUDGET_S
            due = self._due_pools(pools, now, self._times)
            for pool in due:
                self.duties(pool, now, self._times, until)
            if due:
                self._times_until = 0.0  # their turns moved them, ours or another's
        if forget:
            store.run(lambda tx: store.forget_dead_workers(tx, now))
        # "" is no pool name: a duty of the whole store, one worker at a time.
        if tidy and store.run(lambda tx: store.take_turn(tx, "", "tidy", now, TIDY_EVERY_S)):
            store.tidy()
        if need is None:
            return
        if need.vacuum and store.run(
            lambda tx: store.take_turn(tx, "", "tidy", now, TIDY_CHURN_EVERY_S)
        ):
            self._next["tidy"] = now + TIDY_EVERY_S
            store.tidy(quick=True)
        elif need.analyze and store.run(
            lambda tx: store.take_turn(tx, "", "analyze", now, ANALYZE_EVERY_S)
        ):
            store.analyze()

    def heartbeat(self, now: float) -> None:
        worker = self.worker
        try:
            self.store.run(
                lambda tx: self.store.heartbeat(tx, worker.info, now, now + worker.options.lease)
            )
        except Exception:
            self._connected_since = None
            self._next["heartbeat"] = now + 0.5  # renew as soon as the store is back
            raise
        if self._connected_since is None:
            self._connected_since = now
        # Also when the worker heartbeats at its start, so the first round does not again.
        self._next["heartbeat"] = max(self._next["heartbeat"], now + worker.options.lease / 3)

    def _settled(self, now: float) -> bool:
        """Rescue only after one lease of working heartbeats.

        After a store outage every lease looks expired; waiting one lease gives
        the live workers time to renew theirs before anyone rescues their work.
        The first heartbeat of a new worker starts the clock too, so a restarted
        fleet rescues its dead predecessors one lease after coming up.
        """
        since = self._connected_since
        return since is not None and now - since >= self.worker.options.lease

    def rescue(self, pools: list[str], now: float) -> int:
        """Finish or retry attempts whose worker's lease expired."""
        return self._batches(
            lambda tx, changes: [
                self.worker.completion.rescue(tx, work, now, changes)
                for work in self.store.lost_work(tx, pools, now, BATCH)
            ],
            now,
        )

    def adopt_orphans(self, now: float, rows: list[tuple[str, int, float]]) -> int:
        """Requeue running rows of this worker that it never started, of ``rows``
        (``running_of``: this worker's running rows, as the round read them).

        A claim whose commit succeeded while the connection died before the
        reply leaves rows running under a live worker that does not know them;
        no lease expiry would ever free them.
        """
        worker = self.worker
        known = worker.inflight_keys()
        orphans = [
            wid
            for wid, attempt, started in rows
            if (wid, attempt) not in known and started < now - ORPHAN_AGE_S
        ]
        if not orphans:
            return 0

        def body(tx: Tx) -> int:
            changes = Changes()
            known_now = worker.inflight_keys()
            if worker.force.is_set():
                return 0  # outcomes dropped by a forced stop: the lease's rescuer's to judge
            count = 0
            for work in self.store.load_many_for_update(tx, orphans).values():
                if work.worker_id == worker.info.id and (work.id, work.attempt) not in known_now:
                    # An ended attempt ran (its action returned) and its outcome is
                    # lost: a failed attempt, as if its worker had died; only a row
                    # still running is a claim that never started.
                    never_ran = work.state == WorkState.RUNNING
                    count += worker.completion.rescue(tx, work, now, changes, never_ran=never_ran)
            changes.flush(self.store, tx, worker.info.id, now)
            return count

        adopted = self.store.run(body)
        if adopted:
            worker.wake.set()
        return adopted

    def retry_handlers(self, pools: list[str], now: float) -> int:
        return self._batches(
            lambda tx, changes: [
                self.worker.completion.retry_handler(tx, work, now, changes)
                for work in self.store.due_handlers(tx, pools, now, BATCH)
            ],
            now,
        )

    def _batches(self, step: Callable[[Tx, Changes], list[bool]], now: float) -> int:
        """Repeat ``step`` in bounded transactions until it handles a short batch."""
        total = 0
        while not self._stop.is_set():

            def body(tx: Tx) -> int:
                changes = Changes()
                done = step(tx, changes)
                changes.flush(self.store, tx, self.worker.info.id, now)
                return len(done)

            count = self.store.run(body)
            total += count
            if count < BATCH:
                break
        if total:
            self.worker.wake.set()
        return total

    def _times_read(
        self, pools: list[str], now: float, times: dict[tuple[str, str], float]
    ) -> None:
        """Keep the duties' next times (``duty_times``) as the round read them, and
        when to read them again: when the earliest of ``pools``' falls due, or after
        DUTY_TIMES_READ_S. A pool with none yet is due (``_due_pools``).

        One read of them all: a turn is a write transaction, and asking for two turns
        of every pool each second cost an idle worker of 500 pools a fifth of a core
        (and PostgreSQL as much again). Read every second, it was one of the nine
        statements an idle worker sent PostgreSQL a second.
        """
        self._times = times
        served = set(pools)
        soonest = [at for (pool, _), at in times.items() if pool in served]
        self._times_until = min([*soonest, now + DUTY_TIMES_READ_S])

    def _due_pools(
        self, pools: list[str], now: float, times: dict[tuple[str, str], float]
    ) -> list[str]:
        """The pools with a duty due, longest due first, at most DUTY_POOLS_PER_PASS.

        The pass runs on the thread that heartbeats: a worker meeting thousands of
        new pools (no duty rows yet, so every turn is due) spent 3.7 s on one pass
        over 3,000 of them, and at a few times that its lease would have expired.
        Capped, the first sight of many pools is spread over passes; pools due
        longest go first, so none waits for ever.
        """
        duties = ("prune", "report") if now >= self._report_from else ("prune",)
        due = []
        for pool in pools:
            first = min(times.get((pool, duty), 0.0) for duty in duties)
            if first <= now:
                due.append((first, pool))
        due.sort()
        return [pool for _, pool in due[:DUTY_POOLS_PER_PASS]]

    def duties(
        self,
        pool: str,
        now: float,
        times: dict[tuple[str, str], float],
        prune_until: float,
    ) -> None:
        """Take this pool's due turns; ``times`` (``duty_times``) skips those not due;
        ``prune_until``: the pass's deleting budget ends then (``time.monotonic``)."""
        store = self.store

        def due(duty: str) -> bool:
            at = times.get((pool, duty))
            return at is None or at <= now  # no row yet: take_turn creates it

        if (
            now >= self._report_from
            and due("report")
            and store.run(lambda tx: store.take_turn(tx, pool, "report", now, REPORT_EVERY_S))
        ):
            self.report(pool, now)
        config = self.worker.configs.get(pool)
        # A short status_ttl is honoured promptly; a long one is pruned once a minute.
        every = (
            PRUNE_EVERY_S if config is None else min(PRUNE_EVERY_S, max(config.status_ttl / 2, 1.0))
        )
        if due("prune") and store.run(lambda tx: store.take_turn(tx, pool, "prune", now, every)):
            self.prune(pool, now, prune_until)

    def report(self, pool: str, now: float) -> None:
        config = self.worker.configs.get(pool)
        if config is None:
            return
        stats = self.store.run(
            lambda tx: pool_stats(self.store, tx, config, now, REPORT_EVERY_S), readonly=True
        )
        events.report(config.log_level, **stats.to_dict())

    def prune(self, pool: str, now: float, until: float) -> int:
        """Delete ``pool``'s expired finished rows in batches until none is left or
        ``until`` (``time.monotonic``) has passed; then the turn comes back soon."""
        config = self.worker.configs.get(pool)
        if config is None:
            return 0
        store = self.store
        total = 0
        while True:
            deleted = store.run(
                lambda tx: store.prune(tx, pool, now - config.status_ttl, PRUNE_BATCH)
            )
            total += deleted
            if deleted < PRUNE_BATCH:
                break
            if time.monotonic() >= until:
                store.run(lambda tx: store.set_turn(tx, pool, "prune", now + PRUNE_AGAIN_S))
                break
        store.run(lambda tx: store.prune_counters(tx, pool, int((now - COUNTER_RETENTION_S) // 60)))
        return total
