"""Where attempts run: daemon threads for sync code, one event loop for async actions."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class Executor:
    """``threads`` daemon threads plus a lazily started asyncio loop thread.

    Daemon threads let a worker leave after its shutdown grace even while a sync
    action is stuck: the attempt is then rescued by lease expiry elsewhere.
    """

    def __init__(self, threads: int, name: str = "workpool") -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-exec-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._name = name

    def _serve(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def submit_async(self, coro: Coroutine[Any, Any, None]) -> None:
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name=f"{self._name}-async", daemon=True
                ).start()
                self._loop = loop
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
