"""PRODUCT.md §2: retries with backoff and jitter; NonRetryableError; opt-in defaults."""

from __future__ import annotations

import itertools

import pytest

import workpool
from conftest import Recorder, background_worker, run_until_idle, wait_for
from workpool import NonRetryableError, RetryBehavior

pytestmark = pytest.mark.timeout(120)

FAST = RetryBehavior(max_attempts=3, initial_backoff=0.01, base=2.0)


def test_failing_action_runs_max_attempts_then_fails(app, rec: Recorder):
    @app.action(name="always_fails")
    def always_fails(x: int) -> None:
        rec.add(attempt=workpool.current().attempt)
        raise RuntimeError(f"boom {x}")

    pool = app.pool("retries")
    wid = pool.enqueue_action(always_fails, {"x": 7}, retry=FAST)
    run_until_idle(app)

    assert rec.values("attempt") == [1, 2, 3]
    result = pool.status(wid).result
    assert isinstance(result, workpool.Failed)
    assert result.kind == "failed"
    assert "boom 7" in result.error


def test_action_that_recovers_succeeds_after_retries(app, rec: Recorder):
    @app.action(name="flaky")
    def flaky() -> str:
        attempt = workpool.current().attempt
        rec.add(attempt=attempt)
        if attempt < 3:
            raise ConnectionError("transient")
        return f"ok on {attempt}"

    pool = app.pool("retries")
    wid = pool.enqueue_action(flaky, retry=RetryBehavior(max_attempts=5, initial_backoff=0.01))
    run_until_idle(app)
    assert rec.values("attempt") == [1, 2, 3]
    assert pool.status(wid) == workpool.Finished(workpool.Success("ok on 3"))


def test_async_action_is_retried(app, rec: Recorder):
    @app.action(name="flaky_async")
    async def flaky_async() -> int:
        rec.add(attempt=workpool.current().attempt)
        if workpool.current().attempt == 1:
            raise ValueError("first")
        return 42

    pool = app.pool("retries")
    wid = pool.enqueue_action(flaky_async, retry=FAST)
    run_until_idle(app)
    assert rec.values("attempt") == [1, 2]
    assert pool.status(wid).result == workpool.Success(42)


def test_non_retryable_error_stops_retrying(app, rec: Recorder):
    @app.action(name="fatal")
    def fatal() -> None:
        rec.add()
        raise NonRetryableError("bad request, do not retry")

    pool = app.pool("retries")
    wid = pool.enqueue_action(fatal, retry=RetryBehavior(max_attempts=5, initial_backoff=0.01))
    run_until_idle(app)
    assert len(rec.calls) == 1
    result = pool.status(wid).result
    assert result.kind == "failed"
    assert "bad request, do not retry" in result.error


def test_non_retryable_error_subclass_stops_retrying(app, rec: Recorder):
    class MyFatal(NonRetryableError):
        pass

    @app.action(name="fatal")
    def fatal() -> None:
        rec.add()
        raise MyFatal("subclass")

    pool = app.pool("retries", retry_actions_by_default=True, default_retry=FAST)
    wid = pool.enqueue_action(fatal)
    run_until_idle(app)
    assert len(rec.calls) == 1
    assert pool.status(wid).result.kind == "failed"


