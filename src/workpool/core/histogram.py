"""Start-lag histogram: fixed bucket bounds shared by the store, stats and metrics."""

from __future__ import annotations

import bisect

# Upper bounds in seconds; the last bucket holds everything slower.
LAG_BOUNDS: tuple[float, ...] = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    float("inf"),
)
EMPTY: tuple[int, ...] = (0,) * len(LAG_BOUNDS)


def bucket(seconds: float) -> int:
    """The index of the bucket that holds ``seconds``."""
    return bisect.bisect_left(LAG_BOUNDS, seconds)


def add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def quantile(hist: tuple[int, ...], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` (0 when empty).

    The open last bucket reports the largest finite bound: "at least 10 s".
    """
    total = sum(hist)
    if total == 0:
        return 0.0
    rank = q * total
    seen = 0
    for bound, count in zip(LAG_BOUNDS, hist, strict=True):
        seen += count
        if seen >= rank and count:
            return bound if bound != float("inf") else LAG_BOUNDS[-2]
    return LAG_BOUNDS[-2]
