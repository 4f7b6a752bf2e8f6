"""The App of the chaos run: its pools, its functions and the records they leave.

Imported by the worker processes (``workpool worker chaos.chaos_app:app``), by the
enqueuer processes and by the orchestrator; the store comes from
``$WORKPOOL_DATABASE_URL``.

What the work itself records, for the checker:

* every run of an action, mutation or query appends a start line and (unless its
  process is killed) an end line to ``$CHAOS_RECORDS/<pid>.jsonl`` -- one file per
  process, opened with O_APPEND, one ``os.write`` per line, so a SIGKILL never
  leaves half a line and no database fault can lose or fake a record;
* a mutation inserts one row into ``chaos_mut`` inside its own transaction;
* the on_complete handler ``done`` inserts one row into ``chaos_done`` inside the
  transaction that finishes the work, and may enqueue a follow-up with ``tx=tx``
  (recorded in ``chaos_items`` in that same transaction).

The user tables carry no unique constraint on purpose: a double effect must show
up as two rows, not as an error that the library would retry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import workpool
from workpool import NonRetryableError, RetryBehavior

app = workpool.App()  # $WORKPOOL_DATABASE_URL

# workpool's events (one JSON object a line) with the time they were logged, so the
# checker can tell when a killed worker's attempts were rescued.
_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("%(created).6f %(message)s"))
logging.getLogger("workpool").addHandler(_handler)
logging.getLogger("workpool").setLevel(logging.DEBUG)

IS_SQLITE = app.url.startswith("sqlite")
P = "?" if IS_SQLITE else "%s"
SCHEMA = None if IS_SQLITE else dict(parse_qsl(urlsplit(app.url).query)).get("schema", "workpool")
PREFIX = "" if SCHEMA is None else f'"{SCHEMA}".'
T_ITEMS = f"{PREFIX}chaos_items"
T_DONE = f"{PREFIX}chaos_done"
T_MUT = f"{PREFIX}chaos_mut"

MIXED_LIMIT = 4
TX_LIMIT = 3
DEFAULT_MAX_ATTEMPTS = 4
# Actions: sync and async, with and without retry, some flaky, some failing for good.
mixed = app.pool(
    "mixed",
    max_parallelism=MIXED_LIMIT,
    retry_actions_by_default=False,
    default_retry=RetryBehavior(max_attempts=DEFAULT_MAX_ATTEMPTS, initial_backoff=0.05, base=2.0),
)
# Mutations and queries: they run inside the store's transaction.
txpool = app.pool("tx", max_parallelism=TX_LIMIT)
POOLS = {"mixed": mixed, "tx": txpool}
LIMITS = {"mixed": MIXED_LIMIT, "tx": TX_LIMIT}

# --- records ---------------------------------------------------------------------------------

_fd: dict[int, int] = {}
_fd_lock = threading.Lock()


def _records_fd() -> int:
    pid = os.getpid()
    fd = _fd.get(pid)
    if fd is None:
        with _fd_lock:
            fd = _fd.get(pid)
            if fd is None:
                directory = os.environ["CHAOS_RECORDS"]
                fd = os.open(
                    os.path.join(directory, f"{pid}.jsonl"),
                    os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                    0o644,
                )
                _fd[pid] = fd
    return fd


def record(**fields: Any) -> None:
    """Append one JSON line (one write: a kill never leaves half a line)."""
    line = json.dumps({"pid": os.getpid(), "t": time.time(), **fields}, separators=(",", ":"))
    os.write(_records_fd(), (line + "\n").encode())


class _Run:
    """Start and end records around one run of a function (the end even when it raises)."""

    def __init__(self, kind: str) -> None:
        info = workpool.current()
        self.fields = {"w": info.work_id, "a": info.attempt, "pool": info.pool, "k": kind}
        self.tok = uuid.uuid4().hex[:12]
        self.outcome = "raised"

    def __enter__(self) -> _Run:
        record(ev="s", tok=self.tok, **self.fields)
        return self

    def __exit__(self, *exc: object) -> None:
        record(ev="e", tok=self.tok, o=self.outcome, **self.fields)


# --- the functions ---------------------------------------------------------------------------


def _fate(fail: float, fatal: float) -> str:
    r = random.random()
    if r < fatal:
        return "fatal"
    if r < fatal + fail:
        return "flaky"
    return "ok"


def _finish(run: _Run, fate: str, ms: int) -> dict[str, Any]:
    run.outcome = fate
    if fate == "fatal":
        raise NonRetryableError("chaos: fatal failure")
    if fate == "flaky":
        raise RuntimeError("chaos: flaky failure")
    return {"ms": ms}


@app.action(name="act")
def act(ms: int, fail: float = 0.0, fatal: float = 0.0) -> dict[str, Any]:
    with _Run("act") as run:
        time.sleep(ms / 1000)
        return _finish(run, _fate(fail, fatal), ms)


@app.action(name="act_async")
async def act_async(ms: int, fail: float = 0.0, fatal: float = 0.0) -> dict[str, Any]:
    with _Run("act_async") as run:
        await asyncio.sleep(ms / 1000)
        return _finish(run, _fate(fail, fatal), ms)


@app.mutation(name="mut")
def mut(tx: workpool.Tx, n: int, fail: bool = False, ms: int = 0) -> int:
    with _Run("mut") as run:
        if ms:
            time.sleep(ms / 1000)
        info = workpool.current()
        tx.execute(
            f"INSERT INTO {T_MUT} (work_id, attempt, pid, t) VALUES ({P}, {P}, {P}, {P})",
            (info.work_id, info.attempt, os.getpid(), time.time()),
        )
        if fail:
            run.outcome = "fatal"
            raise ValueError("chaos: mutation fails on purpose (its insert rolls back)")
        run.outcome = "ok"
        return n


@app.query(name="qry")
def qry(tx: workpool.Tx) -> int:
    with _Run("qry") as run:
        count = int(tx.execute(f"SELECT count(*) FROM {T_MUT}").fetchone()[0])
        run.outcome = "ok"
        return count


@app.mutation(name="done")
def done(tx: workpool.Tx, work_id: str, context: Any, result: workpool.Result) -> None:
    """on_complete: one row per call; maybe a follow-up enqueued in the same transaction."""
    context = context or {}
    followup = None
    planned = context.get("followup")
    if planned:  # (never mutate the context: a retried handler must see it unchanged)
        spec = {k: v for k, v in planned.items() if k != "args"}
        followup = enqueue(spec, [planned["args"]], tx=tx, parent=work_id, via="on_complete")[0]
    tx.execute(
        f"INSERT INTO {T_DONE} (work_id, kind, followup, pid, t) VALUES ({P}, {P}, {P}, {P}, {P})",
        (work_id, result.kind, followup, os.getpid(), time.time()),
    )
    if random.random() < float(context.get("flaky", 0.0)):
        # Rolled back to the handler's savepoint (row and follow-up too), retried later.
        raise RuntimeError("chaos: flaky on_complete")


# --- what gets enqueued ----------------------------------------------------------------------

RETRY_3 = {"max_attempts": 3, "initial_backoff": 0.02, "base": 2.0}


def random_batch(rng: random.Random, gen: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A batch spec (function, options shared by the batch) and one args dict per item."""
    r = rng.random()
    size = 1 if rng.random() < 0.6 else rng.randint(2, 5) if rng.random() < 0.75 else 12
    spec: dict[str, Any] = {"gen": gen}
    if r < 0.62:
        spec["fn"] = "act" if r < 0.5 else "act_async"
        spec["pool"] = "mixed"
        spec["retry"] = rng.choice([True, False, None, RETRY_3])
        fail = rng.choice([0.0, 0.0, 0.2, 0.5])
        fatal = rng.choice([0.0, 0.0, 0.05])
        args = [{"ms": rng.randint(5, 50), "fail": fail, "fatal": fatal} for _ in range(size)]
    elif r < 0.66:
        # Slow actions: the ones the canceler catches while running.
        spec["fn"] = "act"
        spec["pool"] = "mixed"
        spec["retry"] = rng.choice([True, RETRY_3])
        spec["slow"] = True
        size = 1
        args = [{"ms": rng.randint(150, 400), "fail": 0.3}]
    elif r < 0.9:
        spec["fn"] = "mut"
        spec["pool"] = "tx"
        args = [
            {"n": rng.randint(0, 10**6), "fail": rng.random() < 0.1, "ms": rng.randint(0, 3)}
            for _ in range(size)
        ]
    else:
        spec["fn"] = "qry"
        spec["pool"] = "tx"
        args = [{} for _ in range(size)]
    if rng.random() < 0.15:
        spec["run_after"] = round(rng.uniform(0.5, 4.0), 3)
    if rng.random() < 0.8:
        context: dict[str, Any] = {"gen": gen}
        if rng.random() < 0.2:
            context["flaky"] = 0.15
        if gen == 0 and rng.random() < 0.25:
            fspec, fargs = random_batch(rng, gen + 1)
            fspec["args"] = fargs[0]
            context["followup"] = fspec
        spec["context"] = context
    return spec, args


