"""The dashboard's own memory of backlog over time: live counts sampled into a ring buffer.

The store keeps per-minute completion counters (throughput, start lag), but not
how the backlog looked a minute ago; so the dashboard server samples every
pool's live counts every ``interval`` seconds and keeps the last ``keep``
samples per pool. Written by the sampler thread, read by request handlers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workpool.observability.stats import PoolStats

INTERVAL_S = 2.0  # fine enough to see a backlog drain, cheap for the store
KEEP = 1800  # one hour of samples at INTERVAL_S
ERROR_BACKOFF_S = 5.0  # a failing store is retried this often, not in a spin

log = logging.getLogger("workpool.dashboard")


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    running: int
    backlog: int
    scheduled: int
    completing: int
    limit: int


class Sampler:
    """``tick(now)`` samples once; ``start()`` runs ticks on a daemon thread until ``stop()``."""

    def __init__(
        self,
        read: Callable[[], Sequence[PoolStats]],
        *,
        interval: float = INTERVAL_S,
        keep: int = KEEP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.read = read
        self.interval = interval
        self.keep = keep
        self.clock = clock
        self._series: dict[str, deque[Sample]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: float) -> None:
        stats = self.read()
        with self._lock:
            for s in stats:
                series = self._series.setdefault(s.pool, deque(maxlen=self.keep))
                series.append(
                    Sample(now, s.running, s.backlog, s.scheduled, s.completing, s.max_parallelism)
                )

    def series(self, pool: str, since: float = 0.0) -> list[Sample]:
        with self._lock:
            return [s for s in self._series.get(pool, ()) if s.t >= since]

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dashboard-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
            self._thread = None

    def _run(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                self.tick(self.clock())
                wait = self.interval
            except Exception as exc:  # the store may be down for a while; keep sampling
                log.warning("dashboard sampler: %s: %s", type(exc).__name__, exc)
                wait = ERROR_BACKOFF_S
