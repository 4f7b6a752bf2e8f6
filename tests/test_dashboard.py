"""The web dashboard: its JSON API and access rules on both stores, the Prometheus
collector, and the page itself driven in a real headless Chromium.

The browser tests run on SQLite only: the page talks to the same API as the
API tests, which cover both stores. They need Playwright's Python client and
Debian's ``chromium`` (/usr/bin/chromium); without them they are skipped with a
loud reason, or fail when WORKPOOL_REQUIRE_BROWSER=1. They write the
screenshots of docs/operations.md into docs/img/.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client import generate_latest

import workpool
from conftest import background_worker, holds_for, wait_for
from workpool.core import histogram
from workpool.core.errors import StoreUnavailableError
from workpool.core.results import WorkInfo
from workpool.dashboard import create_app, operator
from workpool.dashboard.sampler import Sampler
from workpool.dashboard.serve import bind, url_of
from workpool.observability.metrics import WorkpoolCollector, registry_for
from workpool.observability.stats import PoolStats
from workpool.store.base import Counters

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# The screenshots of docs/operations.md; a normal run writes them to a temporary
# folder so it leaves the tree clean: WORKPOOL_UPDATE_SCREENSHOTS=1 refreshes the docs.
SCREENSHOTS = (
    Path(__file__).resolve().parent.parent / "docs" / "img"
    if os.environ.get("WORKPOOL_UPDATE_SCREENSHOTS") == "1"
    else Path(os.environ.get("TMPDIR", "/tmp")) / "workpool-screenshots"
)
SCREENSHOTS.mkdir(parents=True, exist_ok=True)


@contextmanager
def serving(app: workpool.App, **options: Any) -> Iterator[str]:
    """The dashboard of ``app`` served by uvicorn in a thread; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    asgi = create_app(app, TOKEN, sample_interval=0.25, **options)
    server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, message="uvicorn started")
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def http(
    method: str,
    url: str,
    *,
    token: str | None = None,
    body: Any = None,
    raw: bytes | None = None,
    host: str | None = None,
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if host is not None:
        headers["Host"] = host
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
    if method == "POST" and data is None:
        data = b""
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture
def shop(app: workpool.App) -> workpool.App:
    @app.action(name="send")
    def send(n: int) -> int:
        if n < 0:
            raise workpool.NonRetryableError(f"bad n {n}")
        return n

    app.pool("mail").configure(max_parallelism=2)
    app.pool("other").configure(max_parallelism=1)
    return app


# --- the JSON API and its access rules (both stores) --------------------------------------


def test_reads_are_open_on_loopback_and_changes_need_the_token(shop: workpool.App) -> None:
    shop.pool("mail").enqueue_action_batch("send", [{"n": 1}, {"n": 2}])
    with serving(shop) as base:
        status, body = http("GET", f"{base}/api/pools")
        assert status == 200
        mail = body["pools"][0]
        assert (mail["pool"], mail["backlog"], mail["max_parallelism"]) == ("mail", 2, 2)
        assert mail["note"] == "due work, free slots: is a worker serving it?"

        for token in (None, "wrong", TOKEN + "x"):
            status, body = http("POST", f"{base}/api/pools/mail/pause", token=token)
            assert (status, set(body)) == (401, {"error"})
        assert not shop.pool("mail").stats().paused

        status, body = http("POST", f"{base}/api/pools/mail/pause", token=TOKEN)
        assert status == 200 and body["pool"]["paused"] is True
        status, body = http("POST", f"{base}/api/pools/mail/resume", token=TOKEN)
        assert status == 200 and body["pool"]["max_parallelism"] == 2
        status, body = http(
            "POST", f"{base}/api/pools/mail/configure", token=TOKEN, body={"max_parallelism": 5}
        )
        assert status == 200 and shop.pool("mail").stats().max_parallelism == 5

        # A page whose DNS name was rebound to 127.0.0.1 sends its own Host: no open reads.
        assert http("GET", f"{base}/api/pools", host="evil.example")[0] == 401
        assert http("GET", f"{base}/api/pools", host="evil.example", token=TOKEN)[0] == 200
        assert http("GET", f"{base}/api/auth", token=TOKEN)[1] == {
            "token": "valid",
            "reads_open": True,
        }
        status, text = http("GET", f"{base}/metrics")
        assert status == 200 and 'workpool_pool_max_parallelism{pool="mail"} 5.0' in text


def test_off_loopback_every_read_needs_the_token(shop: workpool.App) -> None:
    with serving(shop, open_reads=False) as base:
        assert http("GET", f"{base}/api/pools")[0] == 401
        assert http("GET", f"{base}/api/pools", token=TOKEN)[0] == 200
        status, page = http("GET", f"{base}/")
        assert status == 200 and "<title>workpool dashboard</title>" in page
        assert http("GET", f"{base}/static/app.js")[0] == 200
        assert http("GET", f"{base}/metrics")[0] == 200  # counts only: no token


def test_work_detail_and_cancel(shop: workpool.App) -> None:
    mail = shop.pool("mail")
    wid = mail.enqueue_action("send", {"n": 7}, run_after=600)
    with serving(shop) as base:
        status, detail = http("GET", f"{base}/api/work/{wid}")
        assert status == 200
        assert detail["info"]["args"] == {"n": 7} and detail["info"]["pool"] == "mail"
        assert detail["status"]["state"] == "pending"
        assert detail["status"]["reason"] == "scheduled"
        assert detail["explanation"].startswith("scheduled: its first attempt may start in ")

        assert http("POST", f"{base}/api/work/{wid}/cancel")[0] == 401
        status, answer = http("POST", f"{base}/api/work/{wid}/cancel", token=TOKEN)
        assert status == 200 and answer["canceled"] is True
        assert answer["detail"]["status"] == {
            "state": "finished",
            "result": {"kind": "canceled"},
            "on_complete_error": None,
        }
        status, answer = http("POST", f"{base}/api/work/{wid}/cancel", token=TOKEN)
        assert (status, answer["canceled"]) == (200, False)  # duplicate cancels are harmless

        status, body = http("GET", f"{base}/api/work/no-such-id")
        assert status == 404 and "no work item 'no-such-id'" in body["error"]


def test_bad_requests_are_answered_in_json(shop: workpool.App) -> None:
    with serving(shop) as base:
        configure = f"{base}/api/pools/mail/configure"
        for body, raw in (
            ({"max_parallelism": -1}, None),
            ({"max_parallelism": "many"}, None),
            ({"limit": 3}, None),
            (None, b"not json"),
            (None, b"[1]"),
        ):
            status, answer = http("POST", configure, token=TOKEN, body=body, raw=raw)
            assert status == 400 and answer["error"], (body, raw, answer)
        status, answer = http("POST", f"{base}/api/pools/nope/pause", token=TOKEN)
        assert status == 404 and "no pool named 'nope'" in answer["error"]
        assert http("GET", f"{base}/api/pools/mail?minutes=0")[0] == 400
        assert shop.pool("mail").stats().max_parallelism == 2


def test_pool_detail_has_history_samples_and_failures(shop: workpool.App) -> None:
    mail = shop.pool("mail")
    wids = mail.enqueue_action_batch("send", [{"n": 1}, {"n": -1}])
    with background_worker(shop):
        wait_for(lambda: all(s.state == "finished" for s in mail.status_batch(wids)))
    with serving(shop) as base:
        status, body = wait_for(
            lambda: (r := http("GET", f"{base}/api/pools/mail?minutes=5"))[1]["samples"] and r
        )
    assert status == 200
    assert len(body["history"]) == 5
    assert sum(m["completed"] for m in body["history"]) == 2
    assert sum(m["failed"] for m in body["history"]) == 1
    assert body["samples"][-1]["backlog"] == 0
    assert [f["work_id"] for f in body["failures"]] == [wids[1]]
    assert body["failures"][0]["result"] == {"kind": "failed", "error": "bad n -1"}


# --- the collector and the sampler --------------------------------------------------------


def test_metrics_counters_only_grow_and_count_each_minute_once(
    shop: workpool.App,
) -> None:
    minute = 29_000_000  # bucket numbers: minutes since the epoch
    now = [minute * 60.0 + 5]
    collector = WorkpoolCollector(shop, clock=lambda: now[0])

    def add(bucket: int, **counts: Any) -> None:
        lag = counts.pop("lag", None)
        if lag is not None:
            hist = [0] * len(histogram.LAG_BOUNDS)
            hist[histogram.bucket(lag)] = 1
            counts.update(lag_count=1, lag_sum=lag, lag_max=lag, lag_hist=tuple(hist))
        shop.run(lambda tx: shop.store.add_counters(tx, "mail", "w1", bucket, Counters(**counts)))

    def totals() -> dict[str, int]:
        sample = next(s for s in collector.sample() if s.config.name == "mail")
        return {status: sample.completed(status) for status in ("success", "failed", "retrying")}

    add(minute - 1, completed=5, succeeded=5)  # before the collector started: not counted
    add(minute, completed=2, succeeded=2, lag=0.003)
    assert totals() == {"success": 2, "failed": 0, "retrying": 0}
    add(minute, completed=2, failed=1, retries=1)
    now[0] += 60
    add(minute + 1, completed=1, succeeded=1, lag=0.2)
    assert totals() == {"success": 3, "failed": 1, "retrying": 1}
    now[0] += 600  # both minutes settle: frozen once, never read or added again
    assert totals() == totals() == {"success": 3, "failed": 1, "retrying": 1}
    add(minute + 11, completed=1, succeeded=1)
    assert totals()["success"] == 4

    text = generate_latest(registry_for_collector(collector)).decode()
    assert 'workpool_completed_total{pool="mail",status="success"} 4.0' in text
    assert 'workpool_start_lag_seconds_bucket{le="0.005",pool="mail"} 1.0' in text
    assert 'workpool_start_lag_seconds_bucket{le="0.25",pool="mail"} 2.0' in text
    assert 'workpool_start_lag_seconds_bucket{le="+Inf",pool="mail"} 2.0' in text
    assert 'workpool_start_lag_seconds_count{pool="mail"} 2.0' in text
    assert 'workpool_pool_paused{pool="other"} 0.0' in text
    assert "workpool_store_up 1.0" in text


def registry_for_collector(collector: WorkpoolCollector) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def test_metrics_say_when_the_store_does_not_answer(
    shop: workpool.App, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = WorkpoolCollector(shop)

    def down() -> list[Any]:
        raise StoreUnavailableError("the database cannot be reached")

    monkeypatch.setattr(collector, "sample", down)
    text = generate_latest(registry_for_collector(collector)).decode()
    assert "workpool_store_up 0.0" in text
    assert "workpool_pool_running" not in text
    assert "workpool_store_up 1.0" in generate_latest(registry_for(shop)).decode()


def test_sampler_keeps_a_bounded_series_per_pool() -> None:
    def stats(pool: str, backlog: int) -> PoolStats:
        fields = {name: 0 for name in PoolStats.__dataclass_fields__}
        return PoolStats(**{**fields, "pool": pool, "paused": False, "backlog": backlog})

    reads = iter([[stats("a", 5), stats("b", 1)], [stats("a", 3)], [stats("a", 0)]])
    sampler = Sampler(lambda: next(reads), keep=2)
    for t in (10.0, 12.0, 14.0):
        sampler.tick(t)
    assert [(s.t, s.backlog) for s in sampler.series("a")] == [(12.0, 3), (14.0, 0)]
    assert [(s.t, s.backlog) for s in sampler.series("b")] == [(10.0, 1)]
    assert sampler.series("a", since=13.0)[0].t == 14.0


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (workpool.Pending(0, "scheduled", 1060.0), "scheduled: its first attempt may start in 1"),
        (workpool.Pending(2, "backoff", 1002.0, "boom"), "attempt 2 failed (boom); attempt 3"),
        (workpool.Pending(0, "paused", 1000.0, None, 0, 0), "paused: pool"),
        (workpool.Pending(0, "waiting_for_slot", 990.0, None, 4, 4), "4 of 4 slots"),
        (workpool.Pending(0, "due", 990.0, None, 1, 4), "due now with a free slot"),
        (workpool.Running(0, 1, 990.0), "running: attempt 1 since 10.0 s ago"),
        (workpool.Finished(None), "unknown or expired"),
        (workpool.Finished(workpool.Failed("x"), "handler broke"), "given up: handler broke"),
    ],
)
def test_every_status_is_explained(status: workpool.Status, words: str) -> None:
    assert words in operator.explain(status, None, now=1000.0)


