"""Helpers for testing code that uses workpool: drain a pool in a test, with a deadline."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workpool.app import App


def drain(
    app: App,
    pools: Sequence[str] | None = None,
    *,
    timeout: float = 60.0,
    concurrency: int | None = None,
) -> None:
    """Run a worker until the pools are idle; ``TimeoutError`` if that takes over ``timeout`` s.

    Unlike a bare ``app.run_worker(until_idle=True)``, a hang fails the test
    instead of blocking the suite, and an error inside the worker is re-raised.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            app.run_worker(pools, concurrency, until_idle=True, lease=2.0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="workpool-drain", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        for _ in range(100):  # the worker may still be starting: ask until it has stopped
            app.stop_workers()
            thread.join(0.1)
            if not thread.is_alive():
                break
        raise TimeoutError(f"pools {pools or 'all'} were not idle after {timeout:g} s")
    if errors:
        raise errors[0]
