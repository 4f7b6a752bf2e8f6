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

    A task starts a thread only when no thread is idle, so there are as many as
    the work blocking at once needs, up to ``threads``. Starting them all before
    a claim's first task delayed it: 45-50 ms for 400 up front, and 60 ms more
    for a first claim of 400 attempts, which short actions never needed.
    """

    def __init__(self, threads: int, name: str = "workpool") -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._max = threads
        self._threads: list[threading.Thread] = []
        # One token per thread that finished a task and waits for the next; a
        # submit takes one, or starts a thread. (A SimpleQueue: cheaper than a
        # Semaphore, which a short task would pay twice.)
        self._idle: queue.SimpleQueue[None] = queue.SimpleQueue()
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
            del task  # not kept alive while this thread waits
            self._idle.put(None)

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on an idle thread, or on a new one while fewer than ``threads``
        run. Every token stands for a thread that will take a task from the queue,
        so a task waits only when ``threads`` are busy: the worker never has more
        tasks in flight than that (a sync action stuck past its timeout is still
        counted), so none waits for long."""
        self._tasks.put(task)
        try:
            self._idle.get_nowait()
            return
        except queue.Empty:
            pass
        with self._grow_lock:
            if len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-exec-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

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
