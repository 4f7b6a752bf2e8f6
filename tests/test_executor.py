"""The executor: a task waits only while every thread is busy, never for a thread start.

Threads are started by the executor's spawner, so ``submit`` returns at once; each
task that finds no idle thread still gets one of its own, up to the limit.
"""

from __future__ import annotations

import threading
import time

import pytest

from workpool.runtime.executor import Executor


class _AllAtOnce:
    """Tasks that get through only if ``parties`` of them run at once: each waits
    at a barrier of that many parties (which breaks after its timeout, and they
    raise), then holds its thread until ``release``."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.barrier = threading.Barrier(parties, timeout=10)
        self.passed: list[int] = []
        self.gate = threading.Event()

    def task(self) -> None:
        self.barrier.wait()
        self.passed.append(1)
        self.gate.wait(10)

    def all_passed(self) -> bool:
        deadline = time.monotonic() + 10
        while len(self.passed) < self.parties and time.monotonic() < deadline:
            time.sleep(0.005)
        return len(self.passed) == self.parties

    def release(self) -> None:
        self.gate.set()


@pytest.mark.parametrize("together", [False, True])
def test_tasks_that_block_each_get_a_thread_up_to_the_limit(together):
    """Submitted one by one, or together: ``submitting`` finds the threads for a
    batch at its end, with one request to the spawner for all the tasks that
    found none idle, and each still gets its own."""
    executor = Executor(8)
    tasks = _AllAtOnce(8)
    try:
        if together:
            executor.warm(2)  # some tasks find an idle thread, the rest ask the spawner
            with executor.submitting() as submit:
                for _ in range(8):
                    submit(tasks.task)
        else:
            for _ in range(8):
                executor.submit(tasks.task)
        assert tasks.all_passed()
        assert executor.threads() == 8
    finally:
        tasks.release()
        executor.shutdown()


def test_no_more_threads_than_the_limit_and_waiting_tasks_run_later():
    executor = Executor(3)
    gate = threading.Event()
    done = []
    lock = threading.Lock()

    def task() -> None:
        gate.wait(10)
        with lock:
            done.append(threading.current_thread().name)

    try:
        for _ in range(9):
            executor.submit(task)
        time.sleep(0.2)
        assert len([t for t in threading.enumerate() if "-exec-" in t.name]) <= 3
        assert done == []
        gate.set()
        deadline = time.monotonic() + 10
        while len(done) < 9 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(done) == 9
        assert len(set(done)) <= 3
    finally:
        gate.set()
        executor.shutdown()


def test_submit_does_not_wait_for_a_thread_to_start(monkeypatch):
    started = threading.Event()
    release = threading.Event()
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        # A thread start that takes until the test releases it: submit must not wait.
        if "-exec-" in self.name:
            started.set()
            release.wait(10)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    executor = Executor(4)
    ran = threading.Event()
    try:
        t0 = time.monotonic()
        executor.submit(ran.set)
        assert time.monotonic() - t0 < 5
        assert started.wait(10)
        assert not ran.is_set()
        release.set()
        assert ran.wait(10)
    finally:
        release.set()
        executor.shutdown()


def test_a_refused_thread_start_is_tried_again(monkeypatch):
    refusals = [RuntimeError("can't start new thread")]
    real_start = threading.Thread.start

    def refusing_start(self: threading.Thread) -> None:
        if "-exec-" in self.name and refusals:
            raise refusals.pop()
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", refusing_start)
    executor = Executor(2)
    ran = threading.Event()
    try:
        executor.submit(ran.set)
        assert ran.wait(10), "the task was lost with the refused thread"
        assert refusals == []
    finally:
        executor.shutdown()


def test_a_refused_thread_start_in_a_batch_is_tried_again_for_the_rest(monkeypatch):
    refusals = [RuntimeError("can't start new thread")]
    real_start = threading.Thread.start

    def refusing_start(self: threading.Thread) -> None:
        if "-exec-" in self.name and refusals and self.name.endswith("-1"):
            raise refusals.pop()
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", refusing_start)
    executor = Executor(3)
    tasks = _AllAtOnce(3)
    try:
        with executor.submitting() as submit:
            for _ in range(3):
                submit(tasks.task)
        assert tasks.all_passed(), "a task behind the refused start got no thread"
        assert refusals == []
    finally:
        tasks.release()
        executor.shutdown()


@pytest.mark.parametrize("count", [1, 50])
def test_every_quick_task_runs_once(count):
    executor = Executor(800)
    seen: list[int] = []
    lock = threading.Lock()
    all_done = threading.Event()

    def task(i: int) -> None:
        with lock:
            seen.append(i)
            if len(seen) == count:
                all_done.set()

    try:
        with executor.submitting() as submit:
            for i in range(count):
                submit(lambda i=i: task(i))
        assert all_done.wait(10)
        time.sleep(0.05)
        assert sorted(seen) == list(range(count))
    finally:
        executor.shutdown()


def test_warm_threads_take_the_first_tasks_without_a_thread_start():
    executor = Executor(10)
    gate = threading.Event()
    running = []
    try:
        executor.warm(3)
        deadline = time.monotonic() + 10
        while executor.threads() < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # their tokens are put
        for _ in range(3):
            executor.submit(lambda: (running.append(1), gate.wait(10)))
        while len(running) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(running) == 3
        assert executor.threads() == 3, "a warm thread was idle for each task"
        executor.submit(lambda: (running.append(1), gate.wait(10)))
        while len(running) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert executor.threads() == 4, "the fourth task, with none idle, got a thread"
    finally:
        gate.set()
        executor.shutdown()


def test_no_thread_starts_after_shutdown(monkeypatch):
    """Requests the spawner had not served when the executor shut down start no
    thread: one would wait for a task forever, a thread lost for each worker run."""
    entered = threading.Event()
    release = threading.Event()
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if "-exec-" in self.name:
            entered.set()
            release.wait(10)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    executor = Executor(4)
    gate = threading.Event()
    try:
        executor.submit(lambda: gate.wait(10))
        executor.submit(lambda: gate.wait(10))
        assert entered.wait(10)  # the spawner is starting the first thread
        executor.shutdown()
        release.set()
        time.sleep(0.2)
        assert executor.threads() == 1
    finally:
        release.set()
        gate.set()
