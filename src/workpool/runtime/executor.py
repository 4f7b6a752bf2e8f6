"""Where attempts run: daemon threads for sync code, one event loop for async actions."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from workpool.core.errors import describe_error
from workpool.observability import events


class Executor:
    """Up to ``threads`` daemon threads plus a lazily started asyncio loop thread.

    Daemon threads let a worker leave after its shutdown grace even while a sync
    action is stuck: the attempt is then rescued by lease expiry elsewhere.

    A task starts a thread only when no thread is idle, so there are as many as
    the work blocking at once needs, up to ``threads``. Starting them all before
    a claim's first task delayed it: 45-50 ms for 400 up front, and 60 ms more
    for a first claim of 400 attempts, which short actions never needed.

    Threads are started by a spawner thread, not by ``submit``: ``Thread.start``
    waits until the new thread runs, 0.5 ms on a busy worker, and the worker's
    completer, which submits a claim's attempts, paid it for every thread (65-80
    ms of a 20,000-job drain, with 135 threads started). Meanwhile the threads
    that exist keep taking tasks, and the spawner starts one only for a task
    that still finds none of them idle.
    """

    def __init__(self, threads: int, name: str = "workpool") -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._max = threads
        self._threads: list[threading.Thread] = []
        # One token per thread that finished a task and waits for the next; a
        # submit takes one, or asks the spawner. (A SimpleQueue: cheaper than a
        # Semaphore, which a short task would pay twice.)
        self._idle: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._grow_lock = threading.Lock()
        # What the spawner is asked for (see _spawn): threads for that many tasks that
        # found none idle (n > 0), an idle thread ahead of any task (0), or to stop (None).
        self._wanted: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._spawner: threading.Thread | None = None
        self._backoff = 0.0  # the spawner's wait before it tries again to start a thread
        self._closed = False  # shut down: the spawner starts no more threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks_alive: set[asyncio.Task[None]] = set()
        self._loop_lock = threading.Lock()
        self._name = name

    def _serve(self, idle: bool) -> None:
        if idle:
            self._idle.put(None)
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
        so a task waits only when ``threads`` are busy, or for its thread to start:
        the worker never has more tasks in flight than that (a sync action stuck
        past its timeout is still counted), so none waits for long."""
        self._tasks.put(task)
        self._find_threads(1)

    @contextmanager
    def submitting(self) -> Iterator[Callable[[Callable[[], None]], None]]:
        """``submit`` for many tasks: each is queued as it is put, so an idle thread
        starts it at once, and threads are found for them all at the end, with one
        request to the spawner for those that found no idle thread. A claim's tasks
        outpace the threads going idle: draining 100,000 no-ops, 3 in 4 found none,
        and a request for each woke the spawner (39k requests a worker process ->
        125; the benchmark's drain 53.6k -> 57.6k jobs/s on SQLite, 39.3k -> 41.7k
        on PostgreSQL, medians of 7 alternated pairs of 3 trials)."""
        count = 0

        def put(task: Callable[[], None]) -> None:
            nonlocal count
            self._tasks.put(task)
            count += 1

        try:
            yield put
        finally:
            self._find_threads(count)

    def _find_threads(self, count: int) -> None:
        """Take a token for each of ``count`` queued tasks; the spawner finds the rest."""
        for taken in range(count):
            if not self._took_idle():
                self._wanted.put(count - taken)
                self._start_spawner()
                return

    def _took_idle(self) -> bool:
        """Take the token of a thread that went idle, if one is there."""
        try:
            self._idle.get_nowait()
        except queue.Empty:
            return False
        return True

    def warm(self, count: int) -> None:
        """Have up to ``count`` threads wait for tasks before any comes: the first
        tasks of a new worker then start at once, not after a thread start each."""
        for _ in range(min(count, self._max)):
            self._wanted.put(0)
        self._start_spawner()

    def _start_spawner(self) -> None:
        if self._spawner is None:
            with self._grow_lock:
                if self._spawner is None:
                    self._spawner = threading.Thread(
                        target=self._spawn, name=f"{self._name}-spawner", daemon=True
                    )
                    self._spawner.start()

    def _spawn(self) -> None:
        """Find each task that ``submit`` or ``submitting`` left without an idle
        thread one: a token that a thread put meanwhile (it is idle, or it took that
        very task, and the token would otherwise promise a thread that is busy), else
        a new thread."""
        while (wanted := self._wanted.get()) is not None:
            if wanted == 0:  # a thread ahead of any task
                if not self._start_thread(idle=True):
                    self._wanted.put(0)  # tried again after a backoff
                continue
            for left in range(wanted, 0, -1):
                if self._took_idle():
                    continue
                if not self._start_thread(idle=False):
                    self._wanted.put(left)  # tried again after a backoff
                    break

    def _start_thread(self, idle: bool) -> bool:
        """Start a thread (``idle``: that waits for tasks before any comes), unless
        there are ``threads`` already; False if the system refused it."""
        with self._grow_lock:
            if self._closed or len(self._threads) >= self._max:
                return True
            thread = threading.Thread(
                target=self._serve,
                args=(idle,),
                name=f"{self._name}-exec-{len(self._threads)}",
                daemon=True,
            )
            self._threads.append(thread)
        try:
            thread.start()
            self._backoff = 0.0
            return True
        except RuntimeError as exc:
            # The system refused a thread (its limit on threads, or memory): the
            # task waits in the queue for a thread that frees up, or for the
            # next try here, rather than being lost with this one's error.
            with self._grow_lock:
                self._threads.remove(thread)
            self._backoff = min(max(self._backoff * 2, 0.05), 5.0)
            events.worker_event(
                "thread_start_failed", 40, error=describe_error(exc), retry_in=self._backoff
            )
            time.sleep(self._backoff)
            return False

    def threads(self) -> int:
        """How many threads have been started (they never exit before ``shutdown``)."""
        with self._grow_lock:
            return len(self._threads)

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
            self._closed = True
            for _ in self._threads:
                self._tasks.put(None)
            self._wanted.put(None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