def max_attempts(spec: dict[str, Any]) -> int | None:
    """How many attempts an action of this spec may have (None: not an action)."""
    if spec["fn"] not in ("act", "act_async"):
        return None
    retry = spec.get("retry")
    if retry is True:
        return DEFAULT_MAX_ATTEMPTS
    if isinstance(retry, dict):
        return int(retry["max_attempts"])
    return 1  # False, or None with retry_actions_by_default=False


def enqueue(
    spec: dict[str, Any],
    args_list: list[dict[str, Any]],
    *,
    tx: Any = None,
    parent: str | None = None,
    via: str = "tx",
) -> list[str]:
    """Enqueue a batch per ``spec``; with ``tx``, record it in ``chaos_items`` in that tx."""
    pool = POOLS[spec["pool"]]
    options: dict[str, Any] = {"tx": tx}
    if spec.get("run_after"):
        options["run_after"] = spec["run_after"]
    if "context" in spec:
        options["on_complete"] = done
        options["context"] = spec["context"]
    fn = spec["fn"]
    if fn in ("act", "act_async"):
        retry = spec.get("retry")
        options["retry"] = RetryBehavior(**retry) if isinstance(retry, dict) else retry
        ids = pool.enqueue_action_batch(fn, args_list, **options)
    elif fn == "mut":
        ids = pool.enqueue_mutation_batch(fn, args_list, **options)
    else:
        ids = pool.enqueue_query_batch(fn, args_list, **options)
    if tx is not None:
        record_items(tx, spec, args_list, ids, parent, via)
    return ids


