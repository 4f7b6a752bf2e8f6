"""The SQL both stores share: queries written once, with declared dialect hooks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Any, ClassVar, Generic, NamedTuple

from workpool.core.errors import StoreError, StoreUnavailableError
from workpool.core.retry import RetryBehavior
from workpool.store.base import (
    ActiveWork,
    ClaimedWork,
    Handing,
    NewBatch,
    NewWork,
    PoolConfig,
    Retrying,
    Store,
    T,
    Tx,
    WorkerInfo,
    WouldWait,
)
from workpool.store.sql_reads import (
    ACTIVE_COLUMNS,
    IN_CHUNK,
    RECORDABLE_IN,
    SqlReads,
    active_row,
    storable,
)

NEXT_DUE_CHUNK = 100  # pools per next_due statement: two terms each, SQLite allows 500
# A claim that finds fewer due rows than it may take, but at least this many, takes
# its worker's share of them (``SqlStore._share``). Below it, a claim takes all: a few rows
# split would save less than the other workers' claims of them cost.
CLAIM_SPLIT_MIN = 128


def _retry_json(retry: RetryBehavior | None) -> str | None:
    return None if retry is None else json.dumps(retry.to_json())


def check_schema(found: int, known: int) -> None:
    """Refuse a store that a newer workpool has migrated past the ``known`` schemas:
    its rows may be laid out in a way this version would misread."""
    if found > known:
        raise StoreError(
            f"the store is at schema {found}, newer than this workpool knows ({known}):"
            " a newer version migrated it; upgrade workpool here"
        )


class Read(NamedTuple, Generic[T]):
    """A read of the store's: its SQL (``SqlStore._sql``'s template), parameters, and
    what makes its answer of its rows. Asked now (``SqlStore._read``) or with the
    COMMIT (``SqlStore._read_later``)."""

    template: str
    params: Sequence[Any]
    parse: Callable[[list[Any]], T]


class SqlStore(SqlReads, Store):
    """Store operations in portable SQL; subclasses supply connections and the hooks below.

    Queries are written with ``?`` placeholders and ``{s}`` before table names;
    ``_sql`` adapts them to the dialect once and caches the result.
    """

    param: ClassVar[str] = "?"
    for_update: ClassVar[str] = ""  # row lock on a read inside a write transaction
    # Where a row's args and context are read from, by {args_w}, {args_f} and
    # {context_w} in the shared queries (w: a work row, f: a finished one): the row
    # itself, or payloads where its args are NULL (over each store's INLINE_CHARS;
    # their migrations say why), "" when that row is missing (its work fails as
    # corrupt).
    PAYLOAD_SQL: ClassVar[dict[str, str]] = {
        "{args_w}": "coalesce(w.args, (SELECT p.args FROM {s}payloads p WHERE p.id = w.id), '')",
        "{args_f}": "coalesce(f.args, (SELECT p.args FROM {s}payloads p WHERE p.id = f.id), '')",
        "{context_w}": "CASE WHEN w.args IS NULL"
        " THEN (SELECT p.context FROM {s}payloads p WHERE p.id = w.id) ELSE w.context END",
    }
    skip_locked: ClassVar[str] = ""  # row lock that skips rows others hold
    place: ClassVar[str] = "NULL"  # a row's ClaimedWork.place, as SQL over ``work``
    table_prefix: str = ""
    # How long ``run`` keeps retrying transient failures (busy file, restarting
    # server) before it reports the store unavailable.
    retry_window: float = 60.0

    def __init__(self) -> None:
        self._sql_cache: dict[str, str] = {}
        self._local = threading.local()

    # --- dialect hooks ------------------------------------------------------------------
    def _begin(
        self, readonly: bool, snapshot: bool
    ) -> tuple[Any, str | None, Callable[[Tx, bool], None]]:
        """Open a transaction: the connection, the BEGIN still to send (None: sent or
        none), and a function ending it (True = commit, after ``Tx.deferred``)."""
        raise NotImplementedError

    def is_transient(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def _translate(self, exc: BaseException) -> BaseException | None:
        """A workpool error for a driver error at the store edge, or None to re-raise it."""
        return None

    def _backoff_sleep(self, attempt: int) -> None:
        raise NotImplementedError

    # --- transactions ---------------------------------------------------------------------
    def _sql(self, template: str) -> str:
        sql = self._sql_cache.get(template)
        if sql is None:
            sql = template
            for token, expr in self.PAYLOAD_SQL.items():
                sql = sql.replace(token, expr)
            sql = sql.replace("{s}", self.table_prefix)
            if self.param != "?":
                sql = sql.replace("?", self.param)
            self._sql_cache[template] = sql
        return sql

    def q(self, tx: Tx, template: str, params: Sequence[Any] = ()) -> Any:
        return tx.connection.execute(self._sql(template), params)

    def _read(self, tx: Tx, read: Read[T]) -> T:
        """What a read (``Read``) answers, asked now."""
        return read.parse(self.q(tx, read.template, read.params).fetchall())

    def _read_later(self, tx: Tx, read: Read[T]) -> Callable[[], T]:
        """What a read answers, asked with ``tx``'s COMMIT: PostgreSQL sends all of a
        transaction's such reads in one round trip. Call the result after it."""
        # Alone, it goes as a statement of its own, with no BEGIN and COMMIT.
        rows = tx.defer(self._sql(read.template), read.params, rows=True, alone=True)
        return lambda: read.parse(rows.rows)

    def ids(self, tx: Tx, template: str, params: Sequence[Any] = ()) -> list[str]:
        """The first column of every row a query returns (work ids)."""
        return [row[0] for row in self.q(tx, template, params).fetchall()]

    @contextmanager
    def transaction(self, *, readonly: bool = False, snapshot: bool = True) -> Iterator[Tx]:
        current: Tx | None = getattr(self._local, "tx", None)
        if current is not None:
            # Nested use on one thread (an enqueue inside a mutation) joins the open
            # transaction; a second connection would wait on our own write lock.
            current.depth += 1
            try:
                with self.savepoint(current):
                    yield current
            finally:
                current.depth -= 1
            return
        # Only a read may go without a snapshot; then there may be no COMMIT for
        # statements to wait for.
        snapshot = snapshot or not readonly
        try:
            connection, begin, end = self._begin(readonly, snapshot)
        except Exception as exc:
            raise (self._translate(exc) or exc) from exc
        tx = Tx(connection, self, readonly=readonly, begin=begin, owned=snapshot)
        self._local.tx = tx
        try:
            yield tx
        except BaseException:
            self._local.tx = None
            with suppress(Exception):  # the original error matters more than the rollback's
                end(tx, False)
            raise
        self._local.tx = None
        try:
            end(tx, True)
        except Exception as exc:
            raise (self._translate(exc) or exc) from exc
        for hook in tx.after_commit:
            hook()

    def in_transaction(self) -> bool:
        return getattr(self._local, "tx", None) is not None

    @contextmanager
    def without_waiting(self) -> Iterator[None]:
        if not self.writes_without_waiting:
            raise NotImplementedError(f"{type(self).__name__} writes may wait")
        self._local.nowait = True
        try:
            yield
        finally:
            self._local.nowait = False

    def may_wait(self) -> bool:
        return not getattr(self._local, "nowait", False)

    def run(
        self,
        fn: Callable[[Tx], T],
        *,
        readonly: bool = False,
        snapshot: bool = True,
        retrying: bool = False,
    ) -> T:
        attempt = 0
        give_up = time.monotonic() + self.retry_window
        while True:
            try:
                with self.transaction(readonly=readonly, snapshot=snapshot) as tx:
                    tx.retrying = tx.retrying or retrying or attempt > 0  # nested: the outer's say
                    return fn(tx)
            except Exception as exc:
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                if getattr(self._local, "tx", None) is not None or not (
                    self.is_transient(exc) or self.is_transient(cause)
                ):
                    raise
                if not self.may_wait():
                    raise WouldWait(str(cause)) from exc
                if time.monotonic() > give_up:
                    raise StoreUnavailableError(
                        f"{self.url}: still failing after {self.retry_window:g} s of retries:"
                        f" {cause}"
                    ) from exc
                attempt += 1
                self._backoff_sleep(attempt)

    @contextmanager
    def savepoint(self, tx: Tx, *, keep: bool = True) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0) + 1
        self._local.depth = depth
        name = f"wp_sp{depth}"
        deferred = len(tx.deferred)  # what a rollback to the savepoint takes back
        tx.connection.execute(f"SAVEPOINT {name}")
        try:
            yield
        except BaseException:
            tx.connection.execute(f"ROLLBACK TO SAVEPOINT {name}")
            tx.connection.execute(f"RELEASE SAVEPOINT {name}")
            del tx.deferred[deferred:]
            raise
        else:
            if not keep:
                tx.connection.execute(f"ROLLBACK TO SAVEPOINT {name}")
                del tx.deferred[deferred:]
            tx.connection.execute(f"RELEASE SAVEPOINT {name}")
        finally:
            self._local.depth = depth - 1

    # --- pools ------------------------------------------------------------------------------
    _POOL_COLUMNS = (
        "name, max_parallelism, retry_actions_by_default, max_attempts, initial_backoff, base,"
        " log_level, status_ttl, paused_from"
    )

    @staticmethod
    def _pool(row: Sequence[Any]) -> PoolConfig:
        return PoolConfig(
            name=row[0],
            max_parallelism=int(row[1]),
            retry_actions_by_default=bool(row[2]),
            default_retry=RetryBehavior(int(row[3]), float(row[4]), float(row[5])),
            log_level=row[6],
            status_ttl=float(row[7]),
            paused_from=None if row[8] is None else int(row[8]),
        )

    def load_pool(self, tx: Tx, name: str) -> PoolConfig | None:
        row = self.q(
            tx, f"SELECT {self._POOL_COLUMNS} FROM {{s}}pools WHERE name = ?", (name,)
        ).fetchone()
        return None if row is None else self._pool(row)

    def pool_unchanged(self, tx: Tx, config: PoolConfig) -> bool:
        # The stored row against the config's values, as the PostgreSQL insert does:
        # building a PoolConfig from the row to compare was a fifth of an enqueue's
        # Python on SQLite.
        row = self.q(
            tx, f"SELECT {self._POOL_COLUMNS} FROM {{s}}pools WHERE name = ?", (config.name,)
        ).fetchone()
        return row is not None and tuple(row) == self._pool_params(config)

    def load_pools(self, tx: Tx) -> list[PoolConfig]:
        rows = self.q(tx, f"SELECT {self._POOL_COLUMNS} FROM {{s}}pools ORDER BY name")
        return [self._pool(row) for row in rows.fetchall()]

    def save_pool(self, tx: Tx, config: PoolConfig) -> None:
        self.q(
            tx,
            f"INSERT INTO {{s}}pools ({self._POOL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET max_parallelism = excluded.max_parallelism,"
            " retry_actions_by_default = excluded.retry_actions_by_default,"
            " max_attempts = excluded.max_attempts, initial_backoff = excluded.initial_backoff,"
            " base = excluded.base, log_level = excluded.log_level,"
            " status_ttl = excluded.status_ttl, paused_from = excluded.paused_from",
            self._pool_params(config),
        )

    @staticmethod
    def _pool_params(config: PoolConfig) -> tuple[Any, ...]:
        """``config`` as the values of ``_POOL_COLUMNS``."""
        retry = config.default_retry
        return (
            config.name,
            config.max_parallelism,
            int(config.retry_actions_by_default),
            retry.max_attempts,
            retry.initial_backoff,
            retry.base,
            config.log_level,
            config.status_ttl,
            config.paused_from,
        )

    def take_turn(self, tx: Tx, pool: str, duty: str, now: float, every: float) -> bool:
        # One statement: a new row, or a due one moved on, is this caller's turn.
        cur = self.q(
            tx,
            "INSERT INTO {s}duties (pool, duty, next_at) VALUES (?, ?, ?)"
            " ON CONFLICT (pool, duty) DO UPDATE SET next_at = excluded.next_at"
            " WHERE {s}duties.next_at <= ?",
            (pool, duty, now + every, now),
        )
        return bool(cur.rowcount == 1)

    def set_turn(self, tx: Tx, pool: str, duty: str, at: float) -> None:
        self.q(
            tx,
            "UPDATE {s}duties SET next_at = ? WHERE pool = ? AND duty = ?",
            (at, pool, duty),
        )

    def duty_times(self, tx: Tx) -> dict[tuple[str, str], float]:
        return self._read(tx, self._DUTY_TIMES)

    def duty_times_later(self, tx: Tx) -> Callable[[], dict[tuple[str, str], float]]:
        return self._read_later(tx, self._DUTY_TIMES)

    _DUTY_TIMES = Read(
        "SELECT pool, duty, next_at FROM {s}duties",
        (),
        lambda rows: {(pool, duty): float(next_at) for pool, duty, next_at in rows},
    )

    # --- work ---------------------------------------------------------------------------------
    def insert_work(self, tx: Tx, items: Sequence[NewWork], *, at_commit: bool = False) -> None:
        self._insert_columns(tx, self._work_columns(items), at_commit)

    def _insert_columns(self, tx: Tx, columns: list[Sequence[Any]], at_commit: bool) -> None:
        """Insert new pending work, given by column as ``_work_columns`` makes them."""
        raise NotImplementedError

    @staticmethod
    def _work_columns(items: Sequence[NewWork]) -> list[Sequence[Any]]:
        """The work table's columns for new items, each as long as ``items``: id,
        pool, kind, fn_name, args, on_complete, context, retry (as JSON), timeout,
        due_at, enqueued_at. A NewBatch's shared values are one object repeated, so
        that telling a column of one value costs a pass of identity checks."""
        if isinstance(items, NewBatch):
            n = len(items.ids)
            shared = (items.on_complete, items.context, _retry_json(items.retry), items.timeout)
            return [
                items.ids,
                [items.pool] * n,
                [items.kind] * n,
                [items.fn_name] * n,
                items.args,
                *([value] * n for value in shared),
                [items.due_at] * n,
                [items.enqueued_at] * n,
            ]
        retry_text: dict[RetryBehavior | None, str | None] = {}  # one encoding per batch
        rows = [
            (
                w.id,
                w.pool,
                w.kind,
                w.fn_name,
                w.args,
                w.on_complete,
                w.context,
                retry_text[w.retry]
                if w.retry in retry_text
                else retry_text.setdefault(w.retry, _retry_json(w.retry)),
                w.timeout,
                w.due_at,
                w.enqueued_at,
            )
            for w in items
        ]
        return [list(column) for column in zip(*rows, strict=True)] if rows else [[]] * 11

    @staticmethod
    def _apart(
        args: Sequence[str], contexts: Sequence[str | None], inline_chars: int
    ) -> tuple[list[int], Sequence[str | None], Sequence[str | None]]:
        """Which items' args and context together exceed ``inline_chars`` (they go to
        payloads), and the args and context columns with theirs NULL (a work row
        whose args are NULL has both in payloads). No item over it: no copies."""
        big = [
            k
            for k, (text, context) in enumerate(zip(args, contexts, strict=True))
            if len(text) + len(context or "") > inline_chars
        ]
        if not big:
            return big, args, contexts
        inline_args: list[str | None] = list(args)
        inline_contexts = list(contexts)
        for k in big:
            inline_args[k] = inline_contexts[k] = None
        return big, inline_args, inline_contexts

    def _executemany(self, tx: Tx, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if len(rows) == 1:  # a single enqueue's rows: execute costs less than executemany
            tx.connection.execute(sql, rows[0])
        else:
            tx.connection.executemany(sql, rows)

    # The claim: the next due pending rows of one pool, up to a limit, become running.
    # Each store says where (the first %s) and how the context and args come back
    # (the second: with a handler only, and the args, in that order), then the
    # row's place (ClaimedWork.place: PostgreSQL's ctid, SQLite's rowid).
    _CLAIM = (
        "UPDATE {s}work SET state = 'running', attempt = attempt + 1, worker_id = ?,"
        " started_at = ? WHERE %s"
        " RETURNING id, kind, fn_name, attempt, timeout, due_at, on_complete, %s"
    )
    _CLAIM_IDS = (
        "SELECT id FROM {s}work WHERE pool = ? AND state = 'pending' AND due_at <= ?"
        " ORDER BY due_at, id LIMIT %s%s"
    )

    greatest = "max"  # the SQL function of the larger of two values

    @classmethod
    def _share(cls, total: str, running: str, mine: str, live: str) -> str:
        """SQL for how many of ``total`` due rows a claim of a burst takes (the
        arguments are SQL, counted under the pool's claim lock): what brings its
        worker, which runs ``mine`` of the pool's ``running`` rows, to its share of
        the pool's work in hand, the due and running rows over the ``live`` workers
        that serve the pool (at least 1), rounded up; none once it runs that many.

        Each store takes it where a claim finds fewer due rows than it may take, but
        CLAIM_SPLIT_MIN or more. A burst smaller than a claim then runs on every
        worker, not on the one that claimed first (2 workers, 300 CPU-bound actions
        of 2 ms); a worker whose peers are busy with the pool takes all of it, as
        their running rows count. A share of the due rows alone (round 48) let the
        first to claim take three quarters: half, then half of what the next claim
        left. Rows left to a worker that does not claim them wait for this one's
        next claim, after some of its attempts end."""
        return f"{cls.greatest}(({total} + {running} + {live} - 1) / {live} - {mine}, 0)"

    def load_pools_later(self, tx: Tx) -> Callable[[], list[PoolConfig]]:
        # With the COMMIT: in its round trip on PostgreSQL, after the write lock's
        # SQL on SQLite, not before it.
        sql = self._sql(f"SELECT {self._POOL_COLUMNS} FROM {{s}}pools ORDER BY name")
        rows = tx.defer(sql, rows=True)
        return lambda: [self._pool(row) for row in rows.rows]

    def claim(self, tx: Tx, pool: str, limit: int, worker_id: str, now: float) -> list[ClaimedWork]:
        return self._claimed(pool, now, self._claim_rows(tx, pool, limit, worker_id, now))()

    def claim_later(
        self, tx: Tx, pool: str, limit: int, worker_id: str, now: float
    ) -> Callable[[], list[ClaimedWork]]:
        rows = self._claim_rows(tx, pool, limit, worker_id, now, at_commit=True)
        return self._claimed(pool, now, rows)

    @staticmethod
    def _claimed(
        pool: str, now: float, rows: Callable[[], list[Any]]
    ) -> Callable[[], list[ClaimedWork]]:
        return lambda: [SqlStore._claimed_work(pool, now, r) for r in rows()]

    @staticmethod
    def _claimed_work(pool: str, now: float, r: Sequence[Any]) -> ClaimedWork:
        """A claimed row (``_claim_rows``'s columns) as the attempt it starts."""
        # By position, in ClaimedWork's order (id, pool, kind, fn_name, args, attempt,
        # timeout, due_at, started_at, on_complete, context, place): one per claimed
        # row, and keywords cost 1.06 against 0.56 us a row.
        return ClaimedWork(
            r[0],
            pool,
            r[1],
            r[2],
            r[8],
            int(r[3]),
            None if r[4] is None else float(r[4]),
            float(r[5]),
            now,
            r[6],
            r[7],
            r[9],
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
        """Claim up to ``limit`` due rows of ``pool`` within its ``max_parallelism``; a
        function that reads them, as (id, kind, fn_name, attempt, timeout, due_at,
        on_complete, context, args, place): ``_CLAIM``'s columns, with any payload
        the claim left out filled in (``_with_payloads``).
        ``at_commit``: the store may claim with the COMMIT (``claim_later``)."""
        raise NotImplementedError

    @staticmethod
    def _with_payloads(
        rows: list[Any], read: Callable[[list[str]], dict[str, tuple[str, str | None]]]
    ) -> list[Any]:
        """Claimed rows whose args the claim left out (NULL) with the (args, context)
        that ``read`` finds for their ids; the context only with a handler, and args
        "" for a row ``read`` did not find (the worker fails it as corrupt)."""
        left = [r[0] for r in rows if r[8] is None]
        if not left:
            return rows
        found = read(left)
        out = []
        for r in rows:
            if r[8] is None:
                args, context = found.get(r[0], ("", None))
                r = (*r[:7], None if r[6] is None else context, args, *r[9:])
            out.append(r)
        return out

    # Pools' running rows, for a row ``p`` of ``pools``.
    _RUNNING_OF_P = "(SELECT count(*) FROM {s}work r WHERE r.pool = p.name AND r.state = 'running')"

    def _pools_with_due_work(self, pools: Sequence[str] | None) -> tuple[str, list[str]] | None:
        """The FROM and WHERE of ``pools`` (all when None) that are not paused and
        hold due pending work, as rows ``p`` (one parameter more: now), and their
        names' parameters; None when no pool can match."""
        names = [] if pools is None else storable(pools)
        if pools is not None and not names:
            return None
        where = ""
        if pools is not None:
            match, names = self._id_in("p.name", names)
            where = f" AND {match}"
        sql = (
            " FROM {s}pools p WHERE p.max_parallelism > 0"
            + where
            + " AND EXISTS (SELECT 1 FROM {s}work w WHERE w.pool = p.name"
            " AND w.state = 'pending' AND w.due_at <= ?)"
        )
        return sql, names

    def claim_rooms(self, tx: Tx, pools: Sequence[str] | None, now: float) -> dict[str, int]:
        found = self._pools_with_due_work(pools)
        if found is None:
            return {}
        sql, names = found
        rows = self.q(
            tx, f"SELECT p.name, p.max_parallelism - {self._RUNNING_OF_P}{sql}", (*names, now)
        ).fetchall()
        return {name: int(room) for name, room in rows}

    def claimable(self, tx: Tx, pools: Sequence[str] | None, now: float) -> bool:
        read = self._claimable(pools, now)
        return False if read is None else self._read(tx, read)

    def claimable_later(
        self, tx: Tx, pools: Sequence[str] | None, now: float
    ) -> Callable[[], bool]:
        read = self._claimable(pools, now)
        return (lambda: False) if read is None else self._read_later(tx, read)

    def _claimable(self, pools: Sequence[str] | None, now: float) -> Read[bool] | None:
        found = self._pools_with_due_work(pools)
        if found is None:
            return None
        sql, names = found
        return Read(
            f"SELECT EXISTS (SELECT 1{sql} AND p.max_parallelism > {self._RUNNING_OF_P})",
            (*names, now),
            lambda rows: bool(rows[0][0]),
        )

    def load_for_update(self, tx: Tx, work_id: str) -> ActiveWork | None:
        row = self.q(
            tx,
            f"SELECT {ACTIVE_COLUMNS} FROM {{s}}work w WHERE w.id = ?" + self.for_update,
            (work_id,),
        ).fetchone()
        return None if row is None else active_row(row)

    def load_many_for_update(self, tx: Tx, ids: Sequence[str]) -> dict[str, ActiveWork]:
        found: dict[str, ActiveWork] = {}
        # Sorted ids lock rows in one global order: completers cannot deadlock each other.
        ordered = sorted(set(storable(ids)))
        for chunk in self.iter_chunks(ordered, IN_CHUNK):
            marks = ", ".join("?" * len(chunk))
            rows = self.q(
                tx,
                f"SELECT {ACTIVE_COLUMNS} FROM {{s}}work w WHERE w.id IN ({marks}) ORDER BY w.id"
                + self.for_update,
                chunk,
            ).fetchall()
            for row in rows:
                found[row[0]] = active_row(row)
        return found

    def end_attempt(self, tx: Tx, work: ClaimedWork) -> Callable[[], ClaimedWork | None]:
        ended = tx.defer(
            self._sql(
                "UPDATE {s}work SET state = 'ended' WHERE id = ? AND state = 'running'"
                f" AND attempt = ? RETURNING {self.place}"
            ),
            (work.id, work.attempt),
            rows=True,
            role="end",
        )

        def answer() -> ClaimedWork | None:
            rows = ended.rows
            return replace(work, state="ended", place=rows[0][0]) if rows else None

        return answer

    def retry_many(self, tx: Tx, items: Sequence[Retrying], *, at_commit: bool = False) -> None:
        if not items:
            return
        self._executemany(
            tx,
            self._sql(
                "UPDATE {s}work SET state = 'pending', due_at = ?, last_error = ?,"
                " worker_id = NULL, lost_count = lost_count + ?"
                " WHERE id = ? AND state = ? AND attempt = ?"
            ),
            [
                (r.due_at, r.error, int(r.lost), r.work.id, r.work.state, r.work.attempt)
                for r in items
            ],
        )

    def hand_many(self, tx: Tx, items: Sequence[Handing], *, at_commit: bool = False) -> None:
        if not items:
            return
        self._executemany(
            tx,
            self._sql(
                "UPDATE {s}work SET state = 'completing', result = ?, due_at = ?,"
                " handler_failures = ?, last_error = ?, worker_id = NULL"
                " WHERE id = ? AND state = ? AND attempt = ?"
            ),
            [
                (h.result, h.due_at, h.failures, h.error, h.work.id, h.work.state, h.work.attempt)
                for h in items
            ],
        )

    def due_handlers(
        self, tx: Tx, pools: Sequence[str], now: float, limit: int
    ) -> list[ActiveWork]:
        match, names = self._id_in("pool", pools)
        rows = self.q(
            tx,
            f"SELECT {ACTIVE_COLUMNS} FROM {{s}}work w WHERE state = 'completing' AND due_at <= ?"
            f" AND {match} ORDER BY due_at LIMIT ?" + self.skip_locked,
            (now, *names, limit),
        ).fetchall()
        return [active_row(r) for r in rows]

    def lost_work(self, tx: Tx, pools: Sequence[str], now: float, limit: int) -> list[ActiveWork]:
        match, names = self._id_in("pool", pools)
        rows = self.q(
            tx,
            f"SELECT {ACTIVE_COLUMNS} FROM {{s}}work w WHERE state {RECORDABLE_IN}"
            f" AND {match} AND NOT EXISTS (SELECT 1 FROM {{s}}workers k"
            " WHERE k.id = w.worker_id AND k.expires_at > ?) LIMIT ?" + self.skip_locked,
            (*names, now, limit),
        ).fetchall()
        return [active_row(r) for r in rows]

    def maintenance_due(
        self, tx: Tx, pools: Sequence[str], now: float, *, lost: bool = True, within: float = 0.0
    ) -> tuple[bool, float | None]:
        return self._read(tx, self._maintenance_due(pools, now, lost, within))

    def maintenance_due_later(
        self, tx: Tx, pools: Sequence[str], now: float, *, lost: bool = True, within: float = 0.0
    ) -> Callable[[], tuple[bool, float | None]]:
        return self._read_later(tx, self._maintenance_due(pools, now, lost, within))

    def _maintenance_due(
        self, pools: Sequence[str], now: float, lost: bool, within: float
    ) -> Read[tuple[bool, float | None]]:
        # The pools as one array on PostgreSQL (_id_in): a worker of 500 pools bound
        # 1,000 parameters here twice a second, 2.4 ms of its CPU each time (0.2 ms).
        match, names = self._id_in("pool", pools)
        lost_sql = (
            f"EXISTS (SELECT 1 FROM {{s}}work w WHERE state {RECORDABLE_IN}"
            f" AND {match} AND NOT EXISTS (SELECT 1 FROM {{s}}workers k"
            " WHERE k.id = w.worker_id AND k.expires_at > ?))"
        )

        def parse(rows: list[Any]) -> tuple[bool, float | None]:
            row = rows[0]
            return bool(row[0]), None if row[1] is None else float(row[1])

        return Read(
            f"SELECT {lost_sql if lost else '0'},"
            " (SELECT min(due_at) FROM {s}work WHERE state = 'completing' AND due_at <= ?"
            f" AND {match})",
            (*names, now, now + within, *names) if lost else (now + within, *names),
            parse,
        )

    def running_of(
        self, tx: Tx, worker_id: str, pools: Sequence[str]
    ) -> list[tuple[str, int, float]]:
        read = self._running_of(worker_id, pools)
        return [] if read is None else self._read(tx, read)

    def running_of_later(
        self, tx: Tx, worker_id: str, pools: Sequence[str]
    ) -> Callable[[], list[tuple[str, int, float]]]:
        read = self._running_of(worker_id, pools)
        return (lambda: []) if read is None else self._read_later(tx, read)

    def _running_of(
        self, worker_id: str, pools: Sequence[str]
    ) -> Read[list[tuple[str, int, float]]] | None:
        names = storable(pools)
        if not names:
            return None
        # The pools put the (pool, state) index to use: without them this read scanned
        # the whole table, 83 ms at a million pending rows, every two seconds.
        match, params = self._id_in("pool", names)
        return Read(
            f"SELECT id, attempt, started_at FROM {{s}}work WHERE {match}"
            f" AND state {RECORDABLE_IN} AND worker_id = ?",
            (*params, worker_id),
            lambda rows: [(r[0], int(r[1]), float(r[2])) for r in rows],
        )

    def flag_cancel(self, tx: Tx, work: ActiveWork) -> bool:
        cur = self.q(
            tx,
            "UPDATE {s}work SET cancel_requested = 1 WHERE id = ? AND state = ? AND attempt = ?",
            (work.id, work.state, work.attempt),
        )
        return bool(cur.rowcount == 1)

    def cancelable_ids(self, tx: Tx, pool: str, before: float, limit: int) -> list[str]:
        # Running (and ended) rows first, then pending ones in the order they would
        # start. Ranges of the (pool, state, due_at, id) index: canceled pending rows
        # leave theirs, flagged running ones are at most max_parallelism. Not one
        # query over both states: with no statistics yet (a backlog enqueued in one
        # transaction), PostgreSQL read that IN with a bitmap scan of the whole
        # backlog for every page (cancel_all of 200k pending: 89 s instead of 15 s).
        ids = self.ids(
            tx,
            f"SELECT id FROM {{s}}work WHERE pool = ? AND state {RECORDABLE_IN}"
            " AND cancel_requested = 0 AND enqueued_at <= ? LIMIT ?",
            (pool, before, limit),
        )
        if len(ids) < limit:
            ids += self.ids(
                tx,
                "SELECT id FROM {s}work WHERE pool = ? AND state = 'pending'"
                " AND enqueued_at <= ? ORDER BY due_at, id LIMIT ?",
                (pool, before, limit - len(ids)),
            )
        return ids

    # --- workers, counters, introspection ---------------------------------------------------
    def heartbeat(self, tx: Tx, worker: WorkerInfo, now: float, expires_at: float) -> None:
        self.q(
            tx,
            "INSERT INTO {s}workers (id, host, pid, pools, started_at, heartbeat_at, expires_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
            " heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at",
            (worker.id, worker.host, worker.pid, ",".join(worker.pools), now, now, expires_at),
        )

    def live_workers(self, tx: Tx, now: float) -> list[list[str]]:
        return self._read(tx, self._live_workers(now))

    def live_workers_later(self, tx: Tx, now: float) -> Callable[[], list[list[str]]]:
        return self._read_later(tx, self._live_workers(now))

    @staticmethod
    def _live_workers(now: float) -> Read[list[list[str]]]:
        return Read(
            "SELECT pools FROM {s}workers WHERE expires_at > ?",
            (now,),
            lambda rows: [pools.split(",") if pools else [] for (pools,) in rows],
        )

    def remove_worker(self, tx: Tx, worker_id: str) -> None:
        self.q(tx, "DELETE FROM {s}workers WHERE id = ?", (worker_id,))

    def forget_dead_workers(self, tx: Tx, now: float) -> int:
        # Rows of lost workers stay an hour so operators can see who vanished; their
        # work is rescued independently (a missing worker row counts as expired).
        cur = self.q(tx, "DELETE FROM {s}workers WHERE expires_at < ?", (now - 3600.0,))
        return int(cur.rowcount)

    def next_due(self, tx: Tx, pools: Sequence[str], after: float) -> float | None:
        # One min() per (pool, state): each is a single index probe, where a min over
        # an IN list would scan every pending row. In chunks: SQLite refuses a
        # compound SELECT of more than 500 terms (a worker of all of 251 pools failed).
        found: list[float] = []
        for chunk in self.iter_chunks(pools, NEXT_DUE_CHUNK):
            parts = " UNION ALL ".join(
                "SELECT min(due_at) AS due FROM {s}work WHERE pool = ? AND state = ? AND due_at > ?"
                for _ in range(2 * len(chunk))
            )
            params = [
                v for pool in chunk for v in (pool, "pending", after, pool, "completing", after)
            ]
            row = self.q(tx, f"SELECT min(due) FROM ({parts}) AS d", params).fetchone()
            if row[0] is not None:
                found.append(float(row[0]))
        return min(found, default=None)
