"""The Store interface: the domain operations every store implements, with their row types."""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar, overload

from workpool.core import histogram
from workpool.core.results import WorkInfo
from workpool.core.retry import DEFAULT_RETRY, RetryBehavior

T = TypeVar("T")
FnKind = Literal["action", "mutation", "query"]
# A success to finish: (id, attempt, result JSON, pool, start lag, ClaimedWork.place,
# ClaimedWork.state).
Succeeded = tuple[str, int, str, str, float, str | int | None, str]


class Tx:
    """An open store transaction, handed to mutations, queries and on_complete handlers.

    ``execute(sql, params)`` goes straight to the driver (``?`` placeholders on
    SQLite, ``%s`` on PostgreSQL) and returns its cursor; ``connection`` is the
    driver connection itself.
    """

    def __init__(
        self,
        connection: Any,
        store: Store,
        *,
        readonly: bool = False,
        begin: str | None = None,
        owned: bool = False,
    ) -> None:
        self.raw = connection
        self.store = store
        self.readonly = readonly
        self.after_commit: list[Callable[[], None]] = []
        # Set by ``Store.run`` when it runs its function again after an error: an
        # earlier try may have committed (a connection lost during COMMIT).
        self.retrying = False
        # A BEGIN not sent yet (PostgreSQL): the store sends it with the first
        # statements it pipelines, or on first use of ``connection``, so a
        # transaction does not spend a round trip on BEGIN alone.
        self.begin = begin
        # Whether the store ends this transaction (not one adopted from the caller):
        # only then can statements wait for the COMMIT (``defer``).
        self.owned = owned
        self.deferred: list[Deferred] = []
        self.depth = 0  # transactions nested in this one (savepoints) now open
        self.pipelined = False  # inside Store.pipeline
        self._held: list[_Held] = []  # ``execute`` calls not sent yet (see there)

    @property
    def connection(self) -> Any:
        """The driver connection, in the transaction (any pending BEGIN is sent first)."""
        self.send_held()
        if self.begin is not None:
            self.store.send_begin(self)
        return self.raw

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        """Run a statement; its cursor.

        Inside a pipeline (the completer's optimistic pass over on_complete
        handlers on PostgreSQL) the statement is held back and its cursor made when
        first used. Statements whose cursors nobody holds any more when they are
        sent go, where one text follows another, as one ``executemany``: a handler's
        INSERT cost psycopg 35-40 us of CPU as its own ``execute`` in a pipeline, 16
        as a row of an ``executemany``. Their errors surface at a later statement,
        as anything in a pipeline does, and the completer redoes such a pass with a
        savepoint per handler, outside any pipeline.
        """
        if not self.pipelined:
            return self.connection.execute(sql, params)
        held = _Held(sql, params)
        self._held.append(held)
        cursor = HeldCursor(self, held)
        held.user = weakref.ref(cursor)
        return cursor

    def send_held(self, upto: _Held | None = None) -> None:
        """Send the statements ``execute`` held back, in order (only those up to and
        including ``upto``, if given)."""
        if upto is not None and upto not in self._held:
            raise RuntimeError("this cursor's transaction ended before the cursor was used")
        cut = len(self._held) if upto is None else self._held.index(upto) + 1
        held, self._held = self._held[:cut], self._held[cut:]
        i = 0
        while i < len(held):
            first = held[i]
            if first.user() is not None:  # its cursor may still be read: a cursor of its own
                first.cursor = self.raw.execute(first.sql, first.params)
                i += 1
                continue
            j = i + 1
            while j < len(held) and held[j].sql == first.sql and held[j].user() is None:
                j += 1
            if j == i + 1:
                self.raw.execute(first.sql, first.params)
            else:
                self.store.send_rows(self.raw, first.sql, [h.params for h in held[i:j]])
            i = j

    def drop_held(self) -> None:
        """Forget the statements held back (their transaction is rolling back)."""
        self._held = []

    def defer(
        self,
        sql: str,
        params: Sequence[Any] = (),
        *,
        rows: bool = False,
        alone: bool = False,
        role: str | None = None,
    ) -> Deferred:
        """Run a statement just before COMMIT (PostgreSQL sends them with the COMMIT
        in one round trip); at once in a transaction adopted from the caller, whose
        COMMIT the store does not send. ``rows``: keep what it returns, for reading
        once the transaction has committed (``Deferred.rows``). ``alone``: when it is
        the transaction's only statement, it may run as a transaction of its own.
        ``role``: which of the store's statements it is, for a store that runs a
        known sequence of them as one (``Deferred.role``)."""
        deferred = Deferred(sql, params, rows, alone, role)
        if self.owned:
            self.deferred.append(deferred)
        else:
            deferred.ran(self.execute(sql, params))
        return deferred


