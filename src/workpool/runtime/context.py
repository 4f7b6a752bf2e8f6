"""``workpool.current()``: what the running function is, from inside it."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunInfo:
    """The attempt being run: ``attempt`` counts from 1."""

    work_id: str
    pool: str
    fn_name: str
    attempt: int


_current: ContextVar[RunInfo] = ContextVar("workpool_current")


def current() -> RunInfo:
    """The RunInfo of the running attempt; ``LookupError`` outside one."""
    try:
        return _current.get()
    except LookupError:
        raise LookupError("workpool.current() called outside a running work item") from None


def set_current(info: RunInfo) -> object:
    return _current.set(info)


def reset_current(token: object) -> None:
    _current.reset(token)  # type: ignore[arg-type]
