"""workpool: a durable work pool for Python on SQLite or PostgreSQL."""

from __future__ import annotations

from workpool.app import App
from workpool.core.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    NonRetryableError,
    NotRegisteredError,
    PayloadTooLargeError,
    StoreError,
    StoreUnavailableError,
    WorkpoolError,
)
from workpool.core.results import (
    Canceled,
    Failed,
    Finished,
    Pending,
    Result,
    Running,
    Status,
    Success,
    WorkInfo,
)
from workpool.core.retry import RetryBehavior
from workpool.observability.stats import PoolStats
from workpool.pool import Pool
from workpool.runtime.context import RunInfo, current
from workpool.store.base import Tx

__all__ = [
    "App",
    "Canceled",
    "Failed",
    "Finished",
    "InvalidArgumentError",
    "InvalidTypeError",
    "NonRetryableError",
    "NotRegisteredError",
    "PayloadTooLargeError",
    "Pending",
    "Pool",
    "PoolStats",
    "Result",
    "RetryBehavior",
    "RunInfo",
    "Running",
    "Status",
    "StoreError",
    "StoreUnavailableError",
    "Success",
    "Tx",
    "WorkInfo",
    "WorkpoolError",
    "current",
]
__version__ = "0.1.0"
