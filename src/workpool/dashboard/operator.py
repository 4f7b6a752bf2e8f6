"""The operator's view of an App, shared by the ``workpool`` commands and the web dashboard.

Pools are seen by their **stored** config: a ``Pool`` declared in the app module
with options (``app.pool("mail", max_parallelism=2)``) would otherwise show, and
on its first write re-apply, the module's options instead of what an operator
set at run time. Statuses come with one sentence that says why the work is
where it is and what to do about it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from workpool.app import App
from workpool.core.errors import InvalidArgumentError
from workpool.core.results import (
    Canceled,
    Failed,
    Finished,
    Pending,
    Running,
    Status,
    Success,
    WorkInfo,
    result_to_json,
)
from workpool.observability.stats import PoolStats
from workpool.pool import Pool

LEASE_DEFAULT_S = 15.0  # App.run_worker's default lease, quoted in explanations


class UnknownPoolError(InvalidArgumentError):
    """No pool of that name is stored in the database or declared by the app."""


class UnknownWorkError(InvalidArgumentError):
    """No work item with that id: never enqueued, or finished and expired."""


def redact(url: str) -> str:
    """The URL without its password, for printing."""
    password = urlsplit(url).password
    return url.replace(f":{password}@", ":***@") if password else url


def pools(app: App) -> list[Pool]:
    """Every pool, by name; stored pools see their stored config, not the module's options."""
    stored = {c.name for c in app.run(app.store.load_pools, readonly=True)}
    return [Pool(app, p.name, {}) if p.name in stored else p for p in app.pools()]


def pool(app: App, name: str) -> Pool:
    """The pool ``name`` (as in ``pools``); UnknownPoolError if there is none."""
    by_name = {p.name: p for p in pools(app)}
    if name not in by_name:
        known = ", ".join(sorted(by_name)) or "none yet"
        raise UnknownPoolError(f"no pool named {name!r} (pools: {known})")
    return by_name[name]


def stats(app: App, window: float) -> list[PoolStats]:
    return [p.stats(window=window) for p in pools(app)]


# --- one work item -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkDetail:
    """``app.inspect`` and ``pool.status`` of one item, with the sentence that explains it."""

    info: WorkInfo
    status: Status
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "info": self.info.to_dict(),
            "status": status_to_dict(self.status),
            "explanation": self.explanation,
        }


def work_detail(app: App, work_id: str) -> WorkDetail:
    """Everything about one item; UnknownWorkError when it is unknown or expired."""
    info = app.inspect(work_id)
    if info is None:
        raise UnknownWorkError(
            f"no work item {work_id!r}: never enqueued here, or finished and expired"
            " (finished work is kept for the pool's status_ttl, 24 h by default)"
        )
    status = Pool(app, info.pool, {}).status(work_id)
    return WorkDetail(info, status, explain(status, info, app.clock()))


def cancel_work(app: App, work_ids: list[str]) -> dict[str, str]:
    """Cancel each item in its own pool: ``canceled``, ``not changed`` or ``unknown`` per id.

    Not changed: finished, or running with its cancel already requested.
    """
    outcome: dict[str, str] = {}
    for work_id in work_ids:
        info = app.inspect(work_id)
        if info is None:
            outcome[work_id] = "unknown"
        elif Pool(app, info.pool, {}).cancel(work_id):
            outcome[work_id] = "canceled"
        else:
            outcome[work_id] = "not changed"
    return outcome


def status_to_dict(status: Status) -> dict[str, Any]:
    if isinstance(status, Finished):
        return {
            "state": "finished",
            "result": None if status.result is None else result_dict(status.result),
            "on_complete_error": status.on_complete_error,
        }
    return asdict(status)


def result_dict(result: Success | Failed | Canceled) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(result_to_json(result))
    return data


# --- explanations ------------------------------------------------------------------------


