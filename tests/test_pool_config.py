"""Pool config at run time: pause and resume survive the options declared in code."""

from __future__ import annotations

from typing import Any

import workpool


def test_declared_limit_does_not_undo_a_run_time_pause(app: Any, store_url: str) -> None:
    app.pool("mail", max_parallelism=4).configure()
    operator = workpool.App(store_url)
    try:
        operator.pool("mail").pause()
    finally:
        operator.close()
    # A worker or client restarting with the code's declaration keeps the pool paused...
    restarted = workpool.App(store_url)
    try:
        declared = restarted.pool("mail", max_parallelism=6)
        declared.configure(log_level="INFO")
        stats = declared.stats()
        assert (stats.paused, stats.max_parallelism) == (True, 0)
        # ... and resume() restores the declared limit.
        assert declared.resume().max_parallelism == 6
        assert declared.stats().paused is False
    finally:
        restarted.close()


def test_explicit_configure_unpauses(app: Any) -> None:
    pool = app.pool("p", max_parallelism=3)
    pool.pause()
    assert pool.stats().paused
    assert pool.configure(max_parallelism=8).max_parallelism == 8
    assert pool.resume().max_parallelism == 8  # resuming a running pool changes nothing


def test_resume_without_a_pause_uses_the_default_limit(app: Any) -> None:
    pool = app.pool("z", max_parallelism=0)  # declared paused in code
    pool.configure()
    assert pool.stats().paused
    assert pool.resume().max_parallelism == 10