def test_an_ended_attempt_is_explained_as_ending() -> None:
    """Running to status, but its action returned and its slot went on already."""
    info = WorkInfo("w", "p", "action", "f", "ended", {}, 1, 900.0, worker_id="worker-9")
    text = operator.explain(workpool.Running(0, 1, 990.0), info, now=1000.0)
    assert text.startswith("ending: attempt 1 returned on worker worker-9 and gave its slot")


# --- the page in a real browser (SQLite) ---------------------------------------------------


def expect(locator: Any) -> Any:
    """Playwright's auto-retrying assertions (no JavaScript eval: the page's CSP forbids it)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        missing = f"Playwright's Python client is not installed ({exc})"
    if missing is None and not os.path.exists(CHROMIUM):
        missing = f"no {CHROMIUM} (apt-get install chromium)"
    if missing is not None:
        if os.environ.get("WORKPOOL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests required but {missing}", pytrace=False)
        pytest.skip(
            f"!!!!! DASHBOARD BROWSER TESTS SKIPPED: {missing}."
            " Set WORKPOOL_REQUIRE_BROWSER=1 to make this fail. !!!!!"
        )
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(15_000)
    page.on("dialog", lambda dialog: dialog.accept())  # confirm() of the cancel buttons
    try:
        yield page
    finally:
        context.close()


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[tuple[workpool.App, list[int]]]:
    """An app with a slow pool ``emails`` (limit 3): the ``n`` of every start is recorded."""
    app = workpool.App(f"sqlite:///{tmp_path / 'busy.db'}")
    starts: list[int] = []
    lock = threading.Lock()

    @app.action(name="send_email")
    def send_email(n: int) -> str:
        with lock:
            starts.append(n)
        time.sleep(0.06)
        if n % 10 == 3:
            raise workpool.NonRetryableError(f"550 mailbox unavailable: user{n}@example.org")
        if n % 10 == 5 and workpool.current().attempt == 1:
            raise RuntimeError("421 try again later")
        return f"sent {n}"

    app.pool("emails").configure(
        max_parallelism=3,
        retry_actions_by_default=True,
        default_retry=workpool.RetryBehavior(max_attempts=3, initial_backoff=0.2, base=2.0),
    )
    app.pool("reports").configure(max_parallelism=1)
    try:
        yield app, starts
    finally:
        app.stop_workers()
        app.close()


def cell(page: Any, pool: str, field: str) -> Any:
    return page.locator(f'tr[data-pool="{pool}"] td[data-field="{field}"]')


def number(page: Any, pool: str, field: str) -> int:
    return int(cell(page, pool, field).inner_text().split()[0])


def test_browser_shows_work_running_and_pauses_a_pool(
    busy: tuple[workpool.App, list[int]], page: Any
) -> None:
    app, starts = busy
    emails = app.pool("emails")
    wids = emails.enqueue_action_batch("send_email", [{"n": i} for i in range(300)])
    app.pool("reports").enqueue_action("send_email", {"n": 1}, run_after=900)
    with serving(app) as base, background_worker(app, concurrency=4):
        page.goto(f"{base}/#token={TOKEN}")
        assert "#token" not in page.url  # taken into sessionStorage, out of the address bar
        wait_for(lambda: number(page, "emails", "finished") > 0, 15)
        first = number(page, "emails", "finished")
        wait_for(lambda: number(page, "emails", "finished") > first, 15)
        wait_for(lambda: number(page, "emails", "running") > 0, 15)
        wait_for(lambda: number(page, "emails", "finished") >= 120, 15)  # some history to draw
        page.wait_for_selector("#failures tbody tr")  # the charts' data arrived too
        expect(page.locator("#token-state")).to_have_text("token accepted")
        page.screenshot(path=str(SCREENSHOTS / "dashboard.png"))

        page.locator('tr[data-pool="emails"] button[data-action="toggle"]').click()
        wait_for(lambda: emails.stats().paused, 10, message="paused from the browser")
        expect(cell(page, "emails", "running")).to_contain_text("paused")
        expect(page.locator("#message")).to_contain_text("paused")
        wait_for(lambda: emails.stats().running == 0, 10, message="running work finished")
        started = len(starts)
        holds_for(lambda: len(starts) == started, 1.0)  # no new starts while paused
        waiting = next(
            w for w, s in zip(wids, emails.status_batch(wids), strict=True) if s.state == "pending"
        )
        assert emails.status(waiting).reason == "paused"  # type: ignore[union-attr]

        page.fill("#search-input", waiting)
        page.click("#search-form button")
        why = page.locator("#work-detail .why")
        expect(why).to_have_attribute("data-reason", "paused")
        expect(why).to_contain_text("max_parallelism 0")
        page.screenshot(path=str(SCREENSHOTS / "work-item.png"), full_page=True)

        page.locator('tr[data-pool="emails"] button[data-action="toggle"]').click()
        wait_for(lambda: len(starts) > started, 10, message="work starts again after resume")
        assert emails.stats().max_parallelism == 3

        page.locator('tr[data-pool="emails"] button[data-action="cancel-all"]').click()
        expect(page.locator("#message")).to_contain_text("Canceled")
    assert emails.stats().backlog == 0


def test_browser_without_the_token_is_refused(
    busy: tuple[workpool.App, list[int]], page: Any
) -> None:
    app, _ = busy
    emails = app.pool("emails")
    emails.enqueue_action_batch("send_email", [{"n": i} for i in range(5)])
    with serving(app) as base:
        page.goto(f"{base}/")  # no #token=...: reads work, changes do not
        wait_for(lambda: number(page, "emails", "backlog") == 5, 15)
        expect(page.locator("#token-state")).to_have_text("no token: read only")
        with page.expect_response(lambda r: r.url.endswith("/pause")) as refused:
            page.locator('tr[data-pool="emails"] button[data-action="toggle"]').click()
        assert refused.value.status == 401
        expect(page.locator("#message")).to_contain_text("Refused")
        assert not emails.stats().paused
        page.screenshot(path=str(SCREENSHOTS / "refused.png"))

        page.fill("#token-input", TOKEN)
        page.click("#token-form button")
        expect(page.locator("#token-state")).to_have_text("token accepted")
        page.locator('tr[data-pool="emails"] input[data-action="limit"]').fill("7")
        page.locator('tr[data-pool="emails"] button[data-action="set"]').click()
        wait_for(lambda: emails.stats().max_parallelism == 7, 10)
