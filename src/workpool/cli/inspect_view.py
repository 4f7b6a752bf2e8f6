"""What `workpool inspect` prints: one work item, field by field, with its status explained."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from workpool.core.results import Canceled, Failed, Success
from workpool.dashboard.operator import WorkDetail, ago

ARGS_MAX_CHARS = 600  # args and results are cropped; --json shows them whole


def timestamp(at: float | None, now: float) -> str | None:
    if at is None:
        return None
    local = datetime.fromtimestamp(at).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"{local} ({ago(at, now)})"


def cropped(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > ARGS_MAX_CHARS:
        text = text[:ARGS_MAX_CHARS] + f"… ({len(text)} chars; --json shows all)"
    return text


def detail_table(detail: WorkDetail, now: float) -> Table:
    info, status = detail.info, detail.status
    table = Table(box=box.SIMPLE, show_header=False, show_edge=False, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")

    def row(name: str, value: str | None) -> None:
        if value is not None:
            table.add_row(name, escape(value))

    row("work id", info.work_id)
    row("pool", info.pool)
    row("function", f"{info.fn_name} ({info.kind})")
    state = status.state if info.state == status.state else f"{status.state} ({info.state})"
    row("status", state)
    table.add_row("why", escape(detail.explanation))
    of = f" of at most {info.max_attempts}" if info.max_attempts else ""
    row("attempts", f"{info.attempts}{of}")
    row("args", cropped(info.args))
    row("enqueued", timestamp(info.enqueued_at, now))
    if info.state == "pending":
        row("due", timestamp(info.due_at, now))
    row("started", timestamp(info.started_at, now))
    row("finished", timestamp(info.finished_at, now))
    row("worker", info.worker_id)
    row("timeout", f"{info.timeout:g} s" if info.timeout else None)
    row("last error", info.last_error)
    match info.result:
        case Success(value):
            row("result", f"success: {cropped(value)}")
        case Failed(error):
            row("result", f"failed: {error}")
        case Canceled():
            row("result", "canceled")
    if info.cancel_requested:
        row("cancel", "requested: the running attempt finishes and is not retried")
    if info.on_complete:
        handler = info.on_complete
        if info.on_complete_error:
            handler += f" (given up: {info.on_complete_error})"
        row("on_complete", handler)
    return table
