"""The read side of the shared SQL: status, inspection, counters and live pool numbers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from workpool.core import histogram
from workpool.core.results import WorkInfo, result_from_json
from workpool.core.retry import RetryBehavior
from workpool.core.states import RECORDABLE
from workpool.store.base import (
    ActiveStatus,
    ActiveWork,
    Counters,
    FinishedRow,
    PoolCounts,
    StatusRow,
    Tx,
)

IN_CHUNK = 500  # ids per IN (...) list: well under SQLite's variable limit
# Rows whose attempt's outcome may still be recorded (``RECORDABLE``: running, or
# ended), as the condition on their state: ``f"state {RECORDABLE_IN}"``.
RECORDABLE_IN = "IN (" + ", ".join(f"'{state.value}'" for state in sorted(RECORDABLE)) + ")"
# Of ``{s}work w``. {context_w}, {args_w} and {args_f} (of ``{s}finished f``) are
# where the store keeps a row's payload: see SqlStore.PAYLOAD_SQL.
ACTIVE_COLUMNS = (
    "w.id, w.pool, w.kind, w.fn_name, w.state, w.attempt, w.retry, w.on_complete,"
    " {context_w}, w.cancel_requested, w.enqueued_at, w.due_at, w.result,"
    " w.handler_failures, w.lost_count, w.last_error, w.worker_id, w.started_at"
)
# Of an active row, what a status reads: its id, then ``ActiveStatus``. (Of a
# finished row it reads the id, the result and the handler's error.)
STATUS_COLUMNS = "w.id, w.pool, w.state, w.attempt, w.due_at, w.last_error, w.started_at"
HIST_COLUMNS = tuple(f"lag_h{i}" for i in range(len(histogram.LAG_BOUNDS)))


def _nulls(count: int) -> str:
    return ", ".join(["NULL"] * count)


def _decoded(text: str) -> Any:
    """Stored JSON, or the raw text when a row holds something that is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


_RETRY_CACHE: dict[str, RetryBehavior] = {}  # a pool's items share a few retry policies


def _retry(text: str | None) -> RetryBehavior | None:
    """The stored retry policy, parsed once per distinct text (it is immutable)."""
    if text is None:
        return None
    behavior = _RETRY_CACHE.get(text)
    if behavior is None:
        behavior = RetryBehavior.from_json(json.loads(text))
        if len(_RETRY_CACHE) >= 1024:
            _RETRY_CACHE.clear()
        _RETRY_CACHE[text] = behavior
    return behavior


def active_row(row: Sequence[Any]) -> ActiveWork:
    return ActiveWork(
        id=row[0],
        pool=row[1],
        kind=row[2],
        fn_name=row[3],
        state=row[4],
        attempt=int(row[5]),
        retry=_retry(row[6]),
        on_complete=row[7],
        context=row[8],
        cancel_requested=bool(row[9]),
        enqueued_at=float(row[10]),
        due_at=float(row[11]),
        result=row[12],
        handler_failures=int(row[13]),
        lost_count=int(row[14]),
        last_error=row[15],
        worker_id=row[16],
        started_at=None if row[17] is None else float(row[17]),
    )


def storable(ids: Sequence[str]) -> list[str]:
    """Ids that could exist: one with a NUL character cannot be stored (PostgreSQL
    text refuses it), so it is unknown rather than an error from the driver."""
    return [i for i in ids if "\x00" not in i]


