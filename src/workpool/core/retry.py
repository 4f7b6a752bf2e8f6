"""RetryBehavior, how a per-call ``retry`` option resolves, and backoff with jitter."""

from __future__ import annotations

import math
from dataclasses import dataclass

from workpool.core.errors import InvalidArgumentError, InvalidTypeError, show

MAX_ATTEMPTS = 10_000  # beyond that, "retry forever" is a bug, and counters stay 32-bit
MAX_BACKOFF_S = 86_400.0


@dataclass(frozen=True, slots=True)
class RetryBehavior:
    """How an action is retried: ``max_attempts`` counts all attempts (2 = one retry).

    The wait before retry n (n >= 1) is ``initial_backoff * base**(n-1)`` seconds,
    multiplied by a jitter factor drawn from [0.5, 1.5).
    """

    max_attempts: int = 5
    initial_backoff: float = 0.25
    base: float = 2.0

    def __post_init__(self) -> None:
        # Every type first, then every value: a wrong type is a TypeError whatever
        # else is wrong.
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise InvalidTypeError(
                f"max_attempts must be an int, got {type(self.max_attempts).__name__}"
            )
        for name in ("initial_backoff", "base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidTypeError(f"{name} must be a number, got {type(value).__name__}")
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS:
            raise InvalidArgumentError(
                f"max_attempts must be in 1..{MAX_ATTEMPTS:,}, got {show(self.max_attempts)}"
            )
        for name in ("initial_backoff", "base"):
            value = getattr(self, name)
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int beyond any float
                finite = False
            if not finite:
                raise InvalidArgumentError(f"{name} must be finite, got {show(value)}")
        if not 0 <= self.initial_backoff <= MAX_BACKOFF_S:
            raise InvalidArgumentError(
                f"initial_backoff must be in 0..86400 seconds, got {show(self.initial_backoff)}"
            )
        if self.base < 1:
            raise InvalidArgumentError(f"base must be >= 1, got {show(self.base)}")

    def delay(self, retry_number: int, rand: float) -> float:
        """Seconds to wait before retry ``retry_number`` (1-based); ``rand`` in [0, 1)."""
        # A day caps absurd growth (base 10, 30 attempts) so due times stay representable.
        try:
            raw = min(self.initial_backoff * self.base ** (retry_number - 1), MAX_BACKOFF_S)
        except OverflowError:  # base ** n beyond any float: the cap, or 0 when no wait
            raw = MAX_BACKOFF_S if self.initial_backoff > 0 else 0.0
        return float(raw * (0.5 + rand))

    def to_json(self) -> dict[str, float | int]:
        return {
            "max_attempts": self.max_attempts,
            "initial_backoff": self.initial_backoff,
            "base": self.base,
        }

    @classmethod
    def from_json(cls, data: dict[str, float | int]) -> RetryBehavior:
        return cls(int(data["max_attempts"]), float(data["initial_backoff"]), float(data["base"]))


DEFAULT_RETRY = RetryBehavior()

RetryOption = bool | RetryBehavior | None


def resolve_retry(
    option: object, *, default: RetryBehavior, retry_by_default: bool
) -> RetryBehavior | None:
    """The retry behaviour of one enqueued action, ``None`` meaning "no retries"."""
    if option is None:
        return default if retry_by_default else None
    if option is True:
        return default
    if option is False:
        return None
    if isinstance(option, RetryBehavior):
        return option
    raise InvalidTypeError(
        f"retry must be True, False, None or a RetryBehavior, got {show(option)}"
    )