class _Held:
    """A statement ``Tx.execute`` has not sent yet."""

    __slots__ = ("cursor", "params", "sql", "user")

    def __init__(self, sql: str, params: Sequence[Any] | dict[str, Any]) -> None:
        self.sql = sql
        self.params = params
        self.cursor: Any = None
        self.user: Callable[[], HeldCursor | None] = lambda: None


class HeldCursor:
    """What ``Tx.execute`` returns for a statement it held back: the driver's cursor
    for it, which it makes by sending the statement (and the ones before it) as soon
    as anything of it is used."""

    __slots__ = ("__weakref__", "_held", "_tx")

    def __init__(self, tx: Tx, held: _Held) -> None:
        self._tx = tx
        self._held = held

    def _cursor(self) -> Any:
        if self._held.cursor is None:
            self._tx.send_held(upto=self._held)
        return self._held.cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor(), name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cursor())

    def __enter__(self) -> Any:
        return self._cursor().__enter__()

    def __exit__(self, *exc: object) -> Any:
        return self._cursor().__exit__(*exc)


class Deferred:
    """A statement that waits for its transaction's COMMIT (``Tx.defer``)."""

    __slots__ = ("_rows", "alone", "keep", "params", "role", "sql")

    def __init__(
        self,
        sql: str,
        params: Sequence[Any],
        keep: bool,
        alone: bool = False,
        role: str | None = None,
    ) -> None:
        self.sql = sql
        self.params = params
        self.keep = keep
        # It may run as a transaction of its own when it is its transaction's only
        # statement (PostgreSQL then sends neither BEGIN nor COMMIT).
        self.alone = alone
        # A transaction of exactly a finish of successes and then a claim runs on
        # PostgreSQL as one call of a server function, which does both.
        self.role = role
        self._rows: list[Any] | None = None

    def ran(self, cursor: Any) -> None:
        """The statement ran with ``cursor`` (its results already received)."""
        if self.keep:
            self._rows = list(cursor.fetchall())

    def took(self, rows: list[Any]) -> None:
        """The statement's work was done by another that returned its ``rows``."""
        if self.keep:
            self._rows = rows

    @property
    def rows(self) -> list[Any]:
        """What the statement returned; only once it ran (the COMMIT was sent)."""
        if self._rows is None:
            raise RuntimeError(f"{self.sql[:60]!r}... has not run: read its rows after COMMIT")
        return self._rows


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A pool's stored config; written by ``app.pool``/``configure``, read by workers."""

    name: str
    max_parallelism: int = 10
    retry_actions_by_default: bool = False
    default_retry: RetryBehavior = DEFAULT_RETRY
    log_level: str = "REPORT"
    status_ttl: float = 86_400.0
    paused_from: int | None = None  # the limit before a pause(); resume() restores it


# Not frozen, like ClaimedWork: treat it as read-only.
@dataclass(slots=True)
class NewWork:
    id: str
    pool: str
    kind: FnKind
    fn_name: str
    args: str  # JSON
    on_complete: str | None
    context: str | None  # JSON
    retry: RetryBehavior | None
    timeout: float | None
    due_at: float
    enqueued_at: float


@dataclass(slots=True)
class NewBatch(Sequence[NewWork]):
    """New work items alike in all but their ids and args (``args[i]`` goes with
    ``ids[i]``): what one enqueue call makes, kept by column. The stores insert it
    from its columns: building a NewWork per item, which they took apart again, was
    1.7 of the 13-15 us that a batch enqueue on SQLite cost an item."""

    ids: Sequence[str]
    args: Sequence[str]  # JSON
    pool: str
    kind: FnKind
    fn_name: str
    on_complete: str | None
    context: str | None  # JSON
    retry: RetryBehavior | None
    timeout: float | None
    due_at: float
    enqueued_at: float

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> NewWork: ...

    @overload
    def __getitem__(self, index: slice) -> NewBatch: ...

    def __getitem__(self, index: int | slice) -> NewWork | NewBatch:
        if isinstance(index, slice):
            return replace(self, ids=self.ids[index], args=self.args[index])
        return NewWork(
            self.ids[index],
            self.pool,
            self.kind,
            self.fn_name,
            self.args[index],
            self.on_complete,
            self.context,
            self.retry,
            self.timeout,
            self.due_at,
            self.enqueued_at,
        )


