"""What happens after an attempt ends: finish with a result, or retry at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workpool.core.results import Canceled, Failed, Result, Success
from workpool.core.retry import RetryBehavior

# An on_complete handler that raises is retried this many times in all, with
# this backoff; afterwards the work finishes with the handler failure recorded.
HANDLER_RETRY = RetryBehavior(max_attempts=5, initial_backoff=0.5, base=2.0)


@dataclass(frozen=True, slots=True)
class Succeeded:
    value: Any
    encoded: str | None = None  # ``value`` as JSON, when the caller already made it


@dataclass(frozen=True, slots=True)
class Raised:
    error: str
    retryable: bool = True


AttemptOutcome = Succeeded | Raised


@dataclass(frozen=True, slots=True)
class Finish:
    result: Result


@dataclass(frozen=True, slots=True)
class RetryAt:
    due_at: float
    error: str


Decision = Finish | RetryAt


def decide(
    outcome: AttemptOutcome,
    *,
    attempt: int,
    retry: RetryBehavior | None,
    cancel_requested: bool,
    now: float,
    rand: float,
) -> Decision:
    """Decide the fate of work whose attempt number ``attempt`` (1-based) just ended.

    A canceled item reports its real result when it succeeded or failed for good;
    only a failure that would have been retried turns into ``Canceled``.
    """
    match outcome:
        case Succeeded(value):
            return Finish(Success(value))
        case Raised(error, retryable):
            if retryable and retry is not None and attempt < retry.max_attempts:
                if cancel_requested:
                    return Finish(Canceled())
                return RetryAt(now + retry.delay(attempt, rand), error)
            return Finish(Failed(error))
