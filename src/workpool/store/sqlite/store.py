"""SqliteStore: connections per thread, WAL, busy handling and change polling."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from workpool.core.errors import InvalidArgumentError, StoreUnavailableError
from workpool.store.base import (
    ClaimedWork,
    Counters,
    Deferred,
    Finishing,
    NewWork,
    PoolConfig,
    Succeeded,
    Tx,
    Upkeep,
    Watcher,
    WouldWait,
    minute_of,
)
from workpool.store.sql import CLAIM_SPLIT_MIN, SqlStore, check_schema
from workpool.store.sql_reads import IN_CHUNK, RECORDABLE_IN, storable
from workpool.store.sqlite.migrations import MIGRATIONS
from workpool.store.sqlite.wal_bell import WalBell

if sys.platform != "win32":
    import fcntl  # the writers' queue (SqliteStore._enter_queue); Windows goes without

# How long BEGIN IMMEDIATE polls for another process's write lock before it
# reports "busy". Connections have no busy timeout of their own: only BEGIN
# IMMEDIATE waits for a lock in WAL mode (readers never wait, except in rare
# moments such as another process closing the file), and ``run`` retries a
# transaction that met "busy" anywhere else.
BUSY_TIMEOUT_S = 30.0
# After the log was written, how often a worker waiting for the write lock tries
# again (LOCK_LOOK_S), and how many times (LOCK_LOOKS) before it waits for the next
# write: a commit writes page after page, and lets go of the lock after the last.
# Should another waiter have taken it, its commit is the next write to wait for.
LOCK_LOOK_S = 0.00005
LOCK_LOOKS = 3
# The longest a writer waits between two tries, polling or on the bell (a holder
# that rolls back writes nothing to the log).
LOCK_WAIT_MAX_S = 0.002
# A commit that takes the WAL past this many pages copies it into the database
# file itself, syncing it: 5-10 ms on a slow disk, inside a claim's commit, which
# delayed 1 start in 100 by that much. Workers checkpoint every CHECKPOINT_EVERY_S
# on their maintenance thread instead (``checkpoint``); this is the backstop for a
# store no worker serves, at 10 times SQLite's default (40 MB of WAL).
WAL_BACKSTOP_PAGES = 10_000
# Reads of the database file go through a memory map of up to this many bytes
# (``?mmap_size=`` in the URL; 0 turns it off): a page that is not in a
# connection's own cache is read from the OS's page cache without a read() call
# and a copy. Each connection's cache starts cold whenever another one has
# committed, so a big backlog is read that way at every claim: with 1,000,000
# pending, claims 45-54k -> 61-66k jobs/s (three alternated pairs); with 10,000
# and in the drains, level. The map is of the file and shared: it costs address
# space, not memory. Writes still go to the WAL.
MMAP_BYTES = 256 * 1024 * 1024
# The work table's columns that _work_columns makes, but args and context: the id
# first.
_WORK_COLUMNS = (0, 1, 2, 3, 5, 7, 8, 9, 10)
# The insert of new work rows, those columns first (the three statements that
# insert add their rows' values).
_INSERT_WORK = (
    "INSERT INTO {s}work (id, pool, kind, fn_name, on_complete, retry, timeout, state,"
    " due_at, attempt, cancel_requested, handler_failures, lost_count, enqueued_at,"
    " args, context)"
)
# Args and context up to this many characters together stay in the work row: small
# enough that a row holding them is rewritten whole on each update at no real cost
# and still fits in one 4 KB page (a character takes up to 4 bytes in UTF-8).
INLINE_CHARS = 512
# A claim of at most this many rows returns them from its UPDATE, in the write lock,
# rather than pick them, update them and read them after the COMMIT (_claim_rows).
SMALL_CLAIM = 4
# data_version probe interval where there is no WalBell: every 2 ms while idle,
# every 0.5 ms for 0.25 s after the last commit it saw, so work arriving in a stream
# waits about 0.25 ms for its worker to notice it rather than 1 ms. Other workers'
# heartbeats are commits too: longer fast spells made an idle worker 1.2 -> 1.7 %
# of a core (a second), these 1.3-1.4 %. With a bell the probe reads only when the
# log was written, at most every BUSY_POLL_S, and for RING_LOOK_S after a ring
# (long enough for a synchronous=FULL commit's sync).
CHANGE_POLL_S = 0.002
BUSY_POLL_S = 0.0005
BUSY_FOR_S = 0.25
RING_LOOK_S = 0.01


def _use_wal(conn: sqlite3.Connection) -> None:
    """Put the file in WAL mode. Switching a new file takes an exclusive lock, and
    while another connection switches it SQLite answers "database is locked" at
    once, without its busy handler: processes that open a new store together wait
    here the way they wait for any other lock."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