# ClaimedWork.state of an attempt whose hand-over (``end_attempt`` and a claim) may
# have committed or not: a COMMIT whose reply was lost with its connection.
UNSURE = "unsure"


# Not frozen: one is built per claimed attempt, and a frozen dataclass's __init__
# costs 2.5 us more (object.__setattr__ per field). Treat it as read-only.
@dataclass(slots=True)
class ClaimedWork:
    """One attempt handed to a worker by ``claim``."""

    id: str
    pool: str
    kind: FnKind
    fn_name: str
    args: str
    attempt: int
    timeout: float | None
    due_at: float  # when the attempt became due: start lag = started_at - due_at
    started_at: float
    # Read with the claim, so that the completer runs a success's handler without
    # reading its row again; the stored context only with a handler.
    on_complete: str | None = None
    context: str | None = None
    # Where the claim left the row (PostgreSQL: its ctid as text; SQLite: its
    # rowid), for the finish of a success to find it without an index lookup; None
    # where the store has none.
    place: str | int | None = None
    # "running", or "ended" once ``Store.end_attempt`` gave its slot back before its
    # outcome was recorded: the state its record's compare-and-set expects. UNSURE
    # when a hand-over cannot tell which: its record reads the row to find out.
    state: str = "running"


# Not frozen: a frozen dataclass's __init__ sets each field through
# object.__setattr__, 1.2 us for these 18 against 0.14, once per row that a
# completer, rescuer or canceller reads under lock. Treat it as read-only.
@dataclass(slots=True)
class ActiveWork:
    """An active (not finished) work row, read under lock inside a write transaction."""

    id: str
    pool: str
    kind: FnKind
    fn_name: str
    state: str
    attempt: int
    retry: RetryBehavior | None
    on_complete: str | None
    context: str | None
    cancel_requested: bool
    enqueued_at: float
    due_at: float
    result: str | None  # JSON of the fixed result while completing
    handler_failures: int
    lost_count: int
    last_error: str | None
    worker_id: str | None
    started_at: float | None


@dataclass(slots=True)  # per item, as ActiveWork: treat as read-only
class Finishing:
    """``work`` (locked, checked) becomes finished with ``result`` (JSON)."""

    work: ActiveWork
    outcome: str  # success | failed | canceled
    result: str
    handler_error: str | None = None


@dataclass(slots=True)  # per item, as ActiveWork: treat as read-only
class Retrying:
    """``work`` (running, locked) goes back to pending until ``due_at``."""

    work: ActiveWork
    due_at: float
    error: str
    lost: bool = False


@dataclass(slots=True)  # per item, as ActiveWork: treat as read-only
class Handing:
    """``work`` becomes completing: its on_complete is (re)tried at ``due_at``."""

    work: ActiveWork
    result: str
    due_at: float
    failures: int
    error: str


@dataclass(frozen=True, slots=True)
class ActiveStatus:
    """The columns of an active row that ``status`` answers from, and no more: with
    the whole row (18 columns) a ``status()`` took 0.255 ms on PostgreSQL and 0.0226
    on SQLite, with these 0.208 and 0.0205 (200 ids on a 10k backlog, medians of
    alternated runs)."""

    pool: str
    state: str
    attempt: int
    due_at: float
    last_error: str | None
    started_at: float | None


@dataclass(frozen=True, slots=True)
class FinishedRow:
    result: str  # JSON
    handler_error: str | None


@dataclass(frozen=True, slots=True)
class StatusRow:
    """What ``status`` needs: the active row, else the finished row, else neither.
    For a pending row, ``occupancy``: its pool's running attempts and stored
    max_parallelism (None: no config), read with it."""

    active: ActiveStatus | None = None
    finished: FinishedRow | None = None
    occupancy: tuple[int, int | None] | None = None


@dataclass(frozen=True, slots=True)
class Upkeep:
    """What the hot table needs now (``Store.upkeep``, one cheap read)."""

    analyze: bool = False  # the planner's statistics no longer describe it
    vacuum: bool = False  # scans walk past many dead index entries of moved-on rows


@dataclass(frozen=True, slots=True)
class PoolCounts:
    running: int = 0
    due: int = 0  # backlog: due now, not started
    scheduled: int = 0  # pending with a future due time (first start or retry)
    completing: int = 0
    finished: int = 0


