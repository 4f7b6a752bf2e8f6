"""Prometheus metrics of every pool, read from the store at each scrape.

``WorkpoolCollector(app)`` is a prometheus_client custom collector: register it
in a ``CollectorRegistry`` and serve that registry (the dashboard's ``/metrics``,
or ``workpool worker APP --metrics-port 9108``). Every number comes from the
database, so it covers the work of **all** workers, not only this process;
scrape one exporter per database (or aggregate with ``max by (pool)``).

Gauges are the pool right now. Counters and the start-lag histogram are
monotonic totals **since this collector started**, accumulated from the
per-minute ``counters`` rows the workers write: a minute bucket is read until
it is ``SETTLE_MINUTES`` old, then its final value is added to a frozen total
and never read again. Each scrape therefore reads a bounded number of rows per
pool, and ``rate()``/``increase()`` work as usual. Completions recorded by a
clock more than ``SETTLE_MINUTES`` behind this one are missed; rows are kept
24 h, so a collector not scraped for a day misses what was pruned meanwhile.

Attempt durations are not exported: the store keeps no per-attempt duration
(only start lag), so no process could report them for the whole database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from workpool.core import histogram
from workpool.core.errors import WorkpoolError
from workpool.store.base import Counters, PoolConfig, PoolCounts, Tx

if TYPE_CHECKING:
    from workpool.app import App

# Minute buckets younger than this may still receive completions (clock skew
# between machines, a completer's transaction spanning the minute's end).
SETTLE_MINUTES = 2

# (metric name, help, PoolCounts/PoolConfig field) of the per-pool gauges.
GAUGES: tuple[tuple[str, str], ...] = (
    ("running", "Attempts running now (they hold a slot)."),
    ("backlog", "Pending work that is due now and not started."),
    ("scheduled", "Pending work due later: first starts and retries waiting for backoff."),
    ("completing", "Work whose attempt is over but not yet recorded, or whose on_complete waits."),
    ("finished_retained", "Finished work still kept for status (status_ttl)."),
    ("max_parallelism", "The pool's limit of attempts running at once (0 = paused)."),
    ("paused", "1 when the pool is paused (max_parallelism 0), else 0."),
)
STATUSES = ("success", "failed", "canceled", "retrying")


@dataclass(frozen=True, slots=True)
class PoolSample:
    """One pool at one scrape: its config, live counts and totals since the collector began."""

    config: PoolConfig
    counts: PoolCounts
    totals: Counters

    def gauge(self, name: str) -> float:
        match name:
            case "finished_retained":
                return self.counts.finished
            case "backlog":
                return self.counts.due
            case "max_parallelism":
                return self.config.max_parallelism
            case "paused":
                return 1 if self.config.max_parallelism == 0 else 0
        return float(getattr(self.counts, name))

    def completed(self, status: str) -> int:
        t = self.totals
        return {
            "success": t.succeeded,
            "failed": t.failed,
            "canceled": t.canceled,
            "retrying": t.retries,
        }[status]


@dataclass(slots=True)
class _Accumulated:
    """Buckets before ``until`` are summed into ``frozen`` and never read again."""

    until: int
    frozen: Counters


class WorkpoolCollector:
    """A prometheus_client collector over an App's store (see the module docstring)."""

    def __init__(self, app: App, *, clock: Callable[[], float] | None = None) -> None:
        self.app = app
        self.clock = clock or app.clock
        self.started_bucket = int(self.clock() // 60)
        self._pools: dict[str, _Accumulated] = {}
        self._lock = threading.Lock()  # scrapes may overlap; accumulation must not

    def sample(self) -> list[PoolSample]:
        """Every stored pool, read in one transaction, with its totals brought up to date."""
        with self._lock:
            now = self.clock()
            read = self.app.run(lambda tx: self._read(tx, now), readonly=True)
            # Frozen totals advance only once the read committed (a retried body starts over).
            for sample, acc in read:
                self._pools[sample.config.name] = acc
            return [sample for sample, _ in read]

    def _read(self, tx: Tx, now: float) -> list[tuple[PoolSample, _Accumulated]]:
        store = self.app.store
        settled = int(now // 60) - SETTLE_MINUTES
        read = []
        for config in store.load_pools(tx):
            acc = self._pools.get(config.name) or _Accumulated(self.started_bucket, Counters())
            frozen, live = acc.frozen, Counters()
            for bucket, counters in store.history(tx, config.name, acc.until):
                if bucket < settled:
                    frozen = frozen + counters
                else:
                    live = live + counters
            counts = store.pool_counts(tx, config.name, now)
            sample = PoolSample(config, counts, frozen + live)
            read.append((sample, _Accumulated(max(acc.until, settled), frozen)))
        return read

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        up = GaugeMetricFamily("workpool_store_up", "1 when the store answered this scrape.")
        try:
            samples = self.sample()
        except WorkpoolError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families(samples)
        took = GaugeMetricFamily(
            "workpool_scrape_duration_seconds", "Seconds this scrape spent reading the store."
        )
        took.add_metric([], time.perf_counter() - started)
        yield took


def families(samples: list[PoolSample]) -> Iterator[Metric]:
    """The metric families of ``samples`` (one label: ``pool``)."""
    for name, doc in GAUGES:
        gauge = GaugeMetricFamily(f"workpool_pool_{name}", doc, labels=["pool"])
        for s in samples:
            gauge.add_metric([s.config.name], s.gauge(name))
        yield gauge
    completed = CounterMetricFamily(
        "workpool_completed",
        "Completed attempts by outcome (retrying: failed and retried later).",
        labels=["pool", "status"],
    )
    for s in samples:
        for status in STATUSES:
            completed.add_metric([s.config.name, status], s.completed(status))
    yield completed
    lag = HistogramMetricFamily(
        "workpool_start_lag_seconds",
        "Time from when an attempt was due to when it started.",
        labels=["pool"],
    )
    for s in samples:
        lag.add_metric([s.config.name], lag_buckets(s.totals.lag_hist), s.totals.lag_sum)
    yield lag


def lag_buckets(counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs over ``histogram.LAG_BOUNDS`` (last: ``+Inf``)."""
    buckets: list[tuple[str, float]] = []
    seen = 0
    for bound, count in zip(histogram.LAG_BOUNDS, counts, strict=True):
        seen += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), seen))
    return buckets


def registry_for(app: App) -> CollectorRegistry:
    """A fresh ``CollectorRegistry`` holding only a WorkpoolCollector of ``app``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkpoolCollector(app))
    return registry