def record_items(
    tx: Any,
    spec: dict[str, Any],
    args_list: list[dict[str, Any]],
    ids: list[str],
    parent: str | None,
    via: str,
) -> None:
    item_spec = {k: v for k, v in spec.items() if k != "context"}
    item_spec["on_complete"] = "context" in spec
    item_spec["followup"] = bool(spec.get("context", {}).get("followup"))
    item_spec["max_attempts"] = max_attempts(spec)
    now = time.time()
    for work_id, args in zip(ids, args_list, strict=True):
        tx.execute(
            f"INSERT INTO {T_ITEMS} (work_id, pool, fn, spec, parent, via, t)"
            f" VALUES ({P}, {P}, {P}, {P}, {P}, {P}, {P})",
            (
                work_id,
                spec["pool"],
                spec["fn"],
                json.dumps({**item_spec, "args": args}),
                parent,
                via,
                now,
            ),
        )


def create_tables(tx: Any) -> None:
    """The user tables of the run (called once by the orchestrator, after migrations)."""
    seq = "INTEGER PRIMARY KEY AUTOINCREMENT" if IS_SQLITE else "BIGSERIAL PRIMARY KEY"
    real = "REAL" if IS_SQLITE else "DOUBLE PRECISION"
    tx.execute(
        f"CREATE TABLE {T_ITEMS} (seq {seq}, work_id TEXT NOT NULL, pool TEXT NOT NULL,"
        f" fn TEXT NOT NULL, spec TEXT NOT NULL, parent TEXT, via TEXT NOT NULL, t {real})"
    )
    tx.execute(f"CREATE INDEX chaos_items_work ON {T_ITEMS} (work_id)")
    tx.execute(
        f"CREATE TABLE {T_DONE} (work_id TEXT NOT NULL, kind TEXT NOT NULL, followup TEXT,"
        f" pid INTEGER, t {real})"
    )
    tx.execute(
        f"CREATE TABLE {T_MUT} (work_id TEXT NOT NULL, attempt INTEGER, pid INTEGER, t {real})"
    )