def minute_of(now: float) -> int:
    """The counters bucket of time ``now``: counters are kept per worker and minute."""
    return int(now // 60)


@dataclass(frozen=True, slots=True)
class Counters:
    """Completion counters of a window, summed over workers."""

    completed: int = 0
    succeeded: int = 0
    failed: int = 0
    retries: int = 0
    canceled: int = 0
    lag_count: int = 0
    lag_sum: float = 0.0
    lag_max: float = 0.0
    lag_hist: tuple[int, ...] = histogram.EMPTY  # counts per histogram.LAG_BOUNDS bucket

    @classmethod
    def successes(cls, lags: Sequence[float]) -> Counters:
        """``len(lags)`` attempts that succeeded, with these start lags."""
        hist = [0] * len(histogram.LAG_BOUNDS)
        for lag in lags:
            hist[histogram.bucket(lag)] += 1
        n = len(lags)
        return cls(n, n, 0, 0, 0, n, sum(lags), max(lags, default=0.0), tuple(hist))

    def __add__(self, other: Counters) -> Counters:
        return Counters(
            self.completed + other.completed,
            self.succeeded + other.succeeded,
            self.failed + other.failed,
            self.retries + other.retries,
            self.canceled + other.canceled,
            self.lag_count + other.lag_count,
            self.lag_sum + other.lag_sum,
            max(self.lag_max, other.lag_max),
            histogram.add(self.lag_hist, other.lag_hist),
        )


@dataclass(slots=True)
class WorkerInfo:
    id: str
    host: str
    pid: int
    pools: list[str] = field(default_factory=list)


class Watcher(abc.ABC):
    """Wakes a worker when another connection commits (notification or cheap probe)."""

    # Whether waiting costs CPU (a probe read every few milliseconds), not just a
    # blocked read of a socket: then the worker waits only while a wake-up can help.
    polls = False

    @abc.abstractmethod
    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for a change; True if one was (or may have been) seen."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """The worker stops: a wait in progress (in another thread) returns False soon,
        and every later one at once."""

    @abc.abstractmethod
    def close(self) -> None: ...


class WouldWait(Exception):
    """A write begun inside ``Store.without_waiting`` met a lock held elsewhere (or
    a conflict to retry later): nothing was written, and the caller runs it again
    where it may wait."""


class Store(abc.ABC):
    """Domain operations over the database; every state change is a compare-and-set."""

    url: str
    # Whether a savepoint costs round trips to the server: then the queries of one
    # batch share a read_only block instead of taking a savepoint each.
    savepoints_cost: bool = False

    # --- lifecycle and transactions -------------------------------------------------
    @abc.abstractmethod
    def migrate(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # Whether statements sent in a pipeline run on the server while the client goes
    # on (PostgreSQL): a big enqueue then builds each chunk while the one before is
    # inserted (the benchmark's batches of 1,000: 80-89k -> 108-111k jobs/s).
    streams_inserts: bool = False

    # Whether small writes of concurrent threads gain from sharing a transaction
    # (see Combiner): where writers take turns on one lock (SQLite), N single
    # enqueues from N threads then take about one turn and one commit, not N. On
    # PostgreSQL they run side by side on their own connections, and the server
    # flushes concurrent commits together: sharing took that parallelism away
    # (4 threads: 3.2k -> 2.6k calls/s).
    combines_writes: bool = False

    # Whether a short write, when nothing holds what it needs, ends without waiting
    # for the disk or the network (SQLite in WAL mode, commits not synced): then an
    # ``_async`` enqueue may run it on the event loop's thread (``without_waiting``)
    # instead of handing it to a worker thread and back, two wake-ups that cost
    # more than the write (a single enqueue: 0.1 ms, the hand-off 0.2 ms).
    writes_without_waiting: bool = False

    # How many attempts a worker claims from a pool, and how many outcomes it
    # records, in one transaction: each commit (and on PostgreSQL each turn at a
    # pool's claim lock) is shared by that many jobs. A worker's concurrency caps
    # both. On SQLite a bigger transaction holds the one write lock longer: 1,024
    # drained no faster, 2,048 slowed the on_complete drain.
    worker_batch: int = 512

    # A claim takes a lock that every writer needs (SQLite's single write lock), so
    # a worker whose last claim found nothing reads claimable() before the next.
    look_before_claim: bool = False

    @abc.abstractmethod
    def transaction(
        self, *, readonly: bool = False, snapshot: bool = True
    ) -> AbstractContextManager[Tx]:
        """One transaction; commits on normal exit, rolls back on an exception.

        ``snapshot=False`` (with ``readonly``) is for workpool's own reads whose
        statements need nothing in common: on PostgreSQL each statement then runs
        on its own, without BEGIN READ ONLY and COMMIT (a round trip fewer; under
        READ COMMITTED, statements in a transaction take a snapshot each anyway).
        Never for user code: a query must keep its read-only guard.
        """

    @abc.abstractmethod
    def in_transaction(self) -> bool:
        """Whether the calling thread has a transaction of this store open."""

    def without_waiting(self) -> AbstractContextManager[None]:
        """Inside it, a write of the calling thread that would wait for a lock held
        elsewhere, or retry after a conflict, raises ``WouldWait`` instead, having
        written nothing. Only where ``writes_without_waiting``."""
        raise NotImplementedError(f"{type(self).__name__} writes may wait")

    def may_wait(self) -> bool:
        """False inside ``without_waiting`` on the calling thread."""
        return True

    @abc.abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """A conflict that retrying the whole transaction resolves (busy, serialization)."""

    def is_database_error(self, exc: BaseException) -> bool:
        """An error the database reported (inside ``pipeline`` it may belong to an
        earlier statement than the one whose result was being read)."""
        return False

    @abc.abstractmethod
    def run(
        self,
        fn: Callable[[Tx], T],
        *,
        readonly: bool = False,
        snapshot: bool = True,
        retrying: bool = False,
    ) -> T:
        """Run ``fn`` in a transaction (see ``transaction``), retrying the whole of it
        on transient conflicts. ``retrying``: an earlier try, elsewhere, may have
        committed (``Tx.retrying`` from the first try on)."""

    async def run_async(self, fn: Callable[[Tx], T]) -> T:
        """``run`` for a write that is one statement waiting for its COMMIT
        (``Tx.defer``, ``alone``), sent from the event loop with no thread.
        ``WouldWait``, having sent nothing, where the store has no such path or
        ``fn`` needs more. Only once the schema is migrated."""
        raise WouldWait(f"{type(self).__name__} sends nothing from the event loop")

    @abc.abstractmethod
    def savepoint(self, tx: Tx, *, keep: bool = True) -> AbstractContextManager[None]:
        """A nested scope: an exception inside rolls back only what it wrote.

        ``keep=False`` rolls its writes back on a normal exit too (queries).
        """

    def read_only(self, tx: Tx) -> AbstractContextManager[None]:
        """A savepoint rolled back at its end, in which writes fail: one for several
        queries, where ``savepoints_cost``. Refusing writes is what keeps each query
        from seeing another's, so a store that sets ``savepoints_cost`` provides it."""
        raise NotImplementedError(f"{type(self).__name__} sets savepoints_cost: it refuses writes")

    def send_begin(self, tx: Tx) -> None:
        """Send ``tx``'s pending BEGIN (``Tx.begin``) on its own."""
        assert tx.begin is not None
        tx.raw.execute(tx.begin)
        tx.begin = None

    def send_rows(self, connection: Any, sql: str, rows: list[Any]) -> None:
        """Send one statement text with each of ``rows`` of parameters, inside
        ``pipeline`` (statements that ``Tx.execute`` held back, whose cursors nobody
        holds): what they return is never read."""
        connection.cursor().executemany(sql, rows)

    def pipeline(self, tx: Tx) -> AbstractContextManager[Any]:
        """Send statements without waiting for each answer.

        Inside, a round trip happens only when a result is read, and a statement's
        error may surface there, at a later statement, rather than at its own. User
        code runs inside only where a database error anywhere in the block is
        answered by redoing the whole transaction without it (the completer's
        optimistic pass over on_complete handlers).
        """
        return nullcontext()

    @abc.abstractmethod
    def adopt(self, connection: Any) -> Tx | None:
        """A Tx over a user's own driver connection, or None if it is not one of ours."""

    @abc.abstractmethod
    def watcher(self) -> Watcher:
        """A new change watcher, owned by one thread (one per worker)."""

    @abc.abstractmethod
    def notify(self, tx: Tx, pools: Sequence[str]) -> None:
        """Wake idle workers of ``pools`` once ``tx`` commits."""

    # --- pools ------------------------------------------------------------------------
    @abc.abstractmethod
    def load_pool(self, tx: Tx, name: str) -> PoolConfig | None: ...

    @abc.abstractmethod
    def load_pools(self, tx: Tx) -> list[PoolConfig]: ...

    def load_pools_later(self, tx: Tx) -> Callable[[], list[PoolConfig]]:
        """``load_pools``, answered when the result is called after ``tx`` committed
        (PostgreSQL reads it with the COMMIT)."""
        pools = self.load_pools(tx)
        return lambda: pools

    @abc.abstractmethod
    def save_pool(self, tx: Tx, config: PoolConfig) -> None: ...

    @abc.abstractmethod
    def take_turn(self, tx: Tx, pool: str, duty: str, now: float, every: float) -> bool:
        """Claim a periodic duty (report, prune) for ``pool``: True for one caller per period."""

    @abc.abstractmethod
    def set_turn(self, tx: Tx, pool: str, duty: str, at: float) -> None:
        """Make ``pool``'s ``duty`` due again at ``at``, whoever took its last turn."""

    @abc.abstractmethod
    def duty_times(self, tx: Tx) -> dict[tuple[str, str], float]:
        """When each (pool, duty) is next due, as ``take_turn`` left it; one read for
        all pools, so that only the due turns cost a write transaction."""

    def duty_times_later(self, tx: Tx) -> Callable[[], dict[tuple[str, str], float]]:
        """``duty_times``, answered when the result is called after ``tx`` committed
        (PostgreSQL reads it with the COMMIT, with the transaction's other such reads)."""
        times = self.duty_times(tx)
        return lambda: times

    # --- work -------------------------------------------------------------------------
    @abc.abstractmethod
    def insert_work(self, tx: Tx, items: Sequence[NewWork], *, at_commit: bool = False) -> None:
        """Insert new pending work. ``at_commit``: nothing in ``tx`` reads these rows
        back, so the store may send the insert with the COMMIT (``Tx.defer``)."""

    def insert_work_if(
        self,
        tx: Tx,
        items: Sequence[NewWork],
        config: PoolConfig,
        *,
        notify: bool = False,
        at_commit: bool = True,
    ) -> Callable[[], bool]:
        """``insert_work``, only if the pool's stored config is still ``config`` (the
        one the items were made with). ``at_commit``: with the COMMIT, and whether it
        was answered after it; else at once, for what the transaction does next.
        ``notify``: then also wake the pool's workers (``notify``). PostgreSQL checks,
        inserts and notifies in one statement: an enqueue whose caller knows the
        config is one statement (alone, a transaction of its own)."""
        ok = self.pool_unchanged(tx, config)
        if ok:
            self.insert_work(tx, items, at_commit=at_commit)
            if notify:
                self.notify(tx, [config.name])
        return lambda: ok

    @abc.abstractmethod
    def pool_unchanged(self, tx: Tx, config: PoolConfig) -> bool:
        """Whether the pool's stored config is ``config``."""

    @abc.abstractmethod
    def claim(self, tx: Tx, pool: str, limit: int, worker_id: str, now: float) -> list[ClaimedWork]:
        """Start up to ``limit`` due attempts without exceeding the pool's stored
        ``max_parallelism`` globally (read under the pool's claim lock)."""

    def claim_later(
        self, tx: Tx, pool: str, limit: int, worker_id: str, now: float
    ) -> Callable[[], list[ClaimedWork]]:
        """``claim``, answered when the returned function is called after ``tx``
        committed. PostgreSQL claims with the COMMIT, in its round trip, so the claim
        lock is held for no round trip at all."""
        claimed = self.claim(tx, pool, limit, worker_id, now)
        return lambda: claimed

    def claim_many_later(
        self, tx: Tx, asks: Mapping[str, int], worker_id: str, now: float
    ) -> Callable[[], dict[str, list[ClaimedWork]]]:
        """``claim_later`` for each pool in ``asks`` (pool: limit), the pools' claim
        locks taken in sorted order; answered per pool after ``tx`` committed."""
        claims = [(p, self.claim_later(tx, p, n, worker_id, now)) for p, n in sorted(asks.items())]
        return lambda: {p: later() for p, later in claims}

    def claim_cut(self, claimed: Sequence[ClaimedWork]) -> bool:
        """Whether a claim that gave fewer rows than asked may have been stopped by
        the store's limit on the bytes of args a claim reads (``claimed`` is what it
        gave), not by a lack of due work: then the pool may have more."""
        return False

    @abc.abstractmethod
    def load_for_update(self, tx: Tx, work_id: str) -> ActiveWork | None:
        """The active row, locked against concurrent completers until ``tx`` ends."""

    @abc.abstractmethod
    def claim_rooms(self, tx: Tx, pools: Sequence[str] | None, now: float) -> dict[str, int]:
        """The pools among ``pools`` (None: all) that are not paused and have due work,
        each with its free slots (``max_parallelism`` minus running, maybe <= 0): one
        read that tells a worker of many pools which claims could get work."""

    @abc.abstractmethod
    def claimable(self, tx: Tx, pools: Sequence[str] | None, now: float) -> bool:
        """Whether a claim in one of ``pools`` (None: all) would get work now: a cheap
        read that lets a worker skip the claim lock while its pools are full."""

    def claimable_later(
        self, tx: Tx, pools: Sequence[str] | None, now: float
    ) -> Callable[[], bool]:
        """``claimable``, answered after ``tx`` committed (as ``duty_times_later``)."""
        found = self.claimable(tx, pools, now)
        return lambda: found

    @abc.abstractmethod
    def end_attempt(self, tx: Tx, work: ClaimedWork) -> Callable[[], ClaimedWork | None]:
        """running -> ended for ``work``'s attempt (CAS on attempt), with the COMMIT:
        its slot is free for a claim in ``tx`` while its outcome waits to be recorded.
        Answered after the COMMIT: ``work`` as its record must find it (state and
        place), or None if the attempt was no longer running."""

    @abc.abstractmethod
    def finish_many(
        self, tx: Tx, items: Sequence[Finishing], now: float, *, at_commit: bool = False
    ) -> None:
        """running|ended|completing|pending -> finished: delete the work row, insert the
        result. ``at_commit`` here and below: nothing in ``tx`` reads these rows
        again, so the store may send the writes with the COMMIT (``Tx.defer``)."""

    @abc.abstractmethod
    def finish_succeeded(
        self,
        tx: Tx,
        items: Sequence[Succeeded],
        now: float,
        worker_id: str,
        *,
        at_commit: bool = True,
    ) -> Callable[[], list[tuple[str, int]]]:
        """running|ended -> finished for ``Succeeded`` items without reading the rows
        first, each counted as a success with its start lag in
        ``worker_id``'s counters of the minute. The result gives the (id, attempt)
        pairs that were still running that attempt (the others are stale, and not
        counted). ``at_commit`` (the default): the statements wait for the COMMIT
        (``Tx.defer``), and the result may be called only after it; False: they run
        at once, and the result may be called at once, inside ``tx``, whose later
        statements find those rows finished."""

    @abc.abstractmethod
    def retry_many(self, tx: Tx, items: Sequence[Retrying], *, at_commit: bool = False) -> None:
        """running|ended -> pending at each item's due time (CAS on state and attempt)."""

    @abc.abstractmethod
    def hand_many(self, tx: Tx, items: Sequence[Handing], *, at_commit: bool = False) -> None:
        """running|ended|pending|completing -> completing (CAS on state and attempt)."""

    @abc.abstractmethod
    def load_many_for_update(self, tx: Tx, ids: Sequence[str]) -> dict[str, ActiveWork]:
        """Active rows by id, locked against concurrent completers until ``tx`` ends."""

    @abc.abstractmethod
    def due_handlers(
        self, tx: Tx, pools: Sequence[str], now: float, limit: int
    ) -> list[ActiveWork]:
        """Completing work whose on_complete is due, locked (others skip it)."""

    @abc.abstractmethod
    def lost_work(self, tx: Tx, pools: Sequence[str], now: float, limit: int) -> list[ActiveWork]:
        """Running (or ended) work whose worker's lease expired, locked (others skip it)."""

    @abc.abstractmethod
    def work_info(self, tx: Tx, work_id: str) -> WorkInfo | None:
        """Everything about one item, active or finished."""

    @abc.abstractmethod
    def recent_failures(self, tx: Tx, pool: str, limit: int) -> list[WorkInfo]:
        """The newest finished items of ``pool`` whose result is Failed."""

    @abc.abstractmethod
    def history(self, tx: Tx, pool: str, since_bucket: int) -> list[tuple[int, Counters]]:
        """Counters per minute bucket from ``since_bucket`` on, summed over workers."""

    @abc.abstractmethod
    def maintenance_due(
        self, tx: Tx, pools: Sequence[str], now: float, *, lost: bool = True, within: float = 0.0
    ) -> tuple[bool, float | None]:
        """(any lost work, when the earliest handler retry due by ``now + within``
        is due, or None) in ``pools``: a read, no locks.

        ``lost=False`` skips the first question (answered False): it reads every
        running row, while the second reads only the handler retries due by then.
        """

    def maintenance_due_later(
        self, tx: Tx, pools: Sequence[str], now: float, *, lost: bool = True, within: float = 0.0
    ) -> Callable[[], tuple[bool, float | None]]:
        """``maintenance_due``, answered after ``tx`` committed (as ``duty_times_later``)."""
        due = self.maintenance_due(tx, pools, now, lost=lost, within=within)
        return lambda: due

    @abc.abstractmethod
    def running_of(
        self, tx: Tx, worker_id: str, pools: Sequence[str]
    ) -> list[tuple[str, int, float]]:
        """(id, attempt, started_at) of every running (or ended) attempt of ``pools``
        claimed by ``worker_id``: the pools let it read those rows only, not the
        backlog."""

    def running_of_later(
        self, tx: Tx, worker_id: str, pools: Sequence[str]
    ) -> Callable[[], list[tuple[str, int, float]]]:
        """``running_of``, answered after ``tx`` committed (as ``duty_times_later``)."""
        rows = self.running_of(tx, worker_id, pools)
        return lambda: rows

    @abc.abstractmethod
    def flag_cancel(self, tx: Tx, work: ActiveWork) -> bool:
        """Mark running (or ended) work canceled: it finishes, but is not retried (CAS
        on state and attempt)."""

    @abc.abstractmethod
    def cancelable_ids(self, tx: Tx, pool: str, before: float, limit: int) -> list[str]: ...

    @abc.abstractmethod
    def statuses(self, tx: Tx, ids: Sequence[str]) -> dict[str, StatusRow]: ...

    @abc.abstractmethod
    def prune(self, tx: Tx, pool: str, before: float, limit: int) -> int:
        """Delete up to ``limit`` finished rows of ``pool`` older than ``before``."""

    # --- workers, counters, introspection ---------------------------------------------
    @abc.abstractmethod
    def tidy(self, *, quick: bool = False) -> None:
        """Housekeeping of the hot table between transactions (PostgreSQL: VACUUM;
        ``quick``: only what ``Upkeep.vacuum`` asks for, between the full ones)."""

    @abc.abstractmethod
    def upkeep(self) -> Upkeep:
        """What the hot table needs (PostgreSQL: see ``PostgresStore.upkeep``):
        ``analyze`` refreshes its statistics, ``tidy`` clears its dead entries."""

    def upkeep_later(self, tx: Tx) -> Callable[[], Upkeep]:
        """``upkeep``, answered after ``tx`` committed (as ``duty_times_later``)."""
        need = self.upkeep()
        return lambda: need

    @abc.abstractmethod
    def analyze(self) -> None:
        """Refresh the planner's statistics of the hot table."""

    def batch_writes(self) -> AbstractContextManager[None]:
        """Within it, the calling thread's write transactions are a worker's claims
        and records: few, each long enough that waiting for a write lock by watching
        for its holder's commit pays (SQLite: see ``SqliteStore._begin_immediate``).
        Writers of one short transaction each would all wake at every commit."""
        return nullcontext()

    def checkpoint(self) -> None:  # noqa: B027 - a duty only some stores have
        """Copy what other connections committed to the store's write-ahead log into
        the database file (SQLite), off the threads that claim and complete; a
        worker calls it a few times a second. PostgreSQL checkpoints on its own."""

    @abc.abstractmethod
    def heartbeat(self, tx: Tx, worker: WorkerInfo, now: float, expires_at: float) -> None: ...

    @abc.abstractmethod
    def live_workers(self, tx: Tx, now: float) -> list[list[str]]:
        """The pools each worker whose lease has not run out serves (empty: all)."""

    def live_workers_later(self, tx: Tx, now: float) -> Callable[[], list[list[str]]]:
        """``live_workers``, answered after ``tx`` committed (as ``duty_times_later``)."""
        workers = self.live_workers(tx, now)
        return lambda: workers

    @abc.abstractmethod
    def remove_worker(self, tx: Tx, worker_id: str) -> None: ...

    @abc.abstractmethod
    def forget_dead_workers(self, tx: Tx, now: float) -> int: ...

    @abc.abstractmethod
    def add_counters(
        self, tx: Tx, pool: str, worker_id: str, bucket: int, counters: Counters
    ) -> None: ...

    @abc.abstractmethod
    def read_counters(self, tx: Tx, pool: str, since_bucket: int) -> Counters: ...

    @abc.abstractmethod
    def prune_counters(self, tx: Tx, pool: str, before_bucket: int) -> int: ...

    @abc.abstractmethod
    def pool_counts(self, tx: Tx, pool: str, now: float) -> PoolCounts: ...

    @abc.abstractmethod
    def active_count(self, tx: Tx, pools: Sequence[str]) -> int: ...

    @abc.abstractmethod
    def next_due(self, tx: Tx, pools: Sequence[str], after: float) -> float | None:
        """The earliest time after ``after`` at which work of ``pools`` falls due."""

    def iter_chunks(self, items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
        for start in range(0, len(items), size):
            yield items[start : start + size]
