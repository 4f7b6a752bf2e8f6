"""The outcome of work (``Result``) and its status as seen by callers (``Status``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Success:
    """The work ran and returned ``return_value``."""

    return_value: Any = None
    kind: Literal["success"] = "success"


@dataclass(frozen=True, slots=True)
class Failed:
    """The work failed for good; ``error`` describes the last failure."""

    error: str
    kind: Literal["failed"] = "failed"


@dataclass(frozen=True, slots=True)
class Canceled:
    """The work was canceled before it could finish."""

    kind: Literal["canceled"] = "canceled"


Result = Success | Failed | Canceled


def success_json(encoded: str) -> str:
    """The stored form of ``Success`` whose return value is already the JSON ``encoded``."""
    return '{"kind": "success", "return_value": ' + encoded + "}"


def result_to_json(result: Result) -> str:
    match result:
        case Success(value):
            return success_json(json.dumps(value))
        case Failed(error):
            return json.dumps({"kind": "failed", "error": error})
        case Canceled():
            return '{"kind": "canceled"}'


def result_from_json(text: str) -> Result:
    data = json.loads(text)
    match data.get("kind"):
        case "success":
            return Success(data.get("return_value"))
        case "failed":
            return Failed(str(data.get("error", "")))
        case "canceled":
            return Canceled()
    raise ValueError(f"not a stored result: {text[:100]!r}")


PendingReason = Literal["scheduled", "backoff", "paused", "waiting_for_slot", "due"]


@dataclass(frozen=True, slots=True)
class Pending:
    """Waiting to start (first start, or a retry waiting for its backoff).

    ``reason`` tells why it is not running now; ``due_at`` (unix seconds) is when
    it may start, ``last_error`` the error of the previous attempt, ``running``
    and ``limit`` the pool's occupancy when it waits for a slot.
    """

    previous_attempts: int
    reason: PendingReason = "due"
    due_at: float | None = None
    last_error: str | None = None
    running: int | None = None
    limit: int | None = None
    state: Literal["pending"] = "pending"


@dataclass(frozen=True, slots=True)
class Running:
    """An attempt is running, or the final on_complete has not committed yet."""

    previous_attempts: int
    attempt: int | None = None
    started_at: float | None = None
    state: Literal["running"] = "running"


@dataclass(frozen=True, slots=True)
class Finished:
    """Finished; ``result`` is ``None`` once the work is unknown or expired.

    ``on_complete_error`` is set when the on_complete handler kept failing and was
    given up after its retries (the result is still the work's real result).
    """

    result: Result | None = None
    on_complete_error: str | None = None
    state: Literal["finished"] = "finished"


Status = Pending | Running | Finished


@dataclass(frozen=True, slots=True)
class WorkInfo:
    """Everything known about one work item, for operators (``app.inspect``).

    ``state`` is the stored state: pending, running, ended, completing or finished.
    ``attempts`` counts attempts started so far; ``args`` are the decoded args.
    """

    work_id: str
    pool: str
    kind: str
    fn_name: str
    state: str
    args: Any
    attempts: int
    enqueued_at: float
    due_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker_id: str | None = None
    last_error: str | None = None
    result: Result | None = None
    on_complete: str | None = None
    on_complete_error: str | None = None
    cancel_requested: bool = False
    max_attempts: int | None = None
    timeout: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__slots__}
        if self.result is not None:
            data["result"] = json.loads(result_to_json(self.result))
        return data
