"""PostgresStore: pooled psycopg connections, advisory-locked claims, LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import psycopg_pool
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from workpool.core.errors import InvalidArgumentError, StoreUnavailableError
from workpool.core.histogram import LAG_BOUNDS
from workpool.store.base import (
    ActiveWork,
    ClaimedWork,
    Finishing,
    Handing,
    NewWork,
    PoolConfig,
    Retrying,
    Succeeded,
    T,
    Tx,
    Upkeep,
    Watcher,
    WouldWait,
    minute_of,
)
from workpool.store.fds import InputWait, readable
from workpool.store.postgres.migrations import MIGRATIONS
from workpool.store.sql import CLAIM_SPLIT_MIN, Read, SqlStore, check_schema
from workpool.store.sql_reads import ACTIVE_COLUMNS, active_row, storable
from workpool.store.url import whole_number

# A claim reads at most this many bytes of args (and always one row). A worker that
# took every due row of a pool of big payloads would read and decode them all on
# its own while the other workers' slots stayed empty; small args never reach it.
CLAIM_BYTES = 4_000_000
# A claim returns a row's args and context itself up to this many bytes together;
# bigger ones it leaves out, to be read after its COMMIT. The claim lock is held
# until then: a claim of 3 rows of 800 KB args and 800 KB context took 10-13 ms
# with them (the server's detoasting and sending, the client's receiving) and 1.3-1.6
# ms without, while the other workers' claims waited.
CLAIM_INLINE_BYTES = 8_192
# Args and context over this many characters together are written to payloads, not
# to the work row (migration 4 says why): about where PostgreSQL moves a row's values
# out of line (TOAST, rows over 2 KB), whose copy into finished is what costs. Under
# it a payloads row costs more than the copies: with args of 600 or 1,200 characters
# written there, batch enqueues ran 17 % slower and drains no faster.
INLINE_CHARS = 2_000
# ``work`` below this many pages is read whole in about the time an index probe
# takes, whatever plan its statistics lead to: no ANALYZE for it.
STATS_MIN_PAGES = 8
# Dead rows in ``work`` (two a job: the claimed version and the deleted one) at
# which a worker vacuums it. A claim's two index scans walk every dead entry left
# of the live ones, so their cost grows with the jobs done since the last VACUUM:
# a claim of 512 took 13 ms after a VACUUM and 97 ms 300,000 jobs later, and a
# drain of 600,000 ran at half the speed of one of 200,000. Autovacuum comes at
# most once a minute. A VACUUM of a 300,000-row table costs some 60 ms; one every
# 30,000 jobs cost the least in all (20,000 and 100,000 cost more).
VACUUM_DEAD_ROWS = 60_000

SCHEMA_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
OUR_PARAMS = ("schema", "pool_size", "prepare_threshold")
DEFAULT_POOL_SIZE = 20
CONNECT_TIMEOUT_S = 10.0  # waiting for a pooled connection before "unavailable"
TRANSIENT = (
    pg_errors.SerializationFailure,
    pg_errors.DeadlockDetected,
    pg_errors.LockNotAvailable,
    pg_errors.AdminShutdown,
    pg_errors.CannotConnectNow,
    psycopg.OperationalError,
    psycopg_pool.PoolTimeout,
)
# Joins the elements of a text array parameter. JSON text and our ids never hold a
# raw control character; other text is checked before it is joined.
SEP = "\x1e"
# A ctid that no row has (tuple offsets start at 1).
NOWHERE = "(0,0)"


def array_param(values: Sequence[Any], kind: str) -> tuple[str, Any]:
    """A SQL expression for ``values`` as a ``kind[]`` and the parameter it takes.

    psycopg dumps a list parameter element by element in Python (about 2 us each,
    most of a completion's client time at a batch of 100). Text without NULLs goes
    as one joined string that ``string_to_array`` splits on the server, integers as
    one comma-separated string; anything else as a binary array.
    """
    if kind == "text" and None not in values:
        joined = SEP.join(values)
        # A lone empty string would split into no element at all.
        if joined.count(SEP) == len(values) - 1 and (joined or not values):
            return "string_to_array(%s, E'\\x1e')", joined
    elif kind == "int" and None not in values:
        return "string_to_array(%s, ',')::int[]", ",".join(map(str, values))
    return f"%b::{kind}[]", list(values)


def unnest(columns: Sequence[tuple[Sequence[Any], str]]) -> tuple[str, list[Any]]:
    """``unnest(...)`` over (values, element type) columns, and its parameters in order."""
    exprs, params = [], []
    for values, kind in columns:
        expr, param = array_param(values, kind)
        exprs.append(expr)
        params.append(param)
    return f"unnest({', '.join(exprs)})", params


# One row of an INSERT, as on_complete handlers often write: its VALUES hold
# placeholders and plain expressions, with nothing to parse around (quotes,
# comments, dollar quotes, a second statement) and nothing after them.
_ONE_ROW_INSERT = re.compile(
    r"\s*(INSERT\s+INTO\s+[\w.\"]+\s*(?:\([\w\s,.\"]*\)\s*)?VALUES\s*)(\([^'\";$]*\))\s*;?\s*",
    re.IGNORECASE,
)
# Rows of such an INSERT go as statements of 2**k rows: few texts, each prepared
# once. Each of at most this many parameters: psycopg keeps a statement's parsed
# placeholders in its cache only up to 50 of them, and parses a bigger one anew at
# every call, 1.1 us a row (an on_complete drain in one process, a handler's
# one-row INSERT a job, 512 rows a statement -> 32: 42.7k -> 45.0k jobs/s).
_ROWS_PARAMS = 50


@functools.lru_cache(maxsize=64)
def insert_rows_form(sql: str) -> tuple[str, str, int] | None:
    """``sql`` as the head of a one-row INSERT (up to VALUES), its row, and the
    row's count of placeholders; None for any other statement."""
    match = _ONE_ROW_INSERT.fullmatch(sql)
    if match is None:
        return None
    head, row = match.groups()
    if "--" in row or "/*" in row:
        return None
    depth = 0
    for k, char in enumerate(row):
        depth += (char == "(") - (char == ")")
        if depth == 0 and k < len(row) - 1:
            return None  # more than one row already, or something after the row
    marks = re.findall(r"%(.?)", row)
    if any(mark not in ("s", "b", "t") for mark in marks):
        return None  # %% or a named placeholder: left to psycopg's own parsing
    return head, row, len(marks)


def split_url(url: str) -> tuple[str, dict[str, str]]:
    """The conninfo for psycopg and workpool's own query parameters."""
    parts = urlsplit(url)
    scheme = "postgresql"
    query = parse_qsl(parts.query)
    ours = {k: v for k, v in query if k in OUR_PARAMS}
    theirs = [(k, v) for k, v in query if k not in OUR_PARAMS]
    given = {k for k, _ in theirs}
    if "application_name" not in given:
        theirs.append(("application_name", "workpool"))  # tells operators who is connected
    if "connect_timeout" not in given:
        theirs.append(("connect_timeout", "5"))
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(theirs), "")), ours


def _connect_kwargs(ours: dict[str, str], url: str) -> dict[str, Any]:
    """psycopg's connection options for every connection of the store: autocommit,
    and ``prepare_threshold`` when the URL sets it. psycopg prepares a statement on
    the server after that many runs on a connection (its default, 5); "none" never
    does. Behind a pooler in transaction mode that does not track prepared
    statements, the next transaction may run on another server connection, where
    the prepared name is unknown."""
    kwargs: dict[str, Any] = {"autocommit": True}
    threshold = ours.get("prepare_threshold")
    if threshold is None:
        return kwargs
    if threshold.lower() == "none":
        kwargs["prepare_threshold"] = None
    else:
        kwargs["prepare_threshold"] = whole_number(
            url, "prepare_threshold", threshold, 0, other=", or none"
        )
    return kwargs


