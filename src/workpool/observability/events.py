"""The event catalogue: every structured event workpool logs, with its level and fields.

Each event is one JSON object on the ``workpool`` logger, tagged
``"component": "workpool"``. A pool's stored log level decides which print:
at REPORT only ``report``; at INFO and below every event.
"""

from __future__ import annotations

import json
import logging
from typing import Any

INFO = logging.INFO
TRACE = 15
REPORT = 25
logging.addLevelName(TRACE, "TRACE")
logging.addLevelName(REPORT, "REPORT")

LEVELS = {
    "DEBUG": logging.DEBUG,
    "TRACE": TRACE,
    "INFO": logging.INFO,
    "REPORT": REPORT,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
}

logger = logging.getLogger("workpool")


def shown(level: int, pool_level: str) -> bool:
    """Would an event at ``level`` print for a pool at ``pool_level``?"""
    return level >= LEVELS.get(pool_level, REPORT) and logger.isEnabledFor(level)


def emit(event: str, level: int, pool_level: str, **fields: Any) -> None:
    """Log ``event`` if the pool's level lets it through."""
    if not shown(level, pool_level):
        return
    logger.log(level, json.dumps({"component": "workpool", "event": event, **fields}))


def enqueued(
    pool_level: str, *, pool: str, work_id: str, fn_name: str, kind: str, due_at: float
) -> None:
    emit(
        "enqueued",
        logging.INFO,
        pool_level,
        pool=pool,
        work_id=work_id,
        fn_name=fn_name,
        kind=kind,
        due_at=round(due_at, 3),
    )


def started(
    pool_level: str, *, pool: str, work_id: str, fn_name: str, attempt: int, start_lag: float
) -> None:
    if not shown(logging.INFO, pool_level):  # per attempt: skip building what is filtered
        return
    emit(
        "started",
        logging.INFO,
        pool_level,
        pool=pool,
        work_id=work_id,
        fn_name=fn_name,
        attempt=attempt,
        start_lag=round(start_lag, 6),
    )


def completed(
    pool_level: str,
    *,
    pool: str,
    work_id: str,
    fn_name: str,
    status: str,
    attempts: int,
    duration: float | None,
    error: str | None = None,
) -> None:
    if not shown(logging.INFO, pool_level):  # per attempt: skip building what is filtered
        return
    fields: dict[str, Any] = {
        "pool": pool,
        "work_id": work_id,
        "fn_name": fn_name,
        "status": status,
        "attempts": attempts,
        "duration": None if duration is None else round(duration, 6),
    }
    if error is not None:
        fields["error"] = error
    emit("completed", logging.INFO, pool_level, **fields)


def report(pool_level: str, **fields: Any) -> None:
    emit("report", REPORT, pool_level, **fields)


def handler_failed(
    pool_level: str,
    *,
    pool: str,
    work_id: str,
    handler: str,
    failures: int,
    error: str,
    traceback: str,
    final: bool,
) -> None:
    emit(
        "on_complete_failed",
        logging.ERROR if final else logging.WARNING,
        pool_level,
        pool=pool,
        work_id=work_id,
        handler=handler,
        failures=failures,
        error=error,
        final=final,
        traceback=traceback,
    )


def worker_event(event: str, level: int, **fields: Any) -> None:
    """Worker lifecycle events (start, stop, lost work, loop errors), at the default level."""
    emit(event, level, "REPORT", **fields)