class SqliteStore(SqlStore):
    look_before_claim = True
    combines_writes = True
    place = "rowid"

    def end_attempt(self, tx: Tx, work: ClaimedWork) -> Callable[[], ClaimedWork | None]:
        if work.place is None:
            return super().end_attempt(tx, work)
        # At its place, the id compared there too: one b-tree descent instead of two.
        sql = self._sql(
            "UPDATE {s}work SET state = 'ended' WHERE rowid = ? AND id = ?"
            " AND state = 'running' AND attempt = ?"
        )
        done: list[int] = []

        def end(conn: sqlite3.Connection) -> None:
            done.append(conn.execute(sql, (work.place, work.id, work.attempt)).rowcount)

        self._at_commit(tx, end)
        return lambda: replace(work, state="ended") if done == [1] else None

    def __init__(
        self, path: str, *, synchronous: str = "NORMAL", mmap_size: int = MMAP_BYTES
    ) -> None:
        super().__init__()
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise InvalidArgumentError(f"synchronous={synchronous!r} is not a SQLite setting")
        if type(mmap_size) is not int or mmap_size < 0:
            raise InvalidArgumentError(
                f"mmap_size={mmap_size!r} must be a whole number of bytes, 0 or more"
            )
        self.mmap_size = mmap_size
        self.path = path
        self.url = f"sqlite:///{path}"
        self.synchronous = synchronous.upper()
        # A commit syncs the log to disk (FULL, EXTRA) or not (NORMAL, OFF: WAL mode
        # syncs at checkpoints, which workers run on a thread of their own).
        self.writes_without_waiting = self.synchronous in ("OFF", "NORMAL")
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._writer = threading.Lock()
        # The writers' queue file (_enter_queue): the process that opened it, its fd.
        self._queue: tuple[int, int | None] = (0, None)
        self._queued: int | None = None  # the fd whose lock _writer's holder holds
        # Rings when another connection's commit writes the log: see _begin_immediate.
        self._lock_bell: WalBell | None = None
        self._lock_bell_tried = False
        self._migrated = False
        self._json: bool | None = None  # see _has_json

    def _connect(self) -> sqlite3.Connection:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise StoreUnavailableError(f"cannot open {self.url}: directory {directory} is missing")
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=0,
                isolation_level=None,
                check_same_thread=False,
            )
            _use_wal(conn)
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            conn.execute(f"PRAGMA wal_autocheckpoint={WAL_BACKSTOP_PAGES}")
            conn.execute(f"PRAGMA mmap_size={self.mmap_size}")
        except sqlite3.Error as exc:
            raise StoreUnavailableError(f"cannot open {self.url}: {exc}") from exc
        with self._lock:
            self._connections.append(conn)
        return conn

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
        return conn

    def migrate(self) -> None:
        if self._migrated:
            return
        conn = self._connection()
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        except sqlite3.OperationalError as exc:
            if not self.is_transient(exc):
                raise
            current = False  # the file is busy for a moment: read it again under the lock
        if current:
            self._migrated = True  # no need to wait for the write lock
            return
        with self._writer:
            self._enter_queue(waits=True)
            try:
                self._begin_immediate(conn)
                try:
                    version = conn.execute("PRAGMA user_version").fetchone()[0]
                    check_schema(version, len(MIGRATIONS))
                    for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                        for statement in script.split(";"):
                            if statement.strip():
                                conn.execute(statement)
                        conn.execute(f"PRAGMA user_version={number}")
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            finally:
                self._leave_queue()
        self._migrated = True

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
            bell, self._lock_bell, self._lock_bell_tried = self._lock_bell, None, False
            (pid, fd), self._queue = self._queue, (0, None)
        if bell is not None:
            bell.close()
        if fd is not None and pid == os.getpid():
            os.close(fd)
        self._local = threading.local()

    def _begin_immediate(self, conn: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``, trying again as soon as the holder of the file lock
        has likely let go of it. Since round 32 this store's writers wait for each
        other in the writers' queue (``_enter_queue``) first, so this waits only for
        a writer outside it (another program); the numbers below are from before
        the queue, when it was how processes waited for each other.

        SQLite's own busy handler sleeps 1, 2, 5, 10 ... 100 ms between tries, so a
        worker waiting behind another process's short write would idle for tens of
        milliseconds; this polls every 0.25 to 3 ms. Not much faster: a first wait
        of 0.1-0.3 ms made 4 processes enqueueing one item at a time on 2 cores
        retry in vain so often that they managed 10.8k calls/s together, against
        16.6-17.7k with this one. Inside ``batch_writes`` (a worker's claims and
        records) a ``WalBell`` tells when the holder commits: its commit writes the
        log and then lets go, so the thread sleeps until the log is written and
        then looks LOCK_LOOKS times, LOCK_LOOK_S apart (2 worker processes draining
        100,000 jobs: 37.6k -> 43.1k jobs/s, medians of 5; 4 processes level).
        Elsewhere it costs more than it saves: 4 producers waiting that way woke at
        every commit and managed 7-11k calls/s instead of 14-15k.
        (Setting the busy timeout to 0 for the BEGIN and back after it was two
        statements more in every write: 57 of the 430 us of a single enqueue after
        an idle spell.)
        """
        delay = 0.0005
        give_up = time.monotonic() + BUSY_TIMEOUT_S
        bell = self._bell() if getattr(self._local, "batches", False) else None
        looks = 0
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not self.is_transient(exc) or time.monotonic() > give_up:
                    raise
            if bell is None:
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, LOCK_WAIT_MAX_S)
                continue
            if bell.wait(0.0):
                looks = LOCK_LOOKS  # the log was written since the last look
            if looks > 0:
                looks -= 1
                time.sleep(LOCK_LOOK_S)  # a commit is being written: it ends soon
            elif bell.wait(LOCK_WAIT_MAX_S):
                looks = LOCK_LOOKS

    @contextmanager
    def batch_writes(self) -> Iterator[None]:
        self._local.batches = True
        try:
            yield
        finally:
            self._local.batches = False

    def _bell(self) -> WalBell | None:
        if not self._lock_bell_tried:
            with self._lock:
                if not self._lock_bell_tried:
                    self._lock_bell = WalBell.open(self.path)
                    self._lock_bell_tried = True
        return self._lock_bell

    def _begin(
        self, readonly: bool, snapshot: bool
    ) -> tuple[Any, str | None, Callable[[Tx, bool], None]]:
        # ``snapshot`` changes nothing here: SQLite's BEGIN and COMMIT cost no round trip.
        conn = self._connection()
        if readonly:
            conn.execute("BEGIN")

            def end_read(tx: Tx, commit: bool) -> None:
                _end(conn, tx, commit)

            return conn, None, end_read

        # A write transaction takes the write lock at its first statement
        # (``send_begin``), or at COMMIT when all it has are deferred statements: the
        # Python that builds a worker's batch (its finishes, counters and claim) runs
        # before the lock, which every other writer waits for, and only SQL runs in it.
        def end(tx: Tx, commit: bool) -> None:
            if tx.begin is not None:
                if not (commit and tx.deferred):
                    return  # nothing ran and nothing waits: no lock was taken
                self.send_begin(tx)
            try:
                _end(conn, tx, commit)
            except BaseException:
                if conn.in_transaction:  # a failed COMMIT leaves it open: retry from scratch
                    conn.execute("ROLLBACK")
                raise
            finally:
                self._leave_queue()
                self._writer.release()

        return conn, "BEGIN IMMEDIATE", end

    def send_begin(self, tx: Tx) -> None:
        # Threads of one process queue on this mutex, and processes on the queue
        # file's lock (_enter_queue), instead of on SQLite's busy handler.
        waits = self.may_wait()
        if not self._writer.acquire(blocking=waits):
            raise WouldWait("another thread of this process is writing")
        try:
            self._enter_queue(waits)
            try:
                # IMMEDIATE takes the write lock up front: a deferred transaction
                # that later writes can fail with SQLITE_BUSY_SNAPSHOT, which no busy
                # timeout retries. It waits only for writers that skip the queue.
                if waits:
                    self._begin_immediate(tx.raw)
                else:
                    try:
                        tx.raw.execute("BEGIN IMMEDIATE")
                    except sqlite3.OperationalError as exc:
                        if self.is_transient(exc):
                            raise WouldWait(str(exc)) from exc
                        raise
            except BaseException:
                self._leave_queue()
                raise
        except BaseException:
            self._writer.release()
            raise
        tx.begin = None

    def _enter_queue(self, waits: bool) -> None:
        """Wait for this store's writers in other processes: an exclusive ``flock``
        on ``<file>-writers``, held from before ``BEGIN IMMEDIATE`` to after the
        COMMIT (called with ``_writer`` held, so one thread per process at most).

        SQLite's file lock cannot be waited for: ``BEGIN IMMEDIATE`` fails at once
        and is tried again after a sleep (``_begin_immediate``), so a writer either
        sleeps past the moment the lock frees or spins for it, and with many
        processes most tries are in vain. Waiting in the kernel wakes the next
        writer as the last one lets go. Measured with 2 worker processes draining
        while producer processes enqueue one item at a time (5-6 s, 3-4 runs each):
        4 producers 2.4-3.5k -> 5.2-7.5k calls/s, 1 producer 2.9-3.4k -> 3.7-4.0k, the
        start lag unchanged; producers alone, 16: 5.9-6.4k -> 7.0-9.6k, but 4:
        13.4-13.6k -> 8.2-9.8k (polling, one of them wrote many transactions in a
        row while the others slept; now each turn wakes the next in line); the
        benchmark's drain, retries, limit and latency level within their noise.
        The kernel lets go of a dead process's lock. A writer waits for the one
        ahead of it as long as that one writes: a store's writes are short, and a
        mutation or ``app.transaction()`` that holds the lock for long holds up
        every writer anyway. Writers that do not queue (other programs) still meet
        SQLite's lock and its busy timeout."""
        fd = self._queue_fd()
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if waits else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise WouldWait("another process is writing") from exc
        except OSError:
            # A file system without flock (ENOLCK): this store's writers go
            # without the queue, as where the file cannot be made.
            with self._lock:
                self._queue = (os.getpid(), None)
            os.close(fd)
            return
        self._queued = fd

    def _leave_queue(self) -> None:
        fd, self._queued = self._queued, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _queue_fd(self) -> int | None:
        """The queue file, opened once per process (a forked child must not unlock
        its parent's: a lock belongs to the open file, which a fork shares); None
        where it cannot be made (a read-only directory): writers then only meet
        SQLite's lock."""
        if sys.platform == "win32":
            return None
        pid = os.getpid()
        if self._queue[0] != pid:
            with self._lock:
                if self._queue[0] != pid:
                    try:
                        fd: int | None = os.open(
                            self.path + "-writers", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666
                        )
                    except OSError:
                        fd = None
                    self._queue = (pid, fd)
        return self._queue[1]

    def is_transient(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        text = str(exc).lower()
        return "locked" in text or "busy" in text

    def _backoff_sleep(self, attempt: int) -> None:
        time.sleep(min(0.001 * 2**attempt, 0.2) * (0.5 + random.random()))

    def checkpoint(self) -> None:
        conn = self._connection()
        if conn.in_transaction:
            return
        # data_version moves when another connection commits: nothing new, no
        # checkpoint (it would still sync the database file).
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        if version == getattr(self._local, "checkpointed", None):
            return
        try:
            _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.OperationalError as exc:
            if not self.is_transient(exc):
                raise
            return  # another connection is checkpointing: the next call catches up
        if frames == copied:  # else a reader held some back: try again next time
            self._local.checkpointed = version

    def tidy(self, *, quick: bool = False) -> None:
        # Deleted rows leave no dead index entries in SQLite; keep the planner's
        # statistics fresh instead (cheap: it analyses only what changed a lot, and
        # analysis_limit makes that a sample, so a million-row backlog is not read
        # whole while the write lock is held).
        # Inside a write transaction: an ANALYZE that started as a read could not
        # upgrade to a write once another connection committed (SQLITE_BUSY_SNAPSHOT).
        def optimize(tx: Tx) -> None:
            tx.execute("PRAGMA analysis_limit = 1000")
            tx.execute("PRAGMA optimize")

        self.run(optimize)

    # SQLite plans each statement when it is prepared, from sqlite_stat1, which only
    # the tidy's PRAGMA optimize writes; without it the planner assumes selective
    # indexes, which is what every statement here wants.
    def upkeep(self) -> Upkeep:
        return Upkeep()

    def analyze(self) -> None:
        self.tidy()

    def adopt(self, connection: Any) -> Tx | None:
        if isinstance(connection, sqlite3.Connection):
            return Tx(connection, self)
        return None

    def notify(self, tx: Tx, pools: Any) -> None:
        """Other processes notice any commit through ``data_version``; nothing to send."""

    def watcher(self) -> Watcher:
        return _VersionProbe(self._connect(), WalBell.open(self.path))

    # --- the work and payload tables (schema 4) ------------------------------------------
    # Small args and context ride in the work row (and args in the finished row):
    # one b-tree fewer to write per enqueue. Bigger ones live in payloads, written once
    # at enqueue, as SQLite rewrites a whole row on every update (migrations 3 and 4
    # say more). A work row whose args are NULL has both in payloads.

    _INSERT_ONE_IF = (
        _INSERT_WORK + " SELECT ?, ?, ?, ?, ?, ?, ?, 'pending', ?, 0, 0, 0, 0, ?, ?, ?"
        f" WHERE EXISTS (SELECT 1 FROM {{s}}pools WHERE ({SqlStore._POOL_COLUMNS})"
        " IS (?, ?, ?, ?, ?, ?, ?, ?, ?)) ON CONFLICT (id) DO NOTHING"
    )

    def insert_work_if(
        self,
        tx: Tx,
        items: Sequence[NewWork],
        config: PoolConfig,
        *,
        notify: bool = False,
        at_commit: bool = True,
    ) -> Callable[[], bool]:
        # A single enqueue whose args fit in its row: the config check is the insert's
        # WHERE, one statement instead of a read and an insert. (Nothing to notify:
        # other processes see the commit itself, see notify.)
        columns = self._work_columns(items)
        args, context = columns[4], columns[6]
        if len(args) != 1 or len(args[0]) + len(context[0] or "") > INLINE_CHARS:
            return super().insert_work_if(tx, items, config, notify=notify, at_commit=at_commit)
        inserted = self.q(
            tx,
            self._INSERT_ONE_IF,
            (
                *(columns[i][0] for i in _WORK_COLUMNS),
                args[0],
                context[0],
                *self._pool_params(config),
            ),
        ).rowcount
        # None inserted: the config changed, or (a retry) the row is there already;
        # either way the caller reads the config and inserts again, which is harmless.
        return lambda: inserted == 1

    def _insert_columns(self, tx: Tx, columns: list[Sequence[Any]], at_commit: bool) -> None:
        # Written at once even when they could wait: there is no round trip to save.
        # A retry after an ambiguous commit must not fail on ids it may have written.
        ids, args, contexts = columns[0], columns[4], columns[6]
        if not ids:
            return
        big, inline_args, inline_contexts = self._apart(args, contexts, INLINE_CHARS)
        if big:
            self._executemany(
                tx,
                self._sql(
                    "INSERT INTO {s}payloads (id, context, args) VALUES (?, ?, ?)"
                    " ON CONFLICT (id) DO NOTHING"
                ),
                [(ids[k], contexts[k], args[k]) for k in big],
            )
        args, contexts = inline_args, inline_contexts
        if (
            len(ids) > 1
            and self._has_json(tx)
            and all(columns[i].count(columns[i][0]) == len(ids) for i in _WORK_COLUMNS[1:])
        ):
            # One statement over a JSON array of (id, args, context), where executemany
            # binds 11 values a row (4.3 -> 2.0 us a row). Texts as JSON strings, so
            # that json_extract gives them back exactly. "WHERE true" tells SQLite's
            # parser that ON begins the upsert, not a join.
            self.q(
                tx,
                _INSERT_WORK + " SELECT json_extract(value, '$[0]'),"
                " ?, ?, ?, ?, ?, ?, 'pending', ?, 0, 0, 0, 0, ?, json_extract(value, '$[1]'),"
                " json_extract(value, '$[2]') FROM json_each(?) WHERE true"
                " ON CONFLICT (id) DO NOTHING",
                (
                    *(columns[i][0] for i in _WORK_COLUMNS[1:]),
                    json.dumps(list(zip(ids, args, contexts, strict=True))),
                ),
            )
            return
        self._executemany(
            tx,
            self._sql(
                _INSERT_WORK + " VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, 0, 0, 0, 0, ?, ?, ?)"
                " ON CONFLICT (id) DO NOTHING"
            ),
            list(zip(*(columns[i] for i in _WORK_COLUMNS), args, contexts, strict=True)),
        )

    def _has_json(self, tx: Tx) -> bool:
        """Whether this SQLite has its JSON functions (built in since 3.38, and in most
        builds before): without them, statements over JSON arrays fall back."""
        if self._json is None:
            try:
                tx.connection.execute("SELECT count(*) FROM json_each('[1]')").fetchone()
                self._json = True
            except sqlite3.OperationalError:
                self._json = False
        return self._json

    # A claim is one statement, the pool's limit and running count in its LIMIT. Its
    # args come from payloads where the row has none ("" when that row is missing,
    # and the worker fails such work as corrupt): read apart, as a subquery in the
    # RETURNING copied each into SQLite's buffer of returned rows (a claim of 50 of
    # 800 KB: 30-42 -> 100-126 ms).
    # The due pending rows a claim takes, within the pool's limit: picked by rowid,
    # which work_due's entries carry, and updated by it (by id each would first
    # descend the id's index). Their rowid is their place.
    _PICK_ROWIDS = (
        "SELECT rowid FROM {s}work WHERE pool = ? AND state = 'pending'"
        " AND due_at <= ? ORDER BY due_at, id LIMIT max(min(?, coalesce((SELECT"
        " max_parallelism FROM {s}pools WHERE name = ?), 0) - (SELECT count(*) FROM"
        " {s}work WHERE pool = ? AND state = 'running')), 0)"
    )
    # How many of the n rows a pick found a claim takes (SqlStore._share), asked only
    # where n is CLAIM_SPLIT_MIN or more but fewer than the claim asked for: all n
    # if the pool's room stopped the pick, else its worker's share. In the write
    # lock, as the pick. Parameters: n, the ask, the pool, n, n, the worker, the
    # pool, now, the pool.
    _SHARE = (
        "SELECT CASE WHEN ? >= min(?, coalesce((SELECT max_parallelism FROM {s}pools"
        " WHERE name = ?), 0) - r.n) THEN ? ELSE"
        f" {SqlStore._share('?', 'r.n', 'r.mine', 'w.live')} END FROM (SELECT count(*) AS n,"
        " count(CASE WHEN worker_id = ? THEN 1 END) AS mine FROM {s}work WHERE pool = ?"
        " AND state = 'running') r, (SELECT max(count(*), 1) AS live FROM {s}workers"
        " WHERE expires_at > ? AND (pools = '' OR instr(',' || pools || ',', ',' || ? || ',')"
        " > 0)) w"
    )
    _PAYLOADS_AND_PLACE = "CASE WHEN on_complete IS NOT NULL THEN context END, args, rowid"
    _SQLITE_CLAIM = SqlStore._CLAIM % (f"rowid IN ({_PICK_ROWIDS})", _PAYLOADS_AND_PLACE)

    # The claim that waits for the COMMIT (_claim_rows), in three statements: the
    # pick as one JSON array and its count, the UPDATE by it, and after the COMMIT
    # the rows.
    _PICK = f"SELECT json_group_array(rowid), count(*) FROM ({_PICK_ROWIDS})"
    _CLAIM_AT = SqlStore._CLAIM.split(" RETURNING")[0] % (
        "rowid IN (SELECT value FROM json_each(?))"
    )
    _CLAIMED = (
        "SELECT "
        + SqlStore._CLAIM.split(" RETURNING ")[1] % _PAYLOADS_AND_PLACE
        + " FROM {s}work WHERE rowid IN (SELECT value FROM json_each(?))"
        " AND state = 'running' AND worker_id = ? AND started_at = ?"
    )

    def _claim_rows(
        self,
        tx: Tx,
        pool: str,
        limit: int,
        worker_id: str,
        now: float,
        *,
        at_commit: bool = False,
    ) -> Callable[[], list[Any]]:
        # Exact global limit: a claim counts the pool's running rows under the write
        # lock, held from that count to the commit, and only claims add running rows,
        # so nobody can raise the count before we commit (completions only lower it).
        params = (worker_id, now, pool, now, limit, pool, pool)
        if limit <= SMALL_CLAIM or not self._has_json(tx):
            # A claim of a few (a slot handed over, a record at a pool's limit) returns
            # its rows itself: a statement in the lock instead of three in all. (Without
            # SQLite's JSON functions every claim goes so, and never splits a burst.)
            if not at_commit:
                rows = self._payloads_of(tx, self.q(tx, self._SQLITE_CLAIM, params).fetchall())
                return lambda: rows
            claimed = tx.defer(self._sql(self._SQLITE_CLAIM), params, rows=True)
            return lambda: self._payloads_of(None, claimed.rows)
        # In the write lock only what must be: the pick (its rowids as one JSON array,
        # one row) and the UPDATE, which returns nothing. The claimed rows are read
        # after the COMMIT, by rowid, as the ones this claim started (this worker,
        # this start time): a row returned costs ~1.5 us in the lock, where the
        # thread also waits for the GIL at each of them (sqlite3 lets it go at every
        # step). Two processes draining no-ops: the claim's part of the write lock
        # 4.3-4.6 -> 3.1 us a job, the drain 71.3k -> 78.6k jobs/s (medians of five
        # alternated pairs), the CPU a job level.
        # Nobody else changes a running row's columns read here but a rescuer, after
        # this worker's lease ran out, and a VACUUM may renumber rowids: a row not
        # found is left to the worker's adoption of orphans, as after a commit whose
        # answer was lost.
        picked: list[str] = []
        reader = tx.raw  # not .connection: that would BEGIN, taking the write lock now

        def claim(conn: sqlite3.Connection) -> None:
            rowids, found = conn.execute(self._sql(self._PICK), params[2:]).fetchone()
            if CLAIM_SPLIT_MIN <= found < limit:
                share = (found, limit, pool, found, found, worker_id, pool, now, pool)
                took = conn.execute(self._sql(self._SHARE), share).fetchone()[0]
                if took < found:
                    rowids, found = json.dumps(json.loads(rowids)[:took]), took
            if found:
                conn.execute(self._sql(self._CLAIM_AT), (worker_id, now, rowids))
                picked.append(rowids)

        if not at_commit:
            claim(tx.connection)
            got = self.q(tx, self._CLAIMED, (picked[0], worker_id, now)) if picked else None
            rows = self._payloads_of(tx, got.fetchall() if got is not None else [])
            return lambda: rows
        self._at_commit(tx, claim)
        read: list[list[Any]] = []

        def answer() -> list[Any]:
            if picked and not read:
                got = reader.execute(self._sql(self._CLAIMED), (picked[0], worker_id, now))
                # Payloads too are read after the COMMIT, outside the write lock:
                # written once at enqueue, they change no more, and go only with their
                # finished row's pruning.
                read.append(self._payloads_of(None, got.fetchall()))
            return read[0] if read else []

        return answer

    def _payloads_of(self, tx: Tx | None, rows: list[Any]) -> list[Any]:
        """Claimed rows with the args (and the context, with a handler) of those
        whose payload is in payloads: read in ``tx``, or (None) in a read transaction
        of its own, opened only when some row's payload is there (over INLINE_CHARS,
        or written before migration 4): a claim of small payloads saves its BEGIN
        and COMMIT."""

        def select(rtx: Tx, ids: list[str]) -> dict[str, tuple[str, str | None]]:
            found: dict[str, tuple[str, str | None]] = {}
            for chunk in self.iter_chunks(ids, IN_CHUNK):
                marks = ", ".join("?" * len(chunk))
                rows = self.q(
                    rtx, f"SELECT id, args, context FROM {{s}}payloads WHERE id IN ({marks})", chunk
                )
                found.update((r[0], (r[1], r[2])) for r in rows.fetchall())
            return found

        def read(ids: list[str]) -> dict[str, tuple[str, str | None]]:
            if tx is not None:
                return select(tx, ids)
            return self.run(lambda rtx: select(rtx, ids), readonly=True)

        return self._with_payloads(rows, read)

    def finish_many(
        self, tx: Tx, items: Sequence[Finishing], now: float, *, at_commit: bool = False
    ) -> None:
        if not items:
            return
        if not self._has_json(tx):
            self._finish_many_by_row(tx, items, now)
            return
        # Copied inside the database. The payload (args, context) stays where it is,
        # for inspection, until the finished row is pruned. One statement each over a
        # JSON array of (id, state, attempt, outcome, result, handler error), texts as
        # JSON strings so that json_extract gives them back exactly.
        rows = json.dumps(
            sorted(
                (f.work.id, f.work.state, f.work.attempt, f.outcome, f.result, f.handler_error)
                for f in items
            )
        )
        matching = (
            " FROM json_each(?) j CROSS JOIN {s}work w ON w.id = json_extract(j.value, '$[0]')"
            " WHERE w.state = json_extract(j.value, '$[1]')"
            " AND w.attempt = json_extract(j.value, '$[2]')"
        )
        # With the COMMIT where nothing reads them before: the write lock is then held
        # for SQL only (see _begin).
        write = tx.defer if at_commit else tx.execute
        write(
            self._sql(
                "INSERT INTO {s}finished (id, pool, fn_name, kind, args, on_complete, outcome,"
                " result, attempts, enqueued_at, finished_at, last_error, handler_error)"
                " SELECT w.id, w.pool, w.fn_name, w.kind, w.args, w.on_complete,"
                " json_extract(j.value, '$[3]'), json_extract(j.value, '$[4]'), w.attempt,"
                " w.enqueued_at, ?, w.last_error, json_extract(j.value, '$[5]')" + matching
            ),
            (now, rows),
        )
        # The rows just copied, found by the copies: an id is finished once, so the
        # ids finished at ``now`` are exactly those (a JSON match again costs twice).
        write(
            self._sql(
                "DELETE FROM {s}work WHERE id IN (SELECT f.id FROM json_each(?) j"
                " CROSS JOIN {s}finished f ON f.id = j.value WHERE f.finished_at = ?)"
            ),
            (json.dumps([f.work.id for f in items]), now),
        )

    def _finish_many_by_row(self, tx: Tx, items: Sequence[Finishing], now: float) -> None:
        self._executemany(
            tx,
            self._sql(
                "INSERT INTO {s}finished (id, pool, fn_name, kind, args, on_complete,"
                " outcome, result, attempts, enqueued_at, finished_at, last_error,"
                " handler_error) SELECT id, pool, fn_name, kind, args, on_complete, ?, ?,"
                " attempt, enqueued_at, ?, last_error, ? FROM {s}work"
                " WHERE id = ? AND state = ? AND attempt = ?"
            ),
            [
                (
                    f.outcome,
                    f.result,
                    now,
                    f.handler_error,
                    f.work.id,
                    f.work.state,
                    f.work.attempt,
                )
                for f in items
            ],
        )
        self._executemany(
            tx,
            self._sql("DELETE FROM {s}work WHERE id = ? AND state = ? AND attempt = ?"),
            [(f.work.id, f.work.state, f.work.attempt) for f in items],
        )

    _FINISHED_COLUMNS = (
        "INSERT INTO {s}finished (id, pool, fn_name, kind, args, on_complete, outcome,"
        " result, attempts, enqueued_at, finished_at, last_error)"
    )
    _FINISH_MANY = (
        _FINISHED_COLUMNS + " SELECT w.id, w.pool, w.fn_name, w.kind, w.args, w.on_complete,"
        " 'success', json_extract(j.value, '$[2]'), w.attempt, w.enqueued_at, ?, w.last_error"
        " FROM json_each(?) j CROSS JOIN {s}work w ON w.id = json_extract(j.value, '$[0]')"
        f" WHERE w.state {RECORDABLE_IN} AND w.attempt = json_extract(j.value, '$[1]')"
        " RETURNING id, attempts"
    )
    # The same where each claim left its row (its rowid, ClaimedWork.place), the id
    # compared there too: one b-tree descent a row instead of two (the id's index,
    # then the table), and the DELETE after it goes by rowid as well. With the claim
    # by rowid, two worker processes draining held the write lock 13.0 -> 11.9 us a
    # job, and drained 71k -> 76k jobs/s (four alternated pairs). It returns
    # nothing (see finish_succeeded): 12.5 -> 12.3 and 14.0 -> 12.9 us a job held,
    # 71.8k -> 76.4k jobs/s (medians of four alternated pairs).
    _FINISH_PLACED = _FINISH_MANY.replace(
        "ON w.id = json_extract(j.value, '$[0]')",
        "ON w.rowid = json_extract(j.value, '$[3]') AND w.id = json_extract(j.value, '$[0]')",
    ).replace(" RETURNING id, attempts", "")
    # finished's rows past a rowid: the ones inserted since it was its last.
    _LAST_FINISHED = "SELECT coalesce(max(rowid), 0) FROM {s}finished"
    _FINISHED_AFTER = "SELECT id, attempts FROM {s}finished WHERE rowid > ?"
    # Rows that the finish just took at their places, in the same transaction.
    _DELETE_AT = "DELETE FROM {s}work WHERE rowid IN (SELECT value FROM json_each(?))"
    _FINISH_ONE = (
        _FINISHED_COLUMNS + " SELECT id, pool, fn_name, kind, args, on_complete, 'success', ?,"
        " attempt, enqueued_at, ?, last_error FROM {s}work WHERE id = ?"
        f" AND state {RECORDABLE_IN} AND attempt = ? RETURNING id, attempts"
    )

    def finish_succeeded(
        self,
        tx: Tx,
        items: Sequence[Succeeded],
        now: float,
        worker_id: str,
        *,
        at_commit: bool = True,
    ) -> Callable[[], list[tuple[str, int]]]:
        if not items:
            return list
        if not self._has_json(tx):
            return self._finish_succeeded_by_row(tx, items, now, worker_id, at_commit)
        # With the COMMIT (at once, when asked), and built before it: a worker's batch
        # then holds the write lock for its SQL alone (see _begin). The copies into
        # finished take the rows still running the attempt, from one JSON array of
        # (id, attempt, result), texts as JSON strings so that json_extract gives them
        # back exactly; the counters and the deletes go by the ids they return, which
        # are all of them but for stale ones: both are ready for that case, made from
        # the batch beforehand.
        batch = [item for item in items if storable([item[0]])]
        taken: list[tuple[str, int]] = []
        planned = _successes(batch, worker_id, now)
        single = len(batch) == 1
        # Where every claim said where it left its row: looked for there first.
        placed = not single and all(item[5] is not None for item in batch)
        places = json.dumps([item[5] for item in batch]) if placed else ""
        by_id = self._sql(self._FINISH_MANY)
        delete = self._sql("DELETE FROM {s}work WHERE id IN (SELECT value FROM json_each(?))")
        if single:
            # One attempt (a pool at its limit hands its slots over one at a time):
            # by its id, without JSON, 74 -> 45 us a transaction in a loop.
            work_id, attempt, result = batch[0][:3]
            sql = self._sql(self._FINISH_ONE)
            params: tuple[Any, ...] = (result, now, work_id, attempt)
            delete = self._sql("DELETE FROM {s}work WHERE id = ?")
        elif placed:
            sql = self._sql(self._FINISH_PLACED)
            params = (now, json.dumps([(*item[:3], item[5]) for item in batch]))
        else:
            sql, params = by_id, (now, json.dumps([item[:3] for item in batch]))

        def settle(conn: sqlite3.Connection) -> None:
            if placed:
                # Counted, not returned (a returned row cost 0.7 us in the write lock):
                # an item takes one row at most, so as many rows as items is all of
                # them. Fewer: the ones this INSERT added, past the table's last rowid
                # before it (new rowids ascend, and the write lock is ours).
                last = conn.execute(self._sql(self._LAST_FINISHED)).fetchone()[0]
                if conn.execute(sql, params).rowcount == len(batch):
                    taken.extend((item[0], item[1]) for item in batch)
                else:
                    after = conn.execute(self._sql(self._FINISHED_AFTER), (last,))
                    taken.extend((row[0], row[1]) for row in after.fetchall())
            else:
                taken.extend((row[0], row[1]) for row in conn.execute(sql, params).fetchall())
            ids, counters = planned
            at_places = placed and len(taken) == len(batch)
            if placed and not at_places:
                # A row not at its place moved (a VACUUM renumbers rowids), or its
                # attempt is stale: the rest are looked for by id, as without places.
                found = {work_id for work_id, _ in taken}
                rest = [item[:3] for item in batch if item[0] not in found]
                taken.extend(
                    (row[0], row[1])
                    for row in conn.execute(by_id, (now, json.dumps(rest))).fetchall()
                )
            if len(taken) < len(batch):  # stale ones among them: count and delete the rest
                if not taken:
                    return
                done = set(taken)
                ids, counters = _successes(
                    [i for i in batch if (i[0], i[1]) in done], worker_id, now
                )
            for counter_sql, counter_params in counters:
                conn.execute(self._sql(counter_sql), counter_params)
            if at_places:
                conn.execute(self._sql(self._DELETE_AT), (places,))
            else:
                conn.execute(delete, (batch[0][0] if single else ids,))

        self._at_commit(tx, settle, at_commit)
        return lambda: taken

    def _at_commit(
        self, tx: Tx, step: Callable[[sqlite3.Connection], None], at_commit: bool = True
    ) -> None:
        """Run ``step`` with the deferred statements, in their order (at once when not
        ``at_commit``, or in a transaction adopted from the caller, as ``Tx.defer``
        does)."""
        if tx.owned and at_commit:
            tx.deferred.append(_Step(step))
        else:
            step(tx.connection)

    def _finish_succeeded_by_row(
        self,
        tx: Tx,
        items: Sequence[Succeeded],
        now: float,
        worker_id: str,
        at_commit: bool,
    ) -> Callable[[], list[tuple[str, int]]]:
        # By (id, attempt): a batch may hold a stale attempt's outcome beside the live one's.
        wanted = {(item[0], item[1]): item[2] for item in items}
        done: list[tuple[str, int]] = []

        def finish(_: sqlite3.Connection) -> None:  # as the JSON path
            live: list[tuple[str, int, str]] = []
            counted: list[tuple[str, float, float]] = []
            for chunk in self.iter_chunks(storable(sorted({i[0] for i in items})), IN_CHUNK):
                marks = ", ".join("?" * len(chunk))
                rows = self.q(
                    tx,
                    f"SELECT id, attempt, pool, started_at, due_at FROM {{s}}work"
                    f" WHERE id IN ({marks}) AND state {RECORDABLE_IN}",
                    chunk,
                ).fetchall()
                rows = [r for r in rows if (r[0], r[1]) in wanted]
                live += [(r[0], r[1], wanted[r[0], r[1]]) for r in rows]
                counted += [r[2:] for r in rows]
            self._count_successes(tx, worker_id, now, counted)
            self._executemany(
                tx,
                self._sql(
                    "INSERT INTO {s}finished (id, pool, fn_name, kind, args, on_complete,"
                    " outcome, result, attempts, enqueued_at, finished_at, last_error)"
                    " SELECT id, pool, fn_name, kind, args, on_complete, 'success', ?, attempt,"
                    " enqueued_at, ?, last_error FROM {s}work WHERE id = ?"
                ),
                [(result, now, work_id) for work_id, _, result in live],
            )
            self._executemany(
                tx,
                self._sql("DELETE FROM {s}work WHERE id = ?"),
                [(work_id,) for work_id, _, _ in live],
            )
            done.extend((work_id, attempt) for work_id, attempt, _ in live)

        self._at_commit(tx, finish, at_commit)
        return lambda: done

    def _count_successes(
        self, tx: Tx, worker_id: str, now: float, rows: Sequence[Sequence[Any]]
    ) -> None:
        """Add successes to the worker's counters, from their (pool, started_at,
        due_at) rows. (PostgreSQL counts them in the finishing statement itself.)"""
        lags: dict[str, list[float]] = {}
        for pool, started_at, due_at in rows:
            lags.setdefault(pool, []).append(max(started_at - due_at, 0.0))
        for pool, values in lags.items():
            self.add_counters(tx, pool, worker_id, minute_of(now), Counters.successes(values))

    def prune(self, tx: Tx, pool: str, before: float, limit: int) -> int:
        ids = self.ids(
            tx,
            "SELECT id FROM {s}finished WHERE pool = ? AND finished_at < ?"
            " ORDER BY finished_at LIMIT ?",
            (pool, before, limit),
        )
        for chunk in self.iter_chunks(ids, IN_CHUNK):
            marks = ", ".join("?" * len(chunk))
            self.q(tx, f"DELETE FROM {{s}}finished WHERE id IN ({marks})", chunk)
            self.q(tx, f"DELETE FROM {{s}}payloads WHERE id IN ({marks})", chunk)
        return len(ids)


def _end(conn: sqlite3.Connection, tx: Tx, commit: bool) -> None:
    """COMMIT after the deferred statements (no round trips to save here), or ROLLBACK."""
    if commit:
        for deferred in tx.deferred:
            if isinstance(deferred, _Step):
                deferred.step(conn)
            else:
                deferred.ran(conn.execute(deferred.sql, deferred.params))
    conn.execute("COMMIT" if commit else "ROLLBACK")


class _Step(Deferred):
    """Python run between deferred statements, inside the write lock: kept to what
    needs their answers (``SqliteStore._at_commit``)."""

    __slots__ = ("step",)

    def __init__(self, step: Callable[[sqlite3.Connection], None]) -> None:
        super().__init__("", (), False)
        self.step = step


def _successes(
    items: Sequence[Succeeded], worker_id: str, now: float
) -> tuple[str, list[tuple[str, tuple[Any, ...]]]]:
    """The ids of finished successes as a JSON array, and the counters statements
    that add them (one per pool), from (id, attempt, result, pool, start lag, place)."""
    lags: dict[str, list[float]] = {}
    for item in items:
        lags.setdefault(item[3], []).append(item[4])
    counters = [
        SqliteStore.counters_upsert(pool, worker_id, minute_of(now), Counters.successes(values))
        for pool, values in lags.items()
    ]
    return json.dumps([item[0] for item in items]), counters


class _VersionProbe(Watcher):
    """Reads ``PRAGMA data_version``, which changes when another connection commits:
    each time the write-ahead log is written (``WalBell``), or every few milliseconds
    where there is no bell."""

    # Waiting costs a read per commit of any connection, even with a bell: the
    # worker waits only while a wake-up can help.
    polls = True

    def __init__(self, conn: sqlite3.Connection, bell: WalBell | None) -> None:
        self.conn = conn
        self.bell = bell
        self.seen = self._version()
        self.changed_at = float("-inf")  # time.monotonic() of the last change seen
        self._interrupted = False

    def _version(self) -> int:
        return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        look_until = float("-inf")  # after a ring: until the commit shows, or this
        while not self._interrupted:
            version = self._version()
            now = time.monotonic()
            if version != self.seen:
                self.seen = version
                self.changed_at = now
                return True
            remaining = deadline - now
            if remaining <= 0:
                return False
            if self.bell is None:
                step = BUSY_POLL_S if now - self.changed_at < BUSY_FOR_S else CHANGE_POLL_S
            elif now - self.changed_at < BUSY_POLL_S or now < look_until:
                # At most one wake-up per BUSY_POLL_S however fast others commit;
                # after a ring, the commit shows once the log is synced and the
                # WAL index updated, which the bell does not hear.
                step = BUSY_POLL_S
            else:
                if self.bell.wait(remaining):
                    look_until = time.monotonic() + RING_LOOK_S
                continue
            time.sleep(min(step, remaining))
        return False

    def interrupt(self) -> None:
        self._interrupted = True
        if self.bell is not None:
            self.bell.interrupt()

    def close(self) -> None:
        self.conn.close()
        if self.bell is not None:
            self.bell.close()