class PipelineCursor(psycopg.Cursor[Any]):
    """A cursor whose ``rowcount``, ``statusmessage`` and ``description`` are right
    inside a pipeline too.

    psycopg fetches a pipelined result when rows are read but leaves these at
    their empty values until then; on_complete handlers run in a pipeline (see
    ``Store.pipeline``), and one that checks how many rows its UPDATE changed must
    see the real count.
    """

    @property
    def rowcount(self) -> int:
        self._fetch_pipeline()
        return super().rowcount

    @property
    def statusmessage(self) -> str | None:
        self._fetch_pipeline()
        return super().statusmessage

    @property
    def description(self) -> list[psycopg.Column] | None:
        self._fetch_pipeline()
        return super().description


class PostgresStore(SqlStore):
    param = "%s"
    for_update = " FOR UPDATE"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    greatest = "GREATEST"
    place = "ctid::text"
    savepoints_cost = True  # SAVEPOINT and RELEASE: a round trip each
    streams_inserts = True
    # Two workers of 1,600 slots draining 60,000 no-ops: 47.7k -> 55.1k jobs/s
    # (medians of 5) against batches of 512 with 800 slots; 2,048 and 4,096 no
    # faster. What each transaction costs besides its rows (the claim lock's turn,
    # the COMMIT, the client's work between two of them) is shared by twice the
    # jobs. A claim of 1,024 takes 9-10 ms (512: 5.5), holding the pool's claim lock.
    worker_batch = 1024

    def __init__(self, url: str, *, schema: str = "workpool") -> None:
        super().__init__()
        if not SCHEMA_RE.fullmatch(schema):
            raise InvalidArgumentError(
                f"schema {schema!r} is not valid: use 1-63 letters, digits or '_',"
                " starting with a letter or '_'"
            )
        self.url = url
        self.conninfo, ours = split_url(url)
        self.schema = schema
        self.table_prefix = f'"{schema}".'
        self.channel = f"workpool_{schema}"[:63]
        self.pool_size = whole_number(
            url, "pool_size", ours.get("pool_size", str(DEFAULT_POOL_SIZE)), 1
        )
        self._connect_kwargs = _connect_kwargs(ours, url)
        self._conn_pool: psycopg_pool.ConnectionPool | None = None
        self._insert_sql: dict[tuple[str, bool, str, tuple[str | None, ...]], str] = {}
        self._conn_pool_lock = threading.Lock()
        self._migrated = False
        # Connections of run_async, idle between its statements: any event loop may
        # take one (psycopg binds an async connection to no loop while nothing waits
        # on its lock, and one statement at a time runs on each). At most pool_size
        # are open, as in the threads' pool; beyond them a call goes to a thread and
        # waits there. close() moves the generation on, so that connections out at
        # the time are closed on return. A store dropped unclosed closes the idle
        # ones quietly, as its pool does.
        self._idle_async: list[psycopg.AsyncConnection[Any]] = []
        self._async_open = 0
        self._async_generation = 0
        weakref.finalize(self, _finish_all, self._idle_async)
        self._async_connect: dict[str, Any] = (
            dict(self._connect_kwargs)
            if "connect_timeout" in conninfo_to_dict(self.conninfo)
            else {**self._connect_kwargs, "connect_timeout": int(CONNECT_TIMEOUT_S)}
        )

    # --- connections --------------------------------------------------------------------
    def _connections(self) -> psycopg_pool.ConnectionPool:
        if self._conn_pool is None:
            with self._conn_pool_lock:
                if self._conn_pool is None:
                    pool = psycopg_pool.ConnectionPool(
                        self.conninfo,
                        min_size=1,
                        max_size=self.pool_size,
                        kwargs={**self._connect_kwargs, "cursor_factory": PipelineCursor},
                        timeout=CONNECT_TIMEOUT_S,
                        open=False,
                        name=f"workpool-{self.schema}",
                    )
                    # The first connection is waited for here, not in getconn(): a
                    # request that waits there makes the pool open a second one, which
                    # a client making one call at a time never needs. (On a timeout
                    # the pool is closed and the next call makes a new one.)
                    pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
                    self._conn_pool = pool
        return self._conn_pool

    def _live_connection(self) -> psycopg.Connection[Any]:
        pool = self._connections()
        # A pooled connection may have died while idle (server restart, a cut): the
        # pool replaces a closed one, and nothing has run yet, so take another.
        for _ in range(self.pool_size):
            conn = pool.getconn()
            if _alive(conn):
                return conn
            conn.close()
            pool.putconn(conn)
        raise psycopg.OperationalError("every pooled connection was closed by the server")

    def send_begin(self, tx: Tx) -> None:
        # A connection whose end was still on its way when _alive() looked fails
        # here, before anything ran in the transaction: take another, as _begin does.
        for tries_left in range(self.pool_size, -1, -1):
            try:
                tx.raw.execute(tx.begin)
                tx.begin = None
                return
            except psycopg.OperationalError:
                if tries_left == 0 or not (tx.raw.closed or tx.raw.broken):
                    raise
                self._connections().putconn(tx.raw)
                tx.raw = self._live_connection()

    def _begin(
        self, readonly: bool, snapshot: bool
    ) -> tuple[Any, str | None, Callable[[Tx, bool], None]]:
        pool = self._connections()
        if not snapshot:
            # Each statement is a transaction of its own (the connection is in
            # autocommit): there is nothing to begin or end. psycopg's pool rolls
            # back a connection that comes back inside a transaction.
            return self._live_connection(), None, lambda tx, commit: pool.putconn(tx.raw)

        def end(tx: Tx, commit: bool) -> None:
            conn = tx.raw  # send_begin may have replaced the first one
            try:
                if tx.begin is not None and not (commit and tx.deferred):
                    return  # nothing was sent: nothing to end
                if not commit:
                    conn.execute("ROLLBACK")
                    return
                if tx.begin is not None and len(tx.deferred) == 1 and tx.deferred[0].alone:
                    # One statement and nothing sent before it: in autocommit it is a
                    # transaction of its own. No BEGIN, SET LOCAL or COMMIT, and no
                    # pipeline, whose bookkeeping costs psycopg some 70 us of CPU.
                    tx.deferred[0].ran(conn.execute(tx.deferred[0].sql, tx.deferred[0].params))
                    return
                if tx.begin is not None and [d.role for d in tx.deferred] == ["finish", "claim"]:
                    # A record of successes that refills its slots, and nothing else:
                    # one statement as well (_record_claim_function).
                    finish, claim = tx.deferred
                    rows = conn.execute(
                        self._record_claim_call, [*finish.params, *claim.params]
                    ).fetchall()
                    finish.took([(r[0], r[3]) for r in rows if r[1] is None])
                    claim.took([r for r in rows if r[1] is not None])
                    return
                if tx.begin is not None and [d.role for d in tx.deferred] == ["end", "claim"]:
                    # A slot given from an attempt that ended to the next one, and
                    # nothing else: one statement too (_end_claim_function).
                    ended, claim = tx.deferred
                    rows = conn.execute(
                        self._end_claim_call, [*ended.params, *claim.params]
                    ).fetchall()
                    ended.took([(r[9],) for r in rows if r[1] is None])
                    claim.took([r for r in rows if r[1] is not None])
                    return
                # The deferred statements and the COMMIT (and a BEGIN not sent yet)
                # go in one round trip.
                with conn.pipeline():
                    if tx.begin is not None:
                        conn.execute(tx.begin)
                    if tx.deferred:
                        # Our statements take arrays: planned with the values, a batch
                        # of one looks so cheap that PostgreSQL plans every execution
                        # anew (0.8 ms for the finish) instead of reusing the prepared
                        # plan. User statements ran before: the setting ends at COMMIT.
                        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                    cursors = [conn.execute(d.sql, d.params) for d in tx.deferred]
                    conn.execute("COMMIT")
                # Rows are read before the connection goes back to the pool.
                for deferred, cursor in zip(tx.deferred, cursors, strict=True):
                    deferred.ran(cursor)
            finally:
                pool.putconn(conn)

        return self._live_connection(), "BEGIN READ ONLY" if readonly else "BEGIN", end

    def _x(self, tx: Tx, sql: str, params: Sequence[Any] = ()) -> Any:
        """Execute one of the store's statements; a BEGIN still pending goes with it,
        in one round trip. (Not for user SQL: a pipeline takes one statement per
        string.)"""
        if tx.begin is None:
            tx.send_held()  # user statements held back before it go first
            return tx.raw.execute(sql, params)
        with self.pipeline(tx):
            cur = tx.raw.execute(sql, params)
        return cur

    def q(self, tx: Tx, template: str, params: Sequence[Any] = ()) -> Any:
        return self._x(tx, self._sql(template), params)

    async def run_async(self, fn: Callable[[Tx], T]) -> T:
        # fn makes its statement in a transaction with no connection: one that would
        # send a statement at once meets WouldWait there, before anything is sent.
        tx = Tx(_NOT_CONNECTED, self, begin="BEGIN", owned=True)
        answer = fn(tx)
        if len(tx.deferred) != 1 or not tx.deferred[0].alone or tx.after_commit:
            raise WouldWait("not one statement that may go alone")
        statement = tx.deferred[0]
        try:
            statement.took(await self._send_alone(statement.sql, statement.params, statement.keep))
        except WouldWait:
            raise  # nothing was sent
        except Exception as exc:
            if not self.is_transient(exc):
                translated = self._translate(exc)
                if translated is None:
                    raise
                raise translated from exc
            # The connection may have been lost after the server committed: the
            # retries, as run's, on a thread, ready to find their rows there.
            return await asyncio.to_thread(self.run, fn, retrying=True)
        return answer

    async def _send_alone(self, sql: str, params: Sequence[Any], keep: bool) -> list[Any]:
        """Run one statement in autocommit on an idle async connection, or a new one;
        its rows if ``keep``. ``WouldWait`` (nothing sent) when pool_size are busy."""
        conn, generation = self._take_async()
        if conn is None:
            try:
                conn = await psycopg.AsyncConnection.connect(self.conninfo, **self._async_connect)
            except BaseException as exc:
                self._drop_async(None)
                if isinstance(exc, psycopg.InterfaceError):
                    # This event loop cannot drive psycopg (Windows' proactor loop):
                    # the call goes to a thread, as it would without this path.
                    raise WouldWait(str(exc)) from exc
                raise
        try:
            cursor = await conn.execute(sql, params)
            rows = await cursor.fetchall() if keep else []
        except BaseException:
            self._drop_async(conn)  # in an unknown state (an error, a cancel): never reused
            raise
        with self._conn_pool_lock:
            if generation == self._async_generation:
                self._idle_async.append(conn)
                return rows
        self._drop_async(conn)
        return rows

    def _take_async(self) -> tuple[psycopg.AsyncConnection[Any] | None, int]:
        """An idle live connection, or None for one to open (counted already); and
        the generation it belongs to."""
        while True:
            with self._conn_pool_lock:
                generation = self._async_generation
                if not self._idle_async:
                    if self._async_open >= self.pool_size:
                        raise WouldWait(f"all {self.pool_size} async connections are busy")
                    self._async_open += 1
                    return None, generation
                conn = self._idle_async.pop()
            if _alive(conn):
                return conn, generation
            self._drop_async(conn)

    def _drop_async(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        if conn is not None:
            _finish(conn)
        with self._conn_pool_lock:
            self._async_open -= 1

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, TRANSIENT)

    @contextmanager
    def read_only(self, tx: Tx) -> Iterator[None]:
        with self.savepoint(tx, keep=False):
            # Going read-only is allowed at any point of a transaction; the rollback
            # to the savepoint undoes it.
            tx.connection.execute("SET LOCAL transaction_read_only = on")
            yield

    def is_database_error(self, exc: BaseException) -> bool:
        return isinstance(exc, psycopg.Error)

    def _translate(self, exc: BaseException) -> BaseException | None:
        if isinstance(exc, psycopg_pool.PoolTimeout | psycopg.OperationalError):
            return StoreUnavailableError(f"PostgreSQL at {self._where()} is unavailable: {exc}")
        return None

    def _where(self) -> str:
        parts = urlsplit(self.conninfo)
        return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"

    def _backoff_sleep(self, attempt: int) -> None:
        time.sleep(min(0.005 * 2**attempt, 2.0) * (0.5 + random.random()))

    def migrate(self) -> None:
        if not self._migrated:
            self.run(self._migrate)  # retried like any transaction: cuts, restarts
            self._migrated = True

    def _migrate(self, tx: Tx) -> None:
        # Many processes may start at once: one migrates, the others wait here.
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('workpool.migrate'), hashtext(%s))",
            (self.schema,),
        )
        tx.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
        tx.execute(
            f"CREATE TABLE IF NOT EXISTS {self.table_prefix}schema_version"
            " (version integer NOT NULL)"
        )
        row = tx.execute(f"SELECT max(version) FROM {self.table_prefix}schema_version").fetchone()
        version = int(row[0] or 0)
        check_schema(version, len(MIGRATIONS))
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            tx.execute(script.replace("{s}", self.table_prefix))
            tx.execute(f"INSERT INTO {self.table_prefix}schema_version VALUES (%s)", (number,))
        # Made from the code's own SQL, so not a migration: each version has its own.
        functions = (self._claim_function, self._record_claim_function, self._end_claim_function)
        for name, definition in functions:
            if tx.execute("SELECT to_regproc(%s)", (name,)).fetchone()[0] is None:
                tx.execute(definition)

    def close(self) -> None:
        with self._conn_pool_lock:
            if self._conn_pool is not None:
                self._conn_pool.close()
                self._conn_pool = None
            idle = self._idle_async[:]
            self._idle_async.clear()
            self._async_open -= len(idle)
            self._async_generation += 1
        _finish_all(idle)

    def tidy(self, *, quick: bool = False) -> None:
        # VACUUM cannot run inside a transaction: our pooled connections are in
        # autocommit mode between the explicit BEGINs of workpool transactions.
        # Quick: no ANALYZE (a drain of 600,000: 24.3k jobs/s with it, 27.6k
        # without; VACUUM sets the table's size for the planner itself), no
        # truncation of empty end pages (it locks out every claim and finish
        # while it looks for them, and waits for that lock up to 5 s), and none
        # at all while another VACUUM runs.
        options = "SKIP_LOCKED, TRUNCATE false" if quick else "ANALYZE"
        with self._connections().connection() as conn:
            conn.execute(f"VACUUM ({options}) {self.table_prefix}work")

    def upkeep(self) -> Upkeep:
        """``analyze`` when ``work`` has outgrown its statistics: it holds at least
        STATS_MIN_PAGES pages while they say it is empty (a VACUUM or ANALYZE that
        met an empty queue), or twice the pages they were taken at; ``vacuum`` when
        it holds VACUUM_DEAD_ROWS dead rows.

        Plans of prepared statements are cached with the statistics they were made
        with, and only a new ANALYZE or VACUUM makes them be planned again. Made
        while the queue looked empty, they scan the table: a burst of 100,000 jobs
        after 20 s idle drained at 8.5k jobs/s instead of 48k, with claims of
        480 ms, until autovacuum (once a minute) or the tidy came by; under steady
        load a finish planned that way took seconds and the backlog grew until the
        next VACUUM. One catalog read, cheap enough for every pass; the dead rows
        are the statistics collector's count, which backends report about once a
        second.
        """
        return self.run(self.upkeep_later, readonly=True)()

    def upkeep_later(self, tx: Tx) -> Callable[[], Upkeep]:
        return self._read_later(tx, self._upkeep_read())

    def _upkeep_read(self) -> Read[Upkeep]:
        def parse(rows: list[Any]) -> Upkeep:
            if not rows:
                return Upkeep()
            row = rows[0]
            tuples, pages, actual, dead = float(row[0]), int(row[1]), int(row[2]), int(row[3])
            # Never analysed (-1): the planner then estimates from the table's size.
            stale = actual >= STATS_MIN_PAGES and tuples >= 0 and (tuples < 1 or actual > 2 * pages)
            return Upkeep(analyze=stale, vacuum=dead >= VACUUM_DEAD_ROWS)

        return Read(
            "SELECT c.reltuples, c.relpages,"
            " pg_relation_size(c.oid) / current_setting('block_size')::int,"
            " pg_stat_get_dead_tuples(c.oid)"
            " FROM pg_class c WHERE c.oid = ?::regclass",
            (f"{self.table_prefix}work",),
            parse,
        )

    def analyze(self) -> None:
        # Inside a transaction, so that it can wait a bounded time: a VACUUM (the
        # tidy's, or autovacuum's) holds the lock and refreshes the statistics itself.
        with self._connections().connection() as conn:
            try:
                with conn.transaction():
                    conn.execute("SET LOCAL lock_timeout = '100ms'")
                    conn.execute(f"ANALYZE {self.table_prefix}work")
            except pg_errors.LockNotAvailable:
                pass

    def adopt(self, connection: Any) -> Tx | None:
        if isinstance(connection, psycopg.Connection):
            return Tx(connection, self)
        return None

    # --- notifications ------------------------------------------------------------------
    def notify(self, tx: Tx, pools: Sequence[str]) -> None:
        # Delivered at commit in any case: sent with the COMMIT.
        for pool in pools:
            tx.defer("SELECT pg_notify(%s, %s)", (self.channel, pool))

    def watcher(self) -> Watcher:
        return _Listener(self.conninfo, self.channel)

    # --- dialect hooks ------------------------------------------------------------------
    @contextmanager
    def pipeline(self, tx: Tx) -> Iterator[None]:
        if tx.pipelined:
            # psycopg syncs (a round trip) on entering and on leaving a nested
            # pipeline: an inner block joins the outer one instead.
            yield
            return
        with tx.raw.pipeline() as pipeline:
            tx.pipelined = True
            try:
                if tx.begin is not None:  # sent with what follows, not in a round trip alone
                    tx.raw.execute(tx.begin)
                    tx.begin = None
                yield
                tx.send_held()  # in the pipeline, whose end reads their answers
            except BaseException:
                tx.drop_held()
                # The statements queued after a failed one come back "aborted": read
                # them here, or psycopg's exit logs a warning about them on top of
                # the error that is already on its way (the transaction rolls back).
                with suppress(psycopg.Error):
                    pipeline.sync()
                raise
            finally:
                tx.pipelined = False

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
        # The lock, then the limit, the count and the claim in one statement whose
        # snapshot is taken after the lock is granted: exact as in SqliteStore. Both
        # go as one call of the claim function (_claim_function), in one round trip.
        # (LEAST and GREATEST skip NULLs: a missing pool row must be 0.)
        # ANY(ARRAY(...)): with IN (...) and a limit the planner cannot read, it would
        # hash-join the picked ids against a scan of the whole table. The rows are
        # updated where the pick locked them (ctid, a TID scan) rather than found
        # again by id, one primary-key descent each: a claim of 512 cost the
        # server 17-20 us a job before, 15-17 after. A row the pick locked is its
        # latest version and stays where it is; one that changed after this
        # statement's snapshot is not visible at its new place, and stays pending
        # (locked until the commit).
        params = (self.schema, pool, limit, worker_id, now)
        if not at_commit:
            rows = self._x(tx, self._claim_call, params)
            return lambda: self._payloads_of(tx, list(rows.fetchall()))
        # With the COMMIT, right after it in the same round trip: the claim lock is
        # held for server time only, never for a round trip to a busy client. Alone
        # (a dispatcher's claim) it is a transaction of its own.
        claim = tx.defer(self._claim_call, params, rows=True, alone=True, role="claim")
        return lambda: self._payloads_of(None, claim.rows)

    # What the claim functions return; the record-and-claim function's finished
    # rows among them have no kind.
    _CLAIM_COLUMNS = (
        "id text, kind text, fn_name text, attempt integer, timeout double precision,"
        " due_at double precision, on_complete text, context text, args text, place text"
    )

    @functools.cached_property
    def _claim_function(self) -> tuple[str, str]:
        """The name and the definition of the server function that claims from one
        pool: ``_claim_rows``'s lock, then its claim.

        One statement from the client instead of two, and in a transaction of its
        own, none of the BEGIN, the plan setting and the COMMIT either: a
        dispatcher's claim of one job, 2.10 -> 1.83 ms and 0.77 -> 0.43 ms of
        client CPU (medians of 360 after 10 ms idle, in a loop of the two shapes).
        A volatile function takes a fresh snapshot for each statement, so the
        claim's running count is read after the lock is granted, as with two
        statements. The name carries a hash of the definition: processes of two
        versions side by side each call their own.
        """
        claims = []
        for split in (False, True):
            tids = self._pick(
                "p_pool", self._room("p_limit", "p_pool"), "p_worker", "p_now", split=split
            )
            claim = self._sql(self._CLAIM % (f"ctid = ANY(ARRAY({tids}))", self._RETURNED))
            # The UPDATE's placeholders: the worker, then the start time.
            claims.append(claim.replace("%s", "p_worker", 1).replace("%s", "p_now", 1))
        body = (
            "(p_schema text, p_pool text, p_limit integer, p_worker text,"
            f" p_now double precision) RETURNS TABLE ({self._CLAIM_COLUMNS})"
            " LANGUAGE plpgsql VOLATILE"
            " SET plan_cache_mode = force_generic_plan AS $fn$"
            " #variable_conflict use_column\nBEGIN"
            " PERFORM pg_advisory_xact_lock(hashtext(p_schema), hashtext(p_pool));"
            f" IF p_limit < {CLAIM_SPLIT_MIN} THEN RETURN QUERY {claims[0]};"
            f" ELSE RETURN QUERY {claims[1]}; END IF; END $fn$"
        )
        name = f"{self.table_prefix}claim_{hashlib.sha1(body.encode()).hexdigest()[:12]}"
        return name, f"CREATE OR REPLACE FUNCTION {name} {body}"

    @functools.cached_property
    def _claim_call(self) -> str:
        return f"SELECT * FROM {self._claim_function[0]}(%s, %s, %s::int, %s, %s::float8)"

    @functools.cached_property
    def _record_claim_function(self) -> tuple[str, str]:
        """The name and the definition of the server function that finishes a batch
        of successes (``finish_succeeded``) and then claims from one pool (the claim
        function): a worker's record that refills the slots it freed, as one
        statement and a transaction of its own. As a pipeline of BEGIN, the plan
        setting, the two statements and COMMIT it took 0.3 ms more: 2.15 -> 1.85 ms
        p50 after 20 ms idle, the two alternating 600 times. It returns the rows the
        finish took, without a kind, then the claimed ones; each statement of a
        volatile function has its own snapshot, so the claim counts the slots the
        finish freed."""
        tail = (
            "SELECT id, NULL::text, NULL::text, attempt, NULL::float8, NULL::float8,"
            " NULL::text, NULL::text, NULL::text, NULL::text FROM gone"
        )
        finish = self._finish_succeeded_sql(self._success_rows, tail)
        names = iter(
            ("f_ids", "f_states", "f_attempts", "f_results", "f_places", "f_now", "f_worker")
        )
        finish = re.sub("%s", lambda _: next(names, "f_minute"), finish)
        params = (
            "f_ids text, f_states text, f_attempts text, f_results text, f_places text,"
            " f_now double precision, f_worker text, f_minute bigint"
        )
        return self._then_claim("record_claim", params, finish)

    @functools.cached_property
    def _record_claim_call(self) -> str:
        return (
            f"SELECT * FROM {self._record_claim_function[0]}"
            "(%s, %s, %s, %s, %s, %s::float8, %s, %s::bigint, %s, %s, %s::int, %s, %s::float8)"
        )

    @functools.cached_property
    def _end_claim_function(self) -> tuple[str, str]:
        """The name and the definition of the server function that ends an attempt
        (``end_attempt``: its slot is free, its outcome not recorded yet) and then
        claims from one pool (the claim function), as one statement and a
        transaction of its own. It returns the ended row (if it was still running),
        without a kind and with its new place, then the claimed ones; the claim's
        statement has its own snapshot, so it counts the slot the first freed."""
        end = (
            f"WITH e AS (UPDATE {self.table_prefix}work SET state = 'ended' WHERE id = e_id"
            " AND state = 'running' AND attempt = e_attempt RETURNING id, attempt, ctid)"
            " SELECT id, NULL::text, NULL::text, attempt, NULL::float8, NULL::float8,"
            " NULL::text, NULL::text, NULL::text, ctid::text FROM e"
        )
        return self._then_claim("end_claim", "e_id text, e_attempt integer", end)

    def _then_claim(self, kind: str, params: str, first: str) -> tuple[str, str]:
        """The name and the definition of a server function that runs the query
        ``first`` (over its parameters ``params``, SQL) and then the claim function,
        returning the rows of both: one statement from the client and a transaction
        of its own. Each statement of a volatile function has its own snapshot, so
        the claim counts the slots ``first`` freed. As the claim function's, the name
        carries a hash of the definition."""
        body = (
            f"({params}, p_schema text, p_pool text, p_limit integer, p_worker text,"
            f" p_now double precision) RETURNS TABLE ({self._CLAIM_COLUMNS})"
            " LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $fn$"
            f" #variable_conflict use_column\nBEGIN RETURN QUERY {first};"
            f" RETURN QUERY SELECT * FROM {self._claim_function[0]}"
            "(p_schema, p_pool, p_limit, p_worker, p_now); END $fn$"
        )
        name = f"{self.table_prefix}{kind}_{hashlib.sha1(body.encode()).hexdigest()[:12]}"
        return name, f"CREATE OR REPLACE FUNCTION {name} {body}"

    @functools.cached_property
    def _end_claim_call(self) -> str:
        return (
            f"SELECT * FROM {self._end_claim_function[0]}"
            "(%s, %s::int, %s, %s, %s::int, %s, %s::float8)"
        )

    # The claim's context (with a handler) and args, each NULL where the two
    # together exceed CLAIM_INLINE_BYTES (``octet_length`` reads a stored value's
    # size, not the value); ``_payloads_of`` reads those.
    _SMALL = f"octet_length(args) + coalesce(octet_length(context), 0) <= {CLAIM_INLINE_BYTES}"
    _PAYLOADS = (
        f"CASE WHEN on_complete IS NOT NULL AND {_SMALL} THEN context END,"
        f" CASE WHEN {_SMALL} THEN args END"
    )
    # And where the claim left the row (ClaimedWork.place): RETURNING gives the
    # ctid of the version the UPDATE wrote.
    _RETURNED = f"{_PAYLOADS}, ctid::text"

    def _payloads_of(self, tx: Tx | None, rows: list[Any]) -> list[Any]:
        """Claimed rows with the args and context that the claim left out read: in
        ``tx``, or (None) after the COMMIT, outside the claim lock, in a read of its
        own. The rows are running under this claim and their payloads never change."""

        def read(ids: list[str]) -> dict[str, tuple[str, str | None]]:
            def select(rtx: Tx) -> dict[str, tuple[str, str | None]]:
                # The args and the contexts as rows of their own: a message of 1.6 MB
                # costs the server and psycopg more per byte than two of 800 KB (3
                # rows of 800 KB args and 800 KB context: 11-12 -> 8.6-9 ms).
                match, params = self._id_in("w.id", ids)
                rows = self.q(
                    rtx,
                    f"SELECT w.id, false, {{args_w}} FROM {{s}}work w WHERE {match} UNION ALL"
                    f" SELECT w.id, true, {{context_w}} FROM {{s}}work w WHERE {match}"
                    " AND w.on_complete IS NOT NULL",
                    [*params, *params],
                ).fetchall()
                contexts = {r[0]: r[2] for r in rows if r[1]}
                return {r[0]: (r[2], contexts.get(r[0])) for r in rows if not r[1]}

            if tx is not None:
                return select(tx)
            return self.run(select, readonly=True, snapshot=False)

        return self._with_payloads(rows, read)

    def _pick(self, pool: str, free: str, worker: str, now: str, *, split: bool) -> str:
        """SQL for where the rows a claim takes from ``pool`` are (their ctid): its
        next due pending rows, at most ``free``, and after the first only while their
        args (and contexts, which a claim reads for a handler) stay within
        ``CLAIM_BYTES`` (``octet_length`` reads a stored value's size, not the
        value). The arguments are SQL (columns, or parameters: with ``split``,
        ``now`` twice, then ``worker``, then ``now``; without, ``now`` once).

        With ``split`` (a claim that may take CLAIM_SPLIT_MIN or more), where fewer
        rows are due than ``free``, but CLAIM_SPLIT_MIN or more, it takes only its
        worker's share of them (``SqlStore._share``): the rows picked go into one
        array with their count, and the share, whose counts of running rows and live
        workers run only where the claim splits, cuts it once per pool. The rows it
        leaves are free again at its COMMIT, before the next claim of the pool takes
        its lock. Smaller claims, which cannot split, pick without the array: 50
        pools of limit 10 (`bench/further.py --only pools`) drained at 10.6-13.7k
        jobs/s with it against 11.4-15.5k before (5 runs each), and level without
        it (3 alternated pairs)."""
        s = self.table_prefix
        window = (
            "SELECT tid, sum(size) OVER (ORDER BY due_at, id ROWS UNBOUNDED PRECEDING)"
            " - size AS before FROM (SELECT id, ctid AS tid, due_at, coalesce(payload_bytes,"
            " octet_length(args) + CASE WHEN on_complete IS NULL THEN 0"
            " ELSE coalesce(octet_length(context), 0) END) AS size"
            f" FROM {s}work WHERE pool = {pool} AND state = 'pending' AND due_at <= {now}"
            f" ORDER BY due_at, id LIMIT l.lim{self.skip_locked}) c"
        )
        if not split:
            return (
                f"SELECT d.tid FROM (SELECT {free} AS lim) l, LATERAL ({window}) d"
                f" WHERE d.before < {CLAIM_BYTES}"
            )
        running = f"(SELECT count(*) FROM {s}work WHERE pool = {pool} AND state = 'running'"
        live = (
            f"GREATEST((SELECT count(*) FROM {s}workers WHERE expires_at > {now}"
            f" AND (pools = '' OR {pool} = ANY(string_to_array(pools, ',')))), 1)"
        )
        mine = f"{running} AND worker_id = {worker})"
        share = self._share("g.total", f"{running})", mine, live)
        return (
            f"SELECT unnest(CASE WHEN g.total < {CLAIM_SPLIT_MIN} OR g.total >= g.lim"
            f" THEN g.tids ELSE g.tids[1:{share}::int] END) AS tid FROM (SELECT"
            f" array_agg(d.tid) FILTER (WHERE d.before < {CLAIM_BYTES}) AS tids,"
            f" count(*) AS total, min(l.lim) AS lim FROM (SELECT {free} AS lim) l,"
            f" LATERAL ({window}) d) g"
        )

    def claim_cut(self, claimed: Sequence[ClaimedWork]) -> bool:
        # Counted in characters, each at most 4 bytes in UTF-8: a claim that stopped
        # at CLAIM_BYTES always passes this; one that did not costs an empty claim.
        return sum(len(w.args) + len(w.context or "") for w in claimed) * 4 >= CLAIM_BYTES

    def _room(self, asked: str, pool: str) -> str:
        """SQL for how many rows a claim may take: ``asked`` at most, and no more
        than the pool's stored limit leaves beside its running rows. Both arguments
        are SQL (placeholders or columns); ``pool`` appears twice. One expression
        for every claim, of one pool or of many: the limit is exact in one place."""
        s = self.table_prefix
        return (
            f"GREATEST(LEAST({asked}, coalesce((SELECT max_parallelism FROM {s}pools"
            f" WHERE name = {pool}), 0) - (SELECT count(*) FROM {s}work WHERE pool = {pool}"
            " AND state = 'running')), 0)"
        )

    def claim_many_later(
        self, tx: Tx, asks: Mapping[str, int], worker_id: str, now: float
    ) -> Callable[[], dict[str, list[ClaimedWork]]]:
        if len(asks) < 2:
            return super().claim_many_later(tx, asks, worker_id, now)
        # Two statements for all the pools instead of two per pool: psycopg spends
        # some 25 us of Python on each statement, and a worker of 50 pools used to
        # send 80 of them with every commit. The locks come first, in a statement of
        # their own, so the claim's snapshot (and the running counts it reads) is
        # taken after they are granted, as with one pool.
        pools = sorted(asks)
        names, names_param = array_param(pools, "text")
        limits, limits_param = array_param([asks[p] for p in pools], "int")
        # unnest keeps the array's order: the locks are taken in sorted order.
        tx.defer(
            "SELECT count(pg_advisory_xact_lock(hashtext(%s), hashtext(p)))"
            f" FROM unnest({names}) p",
            (self.schema, names_param),
        )
        free = self._room("a.n", "a.pool")
        split = max(asks.values()) >= CLAIM_SPLIT_MIN
        pick = self._pick("a.pool", free, "%s", "%s", split=split)
        tids = f"SELECT c.tid FROM unnest({names}, {limits}) AS a(pool, n), LATERAL ({pick}) c"
        sql = self._sql(self._CLAIM % (f"ctid = ANY(ARRAY({tids}))", self._RETURNED) + ", pool")
        # The UPDATE's worker and time, the pools and what each is asked, then the
        # pick's (see _pick).
        picks = (now, now, worker_id, now) if split else (now,)
        params = (worker_id, now, names_param, limits_param, *picks)
        claim = tx.defer(sql, params, rows=True)

        def answer() -> dict[str, list[ClaimedWork]]:
            got: dict[str, list[ClaimedWork]] = {p: [] for p in pools}
            for row in self._payloads_of(None, claim.rows):
                got[row[10]].append(self._claimed_work(row[10], now, row))
            return got

        return answer

    def next_due(self, tx: Tx, pools: Sequence[str], after: float) -> float | None:
        # One statement text for any number of pools, one index probe per (pool,
        # state): a UNION ALL of two terms per pool was planned anew for each number
        # of pools, 250 ms at 500 pools, every time a worker of all pools went idle.
        names, param = array_param(list(pools), "text")
        s = self.table_prefix
        row = self._x(
            tx,
            f"SELECT min(m.due) FROM unnest({names}) AS p(pool)"
            " CROSS JOIN (VALUES ('pending'), ('completing')) AS st(state),"
            f" LATERAL (SELECT due_at AS due FROM {s}work WHERE pool = p.pool"
            " AND state = st.state AND due_at > %s ORDER BY due_at LIMIT 1) m",
            (param, after),
        ).fetchone()
        return None if row[0] is None else float(row[0])

    _INSERTED = (
        ("id", "text"),
        ("pool", "text"),
        ("kind", "text"),
        ("fn_name", "text"),
        ("args", "text"),
        ("on_complete", "text"),
        ("context", "text"),
        ("retry", "text"),
        ("timeout", "float8"),
        ("due_at", "float8"),
        ("enqueued_at", "float8"),
        ("payload_bytes", "int"),
    )

    def _insert_columns(self, tx: Tx, columns: list[Sequence[Any]], at_commit: bool) -> None:
        if columns[0]:
            columns, payloads = self._split_payloads(tx, columns, "")
            sql, params = self._insert_statement(tx, "work", columns)
            if payloads is not None:
                sql, params = f"WITH pay AS ({payloads[0]}) {sql}", [*payloads[1], *params]
            self._write(tx, sql, params, at_commit=at_commit)  # at commit: one round trip less

    def _split_payloads(
        self, tx: Tx, columns: list[Sequence[Any]], where: str
    ) -> tuple[list[Sequence[Any]], tuple[str, list[Any]] | None]:
        """``_work_columns``' columns with payload_bytes added, the args and context
        of the items over INLINE_CHARS left NULL; and the INSERT of those into
        payloads (ending in ``where``) and its parameters, or None."""
        ids, args, on_complete, contexts = columns[0], columns[4], columns[5], columns[6]
        n = len(ids)
        big, inline_args, inline_contexts = self._apart(args, contexts, INLINE_CHARS)
        if not big:
            return [*columns, [None] * n], None
        sizes: list[int | None] = [None] * n
        for k in big:
            # What a claim reads of them (the context only for a handler), in
            # characters: the claim's byte budget counts them as octet_length would.
            sizes[k] = len(args[k]) + (0 if on_complete[k] is None else len(contexts[k] or ""))
        picked = [[column[k] for k in big] for column in (ids, contexts, args)]
        split = [*columns[:4], inline_args, columns[5], inline_contexts, *columns[7:], sizes]
        return split, self._insert_statement(tx, "payloads", picked, where)

    # The pool's config, as _POOL_COLUMNS, compared whole: any change sends the
    # enqueue back to read it (one transaction more), never past a stale one.
    _SAME_POOL = (
        f"SELECT EXISTS (SELECT 1 FROM {{p}}pools WHERE ({SqlStore._POOL_COLUMNS})"
        " IS NOT DISTINCT FROM (%s::text, %s::int, %s::smallint, %s::int, %s::float8,"
        " %s::float8, %s::text, %s::float8, %s::int)) AS same"
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
        # The check, the insert and the notification are one statement, sent with the
        # COMMIT; when nothing else was sent, it goes alone, as its own transaction:
        # the whole enqueue is one statement and one round trip.
        columns = self._work_columns(items)
        if not columns[0]:
            return lambda: True
        where = " WHERE (SELECT same FROM ok)"
        columns, payloads = self._split_payloads(tx, columns, where)
        insert, params = self._insert_statement(tx, "work", columns, where)
        sql = f"WITH ok AS ({self._SAME_POOL.format(p=self.table_prefix)}), new AS ({insert})"
        params = [*self._pool_params(config), *params]
        if payloads is not None:
            sql += f", pay AS ({payloads[0]})"
            params += payloads[1]
        answer = " SELECT same FROM ok"
        if notify:
            sql += ", woken AS (SELECT pg_notify(%s, %s) WHERE (SELECT same FROM ok))"
            answer = " SELECT same, (SELECT count(*) FROM woken) FROM ok"
            params += [self.channel, config.name]
        if not at_commit:
            # Read when first asked: inside a pipeline, after its end.
            cursor = self._x(tx, sql + answer, params)
            return functools.cache(lambda: bool(cursor.fetchone()[0]))
        check = tx.defer(sql + answer, params, rows=True, alone=notify)
        return lambda: bool(check.rows[0][0])

    # The columns that _insert_statement writes, per table, and the values of the
    # rest (a new work row's state and counts).
    _INSERTS: ClassVar[dict[str, tuple[tuple[tuple[str, str], ...], str, str]]] = {
        "work": (
            _INSERTED,
            ", state, attempt, cancel_requested, handler_failures, lost_count",
            ", 'pending', 0, 0, 0, 0",
        ),
        "payloads": ((("id", "text"), ("context", "text"), ("args", "text")), "", ""),
    }

    def _insert_statement(
        self, tx: Tx, table: str, columns: Sequence[Sequence[Any]], where: str = ""
    ) -> tuple[str, list[Any]]:
        """The INSERT into ``table`` (work or payloads) of rows given by column, as
        _INSERTS lists them, ending in ``where``; and its parameters."""
        # One statement over arrays instead of one per row: a batch of 1,000 is one
        # round trip and one plan. Columns equal in every row (pool, function, times
        # of a batch, a batch's shared context) go as one value, not as an array of
        # 1,000 copies (of 800 KB each, for a context that big).
        inserted, fixed, fixed_values = self._INSERTS[table]
        n = len(columns[0])
        # Per column: None for one value, else the array expression and its parameter.
        # A single row takes no arrays at all: psycopg dumps twelve values instead of
        # building twelve arrays, and the server has none to split and unnest (a
        # single enqueue: 2.56 -> 2.14 ms, medians of 6 interleaved runs).
        shapes = [
            None if column.count(column[0]) == n else array_param(column, kind)
            for column, (_, kind) in zip(columns, inserted, strict=True)
        ]
        exprs = tuple(None if shape is None else shape[0] for shape in shapes)
        sql = self._insert_sql.get((table, tx.retrying, where, exprs))
        if sql is None:
            # A retry after an ambiguous commit (connection lost) must not fail on the
            # ids the first try may have written; a first try need not pay for the
            # conflict check (speculative insertion: inserts 15-25 % slower).
            conflict = " ON CONFLICT (id) DO NOTHING" if tx.retrying else ""
            cols = list(zip(inserted, exprs, strict=True))
            arrays = ", ".join(expr for _, expr in cols if expr is not None)
            names = ", ".join(name for (name, _), expr in cols if expr is not None)
            values = ", ".join(
                f"%b::{kind}" if expr is None else name for (name, kind), expr in cols
            )
            all_names = ", ".join(name for name, _ in inserted) + fixed
            sql = self._insert_sql[table, tx.retrying, where, exprs] = (
                f"INSERT INTO {self.table_prefix}{table} ({all_names})"
                f" SELECT {values}{fixed_values}"
                f"{f' FROM unnest({arrays}) AS t({names})' if arrays else ''}{where}{conflict}"
            )
        # The SELECT list's single values come first in the statement, then the arrays.
        pairs = list(zip(columns, shapes, strict=True))
        params = [c[0] for c, shape in pairs if shape is None]
        params += [shape[1] for _, shape in pairs if shape is not None]
        return sql, params

    def _write(self, tx: Tx, sql: str, params: Sequence[Any], *, at_commit: bool) -> None:
        """A statement whose result nobody reads: at once, or with the COMMIT."""
        if at_commit:
            tx.defer(sql, params)
        else:
            self._x(tx, sql, params)

    # Array parameters go through array_param: as joined text where they can, else in
    # binary (%b); psycopg's text format escapes every JSON element with a regular
    # expression, 7x slower for a batch of 1,000 args.
    #
    ids_per_read = 1_000_000  # one array parameter: no need to cut a read

    def _id_in(self, column: str, ids: Sequence[str]) -> tuple[str, list[Any]]:
        # Many ids as one array: with a mark per id psycopg parses the text again on
        # every call and the server plans it again (status_batch of 10,000 ids: 230
        # -> 115 ms). One id as one mark: for "= ANY(array)" the server's generic plan
        # looks dearer than a custom one, so it planned a status() on every call
        # (1 ms of planning; 0.30 -> 0.55 ms a status).
        if len(ids) == 1:
            return f"{column} = ?", list(ids)
        expr, param = array_param(ids, "text")
        return f"{column} = ANY({expr})", [param]

    def load_many_for_update(self, tx: Tx, ids: Sequence[str]) -> dict[str, ActiveWork]:
        # Two statement texts, for one id and for any more (_id_in): with a mark per
        # id (IN (...)) each size was a new statement for psycopg to parse and the
        # server to plan, and none was ever prepared; with an array for one id the
        # server planned every single cancel anew. Sorted ids lock rows in one
        # global order.
        ordered = sorted(set(storable(ids)))
        if not ordered:
            return {}
        match, params = self._id_in("w.id", ordered)
        rows = self.q(
            tx,
            f"SELECT {ACTIVE_COLUMNS} FROM {{s}}work w WHERE {match} ORDER BY w.id FOR UPDATE",
            params,
        ).fetchall()
        return {row[0]: active_row(row) for row in rows}

    # Completions are set-based: one statement per batch over arrays, not one per row.
    # Per-row statements cost the server an executor start-up each; at a batch of
    # 128 that was most of its time per job.
    #
    # Each joins its rows to ``work`` by id, state and attempt, the state too taken
    # from the arrays, never a constant: against ``w.state = 'running'``, statistics
    # taken while few rows ran (an ANALYZE of a backlog) made the planner scan
    # ``work`` for running rows and rescan the arrays once for each: 512 x 512
    # comparisons, 80 ms a batch, a drain 26k -> 10k jobs/s. Joined, the rows can
    # only be found from the arrays, through the primary key, or by a hash join.
    def finish_many(
        self, tx: Tx, items: Sequence[Finishing], now: float, *, at_commit: bool = False
    ) -> None:
        if not items:
            return
        s = self.table_prefix
        rows, params = unnest(
            [
                ([f.work.id for f in items], "text"),
                ([f.work.state for f in items], "text"),
                ([f.work.attempt for f in items], "int"),
                ([f.outcome for f in items], "text"),
                ([f.result for f in items], "text"),
                ([f.handler_error for f in items], "text"),
            ]
        )
        self._write(
            tx,
            f"WITH f AS (SELECT * FROM {rows}"
            " AS f(id, state, attempt, outcome, result, handler_error)),"
            f" gone AS (DELETE FROM {s}work w USING f WHERE w.id = f.id AND w.state = f.state"
            " AND w.attempt = f.attempt RETURNING w.id, w.pool, w.fn_name, w.kind, w.args,"
            " w.on_complete, f.outcome, f.result, w.attempt, w.enqueued_at, w.last_error,"
            " f.handler_error)"
            f" INSERT INTO {s}finished (id, pool, fn_name, kind, args, on_complete, outcome,"
            " result, attempts, enqueued_at, finished_at, last_error, handler_error)"
            " SELECT id, pool, fn_name, kind, args, on_complete, outcome, result, attempt,"
            " enqueued_at, %s, last_error, handler_error FROM gone",
            [*params, now],
            at_commit=at_commit,
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
        rows, params = unnest(self._success_columns(items))
        args = [*params, now, worker_id, minute_of(now)]
        sql = self._finish_succeeded_sql(rows, "SELECT id, attempt FROM gone")
        if at_commit:
            # The record-and-claim function takes the arrays as joined strings: a
            # batch whose text needs a binary array keeps the statement.
            role = "finish" if rows == self._success_rows else None
            found = tx.defer(sql, args, rows=True, role=role)
            return lambda: [(r[0], r[1]) for r in found.rows]
        # Planned as with the COMMIT (see _begin's end), and only this statement.
        self._x(tx, "SET LOCAL plan_cache_mode = force_generic_plan")
        taken = [(r[0], r[1]) for r in self._x(tx, sql, args).fetchall()]
        self._x(tx, "SET LOCAL plan_cache_mode = DEFAULT")
        return lambda: taken

    @staticmethod
    def _success_columns(
        items: Sequence[Succeeded],
    ) -> list[tuple[Sequence[Any], str]]:
        return [
            ([i[0] for i in items], "text"),
            ([i[6] for i in items], "text"),
            ([i[1] for i in items], "int"),
            ([i[2] for i in items], "text"),
            # Without a place, the finish finds the row by id.
            ([i[5] or NOWHERE for i in items], "text"),
        ]

    @functools.cached_property
    def _success_rows(self) -> str:
        """``unnest`` of a batch of successes whose arrays go as joined strings."""
        return unnest(self._success_columns([("id", 1, "null", "pool", 0.0, NOWHERE, "running")]))[
            0
        ]

    def _finish_succeeded_sql(self, rows: str, tail: str) -> str:
        """The finish of a batch of successes (``rows``: the ``unnest`` of its
        columns), ending in ``tail``, a SELECT from ``gone``, the rows it took."""
        # Counted by the statement itself: which rows were still running is known
        # only there, and the counters go in the same round trip.
        # Each row is looked for where its claim left it (a TID scan instead of a
        # descent of the primary key: the server's CPU for a drain 34 -> 30 us a
        # job), and by id only if it moved since (an update in between: a cancel
        # flag, say). The id is compared at the place too, which another row may
        # hold by then. The DELETE by id runs after the first, whose ids it reads,
        # and looks up only the rest.
        gone = (
            "DELETE FROM {s}work w USING f WHERE %s AND w.state = f.state"
            " AND w.attempt = f.attempt RETURNING w.id, w.pool, w.fn_name, w.kind, w.args,"
            " w.on_complete, f.result, w.attempt, w.enqueued_at, w.last_error,"
            " GREATEST(w.started_at - w.due_at, 0) AS lag"
        )
        return self._sql(
            f"WITH f AS (SELECT id, state, attempt, result, place::tid AS place FROM {rows}"
            " AS f(id, state, attempt, result, place)),"
            f" placed AS ({gone % 'w.ctid = f.place AND w.id = f.id'}),"
            f" moved AS ({gone % 'w.id = f.id AND f.id NOT IN (SELECT id FROM placed)'}),"
            " gone AS (SELECT * FROM placed UNION ALL SELECT * FROM moved),"
            " done AS (INSERT INTO {s}finished (id, pool, fn_name, kind, args, on_complete,"
            " outcome, result, attempts, enqueued_at, finished_at, last_error)"
            " SELECT id, pool, fn_name, kind, args, on_complete, 'success', result,"
            " attempt, enqueued_at, %s, last_error FROM gone),"
            f" counted AS ({self._COUNT_SUCCESSES}) {tail}"
        )

    # The successes in ``gone`` (pool, lag) added to the worker's counters
    # (parameters: worker, minute); the start lags fall in histogram.LAG_BOUNDS
    # buckets as in bucket(). Grouped by pool and bucket first, then by pool: in one
    # pass the planner put the bucket's CASE into each of the histogram's fourteen
    # aggregates, and evaluated it for every one (lags of a second: 1.9 -> 0.45 us
    # a row of server time).
    _COUNT_SUCCESSES = (
        f"INSERT INTO {{s}}counters (pool, worker_id, bucket, {', '.join(SqlStore._SUMMED)},"
        " lag_max) SELECT pool, ?, ?, sum(n), sum(n), 0, 0, 0, sum(n), sum(s), "
        + ", ".join(f"coalesce(sum(n) FILTER (WHERE b = {i}), 0)" for i in range(len(LAG_BOUNDS)))
        + ", max(m) FROM (SELECT pool, b, count(*) AS n, sum(lag) AS s, max(lag) AS m"
        " FROM (SELECT pool, lag, CASE "
        + " ".join(f"WHEN lag <= {b!r} THEN {i}" for i, b in enumerate(LAG_BOUNDS[:-1]))
        + f" ELSE {len(LAG_BOUNDS) - 1} END AS b FROM gone) x GROUP BY pool, b) g"
        " GROUP BY pool" + SqlStore._COUNTERS_ADDED
    )

    def retry_many(self, tx: Tx, items: Sequence[Retrying], *, at_commit: bool = False) -> None:
        if not items:
            return
        rows, params = unnest(
            [
                ([r.work.id for r in items], "text"),
                ([r.work.state for r in items], "text"),
                ([r.work.attempt for r in items], "int"),
                ([r.due_at for r in items], "float8"),
                ([r.error for r in items], "text"),
                ([int(r.lost) for r in items], "int"),
            ]
        )
        self._write(
            tx,
            f"UPDATE {self.table_prefix}work w SET state = 'pending', due_at = r.due_at,"
            " last_error = r.error, worker_id = NULL, lost_count = w.lost_count + r.lost"
            f" FROM {rows} AS r(id, state, attempt, due_at, error, lost)"
            " WHERE w.id = r.id AND w.state = r.state AND w.attempt = r.attempt",
            params,
            at_commit=at_commit,
        )

    def hand_many(self, tx: Tx, items: Sequence[Handing], *, at_commit: bool = False) -> None:
        if not items:
            return
        rows, params = unnest(
            [
                ([h.work.id for h in items], "text"),
                ([h.work.state for h in items], "text"),
                ([h.work.attempt for h in items], "int"),
                ([h.result for h in items], "text"),
                ([h.due_at for h in items], "float8"),
                ([h.failures for h in items], "int"),
                ([h.error for h in items], "text"),
            ]
        )
        self._write(
            tx,
            f"UPDATE {self.table_prefix}work w SET state = 'completing', result = h.result,"
            " due_at = h.due_at, handler_failures = h.failures, last_error = h.error,"
            f" worker_id = NULL FROM {rows}"
            " AS h(id, state, attempt, result, due_at, failures, error)"
            " WHERE w.id = h.id AND w.state = h.state AND w.attempt = h.attempt",
            params,
            at_commit=at_commit,
        )

    def prune(self, tx: Tx, pool: str, before: float, limit: int) -> int:
        s = self.table_prefix
        row = self._x(
            tx,
            f"WITH gone AS (DELETE FROM {s}finished WHERE id IN (SELECT id FROM {s}finished"
            " WHERE pool = %s AND finished_at < %s ORDER BY finished_at LIMIT %s)"
            f" RETURNING id, args IS NULL AS paid), unpaid AS (DELETE FROM {s}payloads"
            " WHERE id IN (SELECT id FROM gone WHERE paid)) SELECT count(*) FROM gone",
            (pool, before, limit),
        ).fetchone()
        return int(row[0])

    def send_rows(self, connection: Any, sql: str, rows: list[Any]) -> None:
        # A handler's one-row INSERT, once per item of a batch: as rows of a few
        # statements, the server runs one INSERT per 2**k rows instead of one per
        # row, and psycopg binds their values without a message and a result each.
        form = insert_rows_form(sql)
        if form is None or any(not isinstance(r, list | tuple) or len(r) != form[2] for r in rows):
            super().send_rows(connection, sql, rows)
            return
        head, row, width = form
        most = max(_ROWS_PARAMS // max(width, 1), 1)
        i = 0
        while i < len(rows):
            n = 1 << (min(most, len(rows) - i).bit_length() - 1)
            part = rows[i : i + n]
            connection.execute(head + ", ".join([row] * n), [v for r in part for v in r])
            i += n

    def _executemany(self, tx: Tx, sql: str, rows: list[tuple[Any, ...]]) -> None:
        with tx.connection.cursor() as cur:
            cur.executemany(sql, rows)


def _alive(conn: psycopg.BaseConnection[Any]) -> bool:
    """False for a pooled connection that the server has closed while it was idle.

    Transactions send their BEGIN with their first statements, so a dead connection
    would only fail there, in the middle of a transaction. An idle connection gets
    nothing from the server unless it is being closed (a restart, a terminated
    backend): anything waiting on its socket, or the end of the stream, means dead.
    This costs a poll, not a round trip.
    """
    if conn.closed or conn.broken:
        return False
    return not readable([conn.fileno()], 0)


def _finish(conn: psycopg.BaseConnection[Any]) -> None:
    """Close a connection without waiting: what ``AsyncConnection.close`` does, but
    callable outside an event loop (``close``) and in a task being canceled."""
    conn.pgconn.finish()


def _finish_all(conns: list[psycopg.AsyncConnection[Any]]) -> None:
    for conn in conns:
        _finish(conn)


class _NotConnected:
    """The connection of a transaction that ``run_async`` makes its statement in: any
    use of it would send something at once, which ``run_async`` does not do."""

    def __getattr__(self, name: str) -> Any:
        raise WouldWait(f"the statement needs the connection ({name}) at once")


_NOT_CONNECTED = _NotConnected()


class _Listener(Watcher):
    """``LISTEN`` on the schema's channel, on a connection of its own (not pooled).

    It waits in ``poll`` on the connection's socket (``InputWait``), which
    ``interrupt`` ends. psycopg's ``notifies(timeout=...)`` cost about a
    millisecond of CPU each time it timed out: 2 % of a core for an idle worker
    that woke every 50 ms to see whether it was stopping.
    """

    def __init__(self, conninfo: str, channel: str) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.conn: psycopg.Connection[Any] | None = None
        self._input = InputWait()

    def wait(self, timeout: float) -> bool:
        if self._input.interrupted:
            return False
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(self.conninfo, autocommit=True)
            self.conn.execute(f'LISTEN "{self.channel}"')
            return True  # (re)connected: anything may have happened meanwhile
        if not self._input.wait(self.conn.fileno(), timeout):
            return False
        try:
            # Takes every notification that has arrived, so that none waits in
            # libpq's buffer while the next poll() waits on the socket.
            return any(True for _ in self.conn.notifies(timeout=0))
        except psycopg.Error:
            self.conn.close()
            raise

    def interrupt(self) -> None:
        self._input.interrupt()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._input.close()
