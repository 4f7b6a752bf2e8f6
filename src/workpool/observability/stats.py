"""Live numbers of a pool (``pool.stats()``), the same ones the periodic report logs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workpool.core import histogram
from workpool.store.base import Counters, PoolConfig, PoolCounts, Store, Tx


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A pool right now, plus its completions over the last ``window`` seconds.

    Start lag is the time from when an attempt was due to when it started;
    percentiles are upper bounds of histogram buckets (1 ms, 2 ms, 5 ms, ...).
    """

    pool: str
    max_parallelism: int
    paused: bool
    running: int
    backlog: int  # due, not started
    scheduled: int  # pending with a future due time (first starts and retries)
    completing: int  # attempt over (ended or completing), outcome or on_complete not committed
    finished: int  # retained finished work
    window: float
    completed: int
    succeeded: int
    failed: int
    retries: int
    canceled: int
    failure_rate: float
    permanent_failure_rate: float
    start_lag_avg: float
    start_lag_max: float
    start_lag_p50: float
    start_lag_p95: float
    start_lag_p99: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(numerator: int, denominator: int) -> float:
    return round(numerator / denominator, 4) if denominator > 0 else 0.0


def counters_stats(
    config: PoolConfig, c: Counters, window: float, counts: PoolCounts | None = None
) -> PoolStats:
    """Stats from completion counters (and live counts when given)."""
    counts = counts or PoolCounts()
    return PoolStats(
        pool=config.name,
        max_parallelism=config.max_parallelism,
        paused=config.max_parallelism == 0,
        running=counts.running,
        backlog=counts.due,
        scheduled=counts.scheduled,
        completing=counts.completing,
        finished=counts.finished,
        window=window,
        completed=c.completed,
        succeeded=c.succeeded,
        failed=c.failed,
        retries=c.retries,
        canceled=c.canceled,
        failure_rate=_ratio(c.failed + c.retries, c.completed),
        permanent_failure_rate=_ratio(c.failed, c.completed - c.retries),
        start_lag_avg=round(c.lag_sum / c.lag_count, 6) if c.lag_count else 0.0,
        start_lag_max=round(c.lag_max, 6),
        start_lag_p50=histogram.quantile(c.lag_hist, 0.50),
        start_lag_p95=histogram.quantile(c.lag_hist, 0.95),
        start_lag_p99=histogram.quantile(c.lag_hist, 0.99),
    )


def pool_stats(store: Store, tx: Tx, config: PoolConfig, now: float, window: float) -> PoolStats:
    counts = store.pool_counts(tx, config.name, now)
    # Counters live in minute buckets: the window starts at the bucket holding
    # ``now - window``, so it covers between ``window`` and ``window + 60`` seconds.
    c = store.read_counters(tx, config.name, int((now - window) // 60))
    return counters_stats(config, c, window, counts)
