"""Where attempts run: daemon threads for sync code, one event loop for async actions."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class Executor:
    """Up to ``threads`` daemon threads plus a lazily started asyncio loop thread.

    Daemon threads let a worker leave after its shutdown grace even while a sync
    action is stuck: the attempt is then rescued by lease expiry elsewhere.
    Threads start as the work in flight needs them (``grow``): starting 400 of them
    up front took 45-50 ms, which delayed a worker's first attempt by as much.
    """

    def __init__(self, threads: int, name: str = "workpool") -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._max = threads
        self._threads: list[threading.Thread] = []
        self._grow_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks_alive: set[asyncio.Task[None]] = set()
        self._loop_lock = threading.Lock()
        self._name = name

    def _serve(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()

    def grow(self, in_flight: int) -> None:
        """Have a thread for each of ``in_flight`` tasks (at most ``threads``): the
        caller counts every task submitted and not yet done, so none waits for one."""
        wanted = min(in_flight, self._max)
        if wanted <= len(self._threads):
            return
        with self._grow_lock:
            while len(self._threads) < wanted:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-exec-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def submit_async(self, coros: list[Coroutine[Any, Any, None]]) -> None:
        """Start coroutines on the loop thread: one cross-thread wake-up per batch."""
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(
                    target=loop.run_forever, name=f"{self._name}-async", daemon=True
                ).start()
                self._loop = loop
        loop = self._loop

        def start() -> None:
            for coro in coros:
                task = loop.create_task(coro)
                # The loop keeps only weak references to tasks: hold them until done.
                self._tasks_alive.add(task)
                task.add_done_callback(self._tasks_alive.discard)

        loop.call_soon_threadsafe(start)

    def shutdown(self) -> None:
        with self._grow_lock:
            for _ in self._threads:
                self._tasks.put(None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
