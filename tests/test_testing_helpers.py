"""workpool.testing: the helpers users call from their own tests."""

from __future__ import annotations

from typing import Any

import pytest

import workpool
from workpool.testing import drain


def test_drain_runs_work_to_completion(app: Any) -> None:
    @app.action
    def double(n: int) -> int:
        return 2 * n

    pool = app.pool("t")
    ids = pool.enqueue_action_batch(double, [{"n": i} for i in range(5)])
    drain(app, timeout=30)
    assert [s.result for s in pool.status_batch(ids)] == [workpool.Success(2 * i) for i in range(5)]


def test_drain_fails_instead_of_hanging(app: Any) -> None:
    @app.action
    def later() -> None:
        return None

    app.pool("t").enqueue_action(later, run_after=3600)
    with pytest.raises(TimeoutError, match="not idle"):
        drain(app, timeout=1.0)