class SqlReads:
    """Queries that answer operators and clients; mixed into SqlStore, which runs them."""

    def q(self, tx: Tx, template: str, params: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    def _sql(self, template: str) -> str:
        raise NotImplementedError

    # Ids per ``_id_in`` match: a mark each here, so well under SQLite's variable
    # limit; a store whose match takes them as one array needs no chunks.
    ids_per_read: ClassVar[int] = IN_CHUNK

    def _id_in(self, column: str, ids: Sequence[str]) -> tuple[str, list[Any]]:
        """``column`` matching one of ``ids`` (at most ``ids_per_read``; or of pool
        names), and its parameters."""
        return f"{column} IN ({', '.join('?' * len(ids))})", list(ids)

    def _id_chunks(self, ids: Sequence[str]) -> list[Sequence[str]]:
        """``ids`` in chunks that one ``_id_in`` match each takes."""
        step = self.ids_per_read
        return [ids[i : i + step] for i in range(0, len(ids), step)]

    _SUMMED = (
        "completed",
        "succeeded",
        "failed",
        "retries",
        "canceled",
        "lag_count",
        "lag_sum",
        *HIST_COLUMNS,
    )

    # The end of an INSERT into counters that adds to the row already there.
    _COUNTERS_ADDED = (
        " ON CONFLICT (pool, worker_id, bucket) DO UPDATE SET "
        + ", ".join(f"{c} = {{s}}counters.{c} + excluded.{c}" for c in _SUMMED)
        + ", lag_max = CASE WHEN excluded.lag_max > {s}counters.lag_max"
        " THEN excluded.lag_max ELSE {s}counters.lag_max END"
    )

    def work_info(self, tx: Tx, work_id: str) -> WorkInfo | None:
        if not storable([work_id]):
            return None
        row = self.q(
            tx,
            "SELECT id, pool, kind, fn_name, state, {args_w}, attempt, enqueued_at, due_at,"
            " started_at, worker_id, last_error, result, on_complete, cancel_requested, retry,"
            " timeout FROM {s}work w WHERE id = ?",
            (work_id,),
        ).fetchone()
        if row is not None:
            retry = None if row[15] is None else json.loads(row[15])
            return WorkInfo(
                work_id=row[0],
                pool=row[1],
                kind=row[2],
                fn_name=row[3],
                state=row[4],
                args=_decoded(row[5]),
                attempts=int(row[6]),
                enqueued_at=float(row[7]),
                due_at=float(row[8]),
                started_at=None if row[9] is None else float(row[9]),
                worker_id=row[10],
                last_error=row[11],
                result=None if row[12] is None else result_from_json(row[12]),
                on_complete=row[13],
                cancel_requested=bool(row[14]),
                max_attempts=None if retry is None else int(retry["max_attempts"]),
                timeout=None if row[16] is None else float(row[16]),
            )
        found = self._finished_info(tx, "id = ?", (work_id,), 1)
        return found[0] if found else None

    def recent_failures(self, tx: Tx, pool: str, limit: int) -> list[WorkInfo]:
        return self._finished_info(
            tx, "pool = ? AND outcome = 'failed'", (pool,), limit, order="finished_at DESC"
        )

    def _finished_info(
        self, tx: Tx, where: str, params: tuple[Any, ...], limit: int, order: str = "id"
    ) -> list[WorkInfo]:
        rows = self.q(
            tx,
            "SELECT id, pool, kind, fn_name, {args_f}, attempts, enqueued_at, finished_at,"
            " last_error, result, on_complete, handler_error FROM {s}finished f"
            f" WHERE {where} ORDER BY {order} LIMIT ?",
            (*params, limit),
        ).fetchall()
        return [
            WorkInfo(
                work_id=r[0],
                pool=r[1],
                kind=r[2],
                fn_name=r[3],
                state="finished",
                args=_decoded(r[4]),
                attempts=int(r[5]),
                enqueued_at=float(r[6]),
                finished_at=float(r[7]),
                last_error=r[8],
                result=result_from_json(r[9]),
                on_complete=r[10],
                on_complete_error=r[11],
            )
            for r in rows
        ]

    def statuses(self, tx: Tx, ids: Sequence[str]) -> dict[str, StatusRow]:
        found: dict[str, StatusRow] = {}
        ids = storable(ids)
        for chunk in self._id_chunks(ids):
            if len(chunk) == 1:
                rows = self.q(tx, self._STATUS_ONE, [chunk[0], chunk[0]]).fetchall()
                self._status_rows(rows, found)
                continue
            active, active_params = self._id_in("w.id", chunk)
            done, done_params = self._id_in("f.id", chunk)
            # One statement, so one snapshot and one round trip: the active rows, with
            # the occupancy of the pools of pending ones, and the finished rows. As two
            # pipelined reads and then the occupancy it took twice as long on PostgreSQL.
            rows = self.q(
                tx,
                f"WITH a AS (SELECT {STATUS_COLUMNS} FROM {{s}}work w WHERE {active}),"
                " o AS (SELECT p.pool, (SELECT count(*) FROM {s}work r"
                " WHERE r.pool = p.pool AND r.state = 'running') AS running,"
                " (SELECT c.max_parallelism FROM {s}pools c WHERE c.name = p.pool) AS lim"
                " FROM (SELECT DISTINCT pool FROM a WHERE state = 'pending') p)"
                " SELECT 'a', a.*, o.running, o.lim, NULL, NULL"
                " FROM a LEFT JOIN o ON o.pool = a.pool"
                f" UNION ALL SELECT 'f', f.id, {_nulls(8)}, f.result, f.handler_error"
                f" FROM {{s}}finished f WHERE {done}",
                [*active_params, *done_params],
            ).fetchall()
            self._status_rows(rows, found)
        return found

    # The same rows for one id (``status()``), the pool's occupancy as subqueries of
    # its row rather than a CTE grouped by pool: SQLite 0.033 -> 0.020 ms a call
    # (200 ids on a 10k backlog, medians of 8 interleaved passes); PostgreSQL 0.217
    # -> 0.205, within its noise.
    _STATUS_ONE = (
        f"SELECT 'a', {STATUS_COLUMNS}, CASE WHEN w.state = 'pending' THEN (SELECT"
        " count(*) FROM {s}work r WHERE r.pool = w.pool AND r.state = 'running') END,"
        " CASE WHEN w.state = 'pending' THEN (SELECT c.max_parallelism FROM {s}pools c"
        " WHERE c.name = w.pool) END, NULL, NULL FROM {s}work w WHERE w.id = ?"
        f" UNION ALL SELECT 'f', f.id, {_nulls(8)}, f.result, f.handler_error"
        " FROM {s}finished f WHERE f.id = ?"
    )

    @staticmethod
    def _status_rows(rows: list[Any], found: dict[str, StatusRow]) -> None:
        """Adds the rows of a status read (an active row, else a finished one) to
        ``found``."""
        for row in rows:
            if row[0] == "a":
                occupancy = None
                if row[8] is not None:
                    occupancy = (int(row[8]), None if row[9] is None else int(row[9]))
                active = ActiveStatus(
                    pool=row[2],
                    state=row[3],
                    attempt=int(row[4]),
                    due_at=float(row[5]),
                    last_error=row[6],
                    started_at=None if row[7] is None else float(row[7]),
                )
                found[row[1]] = StatusRow(active=active, occupancy=occupancy)
        for row in rows:
            if row[0] == "f" and row[1] not in found:  # an active row comes first
                found[row[1]] = StatusRow(finished=FinishedRow(row[10], row[11]))

    def add_counters(
        self, tx: Tx, pool: str, worker_id: str, bucket: int, counters: Counters
    ) -> None:
        # One row per (pool, worker, minute): completions of different workers never
        # update the same row. Nothing reads it back in the transaction, so it waits
        # for the COMMIT (on PostgreSQL, in the COMMIT's round trip).
        sql, params = self.counters_upsert(pool, worker_id, bucket, counters)
        tx.defer(self._sql(sql), params)

    @classmethod
    def counters_upsert(
        cls, pool: str, worker_id: str, bucket: int, counters: Counters
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement (a template for ``_sql``) adding ``counters`` to a worker's
        row of the minute, and its parameters."""
        columns = (*cls._SUMMED, "lag_max")
        return (
            f"INSERT INTO {{s}}counters (pool, worker_id, bucket, {', '.join(columns)})"
            f" VALUES (?, ?, ?, {', '.join('?' * len(columns))})" + cls._COUNTERS_ADDED,
            (
                pool,
                worker_id,
                bucket,
                counters.completed,
                counters.succeeded,
                counters.failed,
                counters.retries,
                counters.canceled,
                counters.lag_count,
                counters.lag_sum,
                *counters.lag_hist,
                counters.lag_max,
            ),
        )

    @staticmethod
    def _counters(row: Sequence[Any]) -> Counters:
        hist = tuple(int(v or 0) for v in row[7 : 7 + len(HIST_COLUMNS)])
        return Counters(
            int(row[0] or 0),
            int(row[1] or 0),
            int(row[2] or 0),
            int(row[3] or 0),
            int(row[4] or 0),
            int(row[5] or 0),
            float(row[6] or 0),
            float(row[7 + len(HIST_COLUMNS)] or 0),
            hist,
        )

    def read_counters(self, tx: Tx, pool: str, since_bucket: int) -> Counters:
        sums = ", ".join(f"sum({c})" for c in self._SUMMED)
        row = self.q(
            tx,
            f"SELECT {sums}, max(lag_max) FROM {{s}}counters WHERE pool = ? AND bucket >= ?",
            (pool, since_bucket),
        ).fetchone()
        return self._counters(row)

    def history(self, tx: Tx, pool: str, since_bucket: int) -> list[tuple[int, Counters]]:
        sums = ", ".join(f"sum({c})" for c in self._SUMMED)
        rows = self.q(
            tx,
            f"SELECT {sums}, max(lag_max), bucket FROM {{s}}counters WHERE pool = ?"
            " AND bucket >= ? GROUP BY bucket ORDER BY bucket",
            (pool, since_bucket),
        ).fetchall()
        return [(int(row[-1]), self._counters(row)) for row in rows]

    def prune_counters(self, tx: Tx, pool: str, before_bucket: int) -> int:
        cur = self.q(
            tx, "DELETE FROM {s}counters WHERE pool = ? AND bucket < ?", (pool, before_bucket)
        )
        return int(cur.rowcount)

    def pool_counts(self, tx: Tx, pool: str, now: float) -> PoolCounts:
        # A count per state, each over its own range of the (pool, state, due_at, id)
        # index and without reading the rows: one pass over the pool's rows that
        # sorted them by state with CASEs read each row. With 200k pending and 200k
        # finished, stats() took 86 ms on SQLite and 142 ms on PostgreSQL (now 31 and
        # 99 ms).
        row = self.q(
            tx,
            "SELECT (SELECT count(*) FROM {s}work WHERE pool = ? AND state = 'running'),"
            " (SELECT count(*) FROM {s}work WHERE pool = ? AND state = 'pending'"
            " AND due_at <= ?),"
            " (SELECT count(*) FROM {s}work WHERE pool = ? AND state = 'pending'"
            " AND due_at > ?),"
            " (SELECT count(*) FROM {s}work WHERE pool = ? AND state IN ('completing', 'ended')),"
            " (SELECT count(*) FROM {s}finished WHERE pool = ?)",
            (pool, pool, now, pool, now, pool, pool),
        ).fetchone()
        return PoolCounts(*(int(n) for n in row))

    def active_count(self, tx: Tx, pools: Sequence[str]) -> int:
        match, names = self._id_in("pool", pools)
        row = self.q(tx, f"SELECT count(*) FROM {{s}}work WHERE {match}", names).fetchone()
        return int(row[0])