def test_retry_false_means_one_attempt_even_if_pool_retries_by_default(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add()
        raise RuntimeError("no")

    pool = app.pool("retries", retry_actions_by_default=True, default_retry=FAST)
    wid = pool.enqueue_action(fails, retry=False)
    run_until_idle(app)
    assert len(rec.calls) == 1
    assert pool.status(wid).result.kind == "failed"


def test_actions_are_not_retried_by_default(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add()
        raise RuntimeError("no")

    pool = app.pool("plain")
    wid = pool.enqueue_action(fails)
    run_until_idle(app)
    assert len(rec.calls) == 1
    assert "no" in pool.status(wid).result.error


def test_pool_retry_actions_by_default_uses_default_retry(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add()
        raise RuntimeError("no")

    pool = app.pool(
        "retrying_pool",
        retry_actions_by_default=True,
        default_retry=RetryBehavior(max_attempts=4, initial_backoff=0.01),
    )
    wid = pool.enqueue_action(fails)
    run_until_idle(app)
    assert len(rec.calls) == 4
    assert pool.status(wid).result.kind == "failed"


def test_retry_true_uses_the_pool_default_retry(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add()
        raise RuntimeError("no")

    pool = app.pool("opt_in", default_retry=RetryBehavior(max_attempts=2, initial_backoff=0.01))
    pool.enqueue_action(fails, retry=True)
    run_until_idle(app)
    assert len(rec.calls) == 2


def test_max_attempts_one_means_no_retry(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add()
        raise RuntimeError("no")

    pool = app.pool("once")
    pool.enqueue_action(fails, retry=RetryBehavior(max_attempts=1))
    run_until_idle(app)
    assert len(rec.calls) == 1


def test_backoff_waits_grow_roughly_as_documented(app, rec: Recorder):
    @app.action(name="fails")
    def fails() -> None:
        rec.add()
        raise RuntimeError("again")

    behavior = RetryBehavior(max_attempts=4, initial_backoff=0.1, base=3.0)
    pool = app.pool("backoff")
    pool.enqueue_action(fails, retry=behavior)
    run_until_idle(app)

    times = rec.values("t")
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    nominal = [0.1, 0.3, 0.9]
    for gap, wait in zip(gaps, nominal, strict=True):
        # jitter factor is in [0.5, 1.5); allow scheduling slack above, none below
        assert gap >= wait * 0.5 - 0.02, (gaps, nominal)
        assert gap <= wait * 1.5 + 1.0, (gaps, nominal)
    assert gaps[2] > gaps[0], gaps


def test_status_while_waiting_for_retry_is_pending_backoff(app, rec: Recorder):
    @app.action(name="fails_once")
    def fails_once() -> None:
        rec.add()
        raise RuntimeError("first try failed")

    pool = app.pool("backoff_status")
    wid = pool.enqueue_action(fails_once, retry=RetryBehavior(max_attempts=3, initial_backoff=60.0))
    with background_worker(app):
        status = wait_for(
            lambda: (s := pool.status(wid)).state == "pending" and s.previous_attempts == 1 and s,
            timeout=10,
        )
        assert status.reason == "backoff"
        assert "first try failed" in (status.last_error or "")
        assert status.due_at is not None
        # a wait of 60 s * [0.5, 1.5) lies 30..90 s ahead
        import time

        assert 20 < status.due_at - time.time() < 95
        stats = pool.stats()
        assert stats.running == 0
        assert stats.scheduled == 1
        assert stats.backlog == 0
        pool.cancel(wid)
        assert pool.status(wid) == workpool.Finished(workpool.Canceled())
    assert len(rec.calls) == 1


def test_timeout_of_a_retried_action_counts_as_a_failed_attempt(app, rec: Recorder):
    import threading

    gate = threading.Event()

    @app.action(name="slow")
    def slow() -> str:
        attempt = workpool.current().attempt
        rec.add(attempt=attempt)
        if attempt == 1:
            gate.wait(10)
            return "too late"
        gate.set()  # lets the abandoned first attempt's thread end
        return "fast"

    pool = app.pool("timeouts")
    wid = pool.enqueue_action(slow, retry=FAST, timeout=0.3)
    try:
        run_until_idle(app)
    finally:
        gate.set()
    assert rec.values("attempt") == [1, 2]
    assert pool.status(wid).result == workpool.Success("fast")


def test_running_status_counts_previous_attempts(app, rec: Recorder):
    import threading

    pool = app.pool("retries")
    seen: list = []

    @app.action(name="peek")
    def peek() -> None:
        attempt = workpool.current().attempt
        wid = workpool.current().work_id
        # status from another thread: the committed view
        t = threading.Thread(target=lambda: seen.append(pool.status(wid)))
        t.start()
        t.join(10)
        if attempt < 3:
            raise RuntimeError(f"fail {attempt}")

    wid = pool.enqueue_action(peek, retry=FAST)
    run_until_idle(app)
    assert [(s.state, s.previous_attempts, s.attempt) for s in seen] == [
        ("running", 0, 1),
        ("running", 1, 2),
        ("running", 2, 3),
    ]
    assert pool.status(wid).result == workpool.Success(None)


def test_separator_and_control_characters_round_trip_exactly(app):
    """Batched writes join text on the ASCII record separator where it is absent: text
    that holds one (an error, a return value, args) must come back unchanged."""
    tricky = "a\x1eb,c\x1f\x00d\u2028\n'\"\\"
    seen: list[int] = []

    @app.action(name="echo_then_fail")
    def echo_then_fail(s: str, fail: bool) -> str:
        seen.append(workpool.current().attempt)
        if fail and workpool.current().attempt == 1:
            raise ValueError(s.replace("\x00", ""))
        return s

    retry = RetryBehavior(max_attempts=2, initial_backoff=0.01, base=1.0)
    pool = app.pool("sep", default_retry=retry)
    ids = pool.enqueue_action_batch(
        echo_then_fail, [{"s": tricky, "fail": i % 2 == 0} for i in range(6)], retry=True
    )
    run_until_idle(app)
    for i, wid in enumerate(ids):
        info = app.inspect(wid)
        assert info is not None and info.args == {"s": tricky, "fail": i % 2 == 0}
        assert info.result == workpool.Success(tricky)
        if i % 2 == 0:
            assert info.attempts == 2
            assert info.last_error == "ValueError: " + tricky.replace("\x00", "")