def explain(status: Status, info: WorkInfo | None = None, now: float | None = None) -> str:
    """Why the work is where it is, and what an operator can do about it, in one sentence."""
    now = time.time() if now is None else now
    pool = info.pool if info is not None else "its pool"
    match status:
        case Pending(reason="scheduled", due_at=due_at):
            return f"scheduled: its first attempt may start {when(due_at, now)}."
        case Pending(reason="backoff", due_at=due_at, last_error=error, previous_attempts=n):
            return (
                f"waiting to retry: attempt {n} failed ({error or 'no error recorded'});"
                f" attempt {n + 1} may start {when(due_at, now)}."
            )
        case Pending(reason="paused"):
            return (
                f"paused: pool {pool!r} has max_parallelism 0, so nothing of it starts;"
                f" resume it (`workpool resume APP {pool}`) to continue."
            )
        case Pending(reason="waiting_for_slot", running=running, limit=limit):
            return (
                f"waiting for a slot: {running} of {limit} slots of pool {pool!r} are busy;"
                f" it starts when one frees up (raise the limit with"
                f" `workpool set APP {pool} --max-parallelism N`)."
            )
        case Pending():
            return (
                f"due now with a free slot: a worker serving pool {pool!r} should start it"
                f" within moments; if it stays here, check that one runs"
                f" (`workpool worker APP --pool {pool}`) and has free concurrency."
            )
        case Running():
            return _explain_running(status, info, now)
        case Finished():
            return _explain_finished(status)
    raise AssertionError(f"not a status: {status!r}")  # pragma: no cover


def _explain_finished(status: Finished) -> str:
    match status.result:
        case None:
            return (
                "unknown or expired: never enqueued here, or finished longer ago than the"
                " pool's status_ttl (24 h by default)."
            )
        case Success():
            text = "finished: succeeded."
        case Failed(error=error):
            text = f"finished: failed ({error})."
        case Canceled():
            text = "finished: canceled."
    if status.on_complete_error:
        text += f" Its on_complete handler was given up: {status.on_complete_error}."
    return text


def _explain_running(status: Running, info: WorkInfo | None, now: float) -> str:
    if info is not None and info.state == "completing":
        outcome = info.result.kind if info.result is not None else "a result"
        error = f" (last handler error: {info.last_error})" if info.last_error else ""
        return (
            f"finishing: the work ended with {outcome}; its on_complete handler"
            f" {info.on_complete or ''} has not committed yet and is retried by a worker"
            f"{error}. It counts as Running until the handler commits or is given up."
        )
    attempt = status.attempt or status.previous_attempts + 1
    worker = f" on worker {info.worker_id}" if info is not None and info.worker_id else ""
    if info is not None and info.state == "ended":
        return (
            f"ending: attempt {attempt} returned{worker} and gave its slot to the next"
            " attempt; its outcome is being recorded. If that worker died first, the"
            f" attempt counts as failed once its lease expires ({LEASE_DEFAULT_S:g} s by"
            " default)."
        )
    since = f" since {ago(status.started_at, now)}" if status.started_at else ""
    cancel = " Cancel requested: it will not be retried." if info and info.cancel_requested else ""
    return (
        f"running: attempt {attempt}{since}{worker}. If that worker died, the attempt counts"
        f" as failed once its lease expires ({LEASE_DEFAULT_S:g} s by default).{cancel}"
    )


def pool_note(s: PoolStats) -> str:
    """Why a pool's backlog waits (or that it does not), in a few words."""
    if s.paused:
        return "paused: nothing starts"
    if s.backlog and s.running >= s.max_parallelism:
        return f"at its limit: {s.backlog} due wait for a slot"
    if s.backlog:
        return "due work, free slots: is a worker serving it?"
    if s.running or s.completing:
        return "busy"
    if s.scheduled:
        return "waiting for scheduled work"
    return "idle"


def duration(seconds: float) -> str:
    """``850 ms``, ``12.5 s``, ``4 min 10 s``, ``3 h 5 min``, ``2 d 4 h``."""
    seconds = abs(seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    return f"{hours // 24} d {hours % 24} h"


def when(at: float | None, now: float) -> str:
    """``in 4 min 10 s`` or ``now``."""
    if at is None or at <= now:
        return "now"
    return f"in {duration(at - now)}"


def ago(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    if at > now:
        return f"in {duration(at - now)}"
    return f"{duration(now - at)} ago"
