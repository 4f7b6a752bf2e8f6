"""Fixtures shared by the whole suite.

``store_url`` runs every behaviour test twice: on a fresh SQLite file and on a
fresh PostgreSQL schema.  PostgreSQL comes from, in order:

1. ``$WORKPOOL_TEST_POSTGRES_URL`` or the server at 127.0.0.1:5432 (db ``test``,
   user ``postgres``) when it answers a 1 s connect;
2. a throwaway server started with pytest-postgresql's ``postgresql_proc``
   factory when ``pg_ctl`` binaries exist (``/usr/lib/postgresql/*/bin``);
3. otherwise the postgres half of the suite is skipped, with one loud line in
   the terminal -- or fails, when ``WORKPOOL_REQUIRE_POSTGRES=1``.

Helpers (import them with ``from conftest import ...``):
``ph(app)``, ``wait_for(predicate, timeout)``, ``run_until_idle(app, ...)``,
``background_worker(app, ...)``, ``counted_calls(monkeypatch, owner, name)``,
``calls_at_rest(calls, settle)``, ``UserTable`` and the ``user_table`` fixture.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import pytest

T = TypeVar("T")

LOCAL_PG_URL = os.environ.get(
    "WORKPOOL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REQUIRE_PG = os.environ.get("WORKPOOL_REQUIRE_POSTGRES") == "1"


# --- markers -----------------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run tests marked slow (or set WORKPOOL_RUN_SLOW=1)",
    )


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "slow: takes a minute or more; run with --run-slow")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if config.getoption("--run-slow") or os.environ.get("WORKPOOL_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow (waits for the once-a-minute cleanup); use --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --- PostgreSQL discovery ----------------------------------------------------------------


def _pg_answers(url: str) -> str | None:
    """None if a 1 s connect works, else the reason it did not."""
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - psycopg is a dependency
        return f"psycopg missing: {exc}"
    try:
        with psycopg.connect(url, connect_timeout=1) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    return None


def _find_pg_ctl() -> str | None:
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0,
        reverse=True,
    )
    if candidates:
        return candidates[0]
    return shutil.which("pg_ctl")


PG_CTL = _find_pg_ctl()

if PG_CTL is not None:
    from pytest_postgresql import factories as _pg_factories

    # Only started when the local server does not answer (see ``pg_base_url``).
    workpool_pg_proc = _pg_factories.postgresql_proc(executable=PG_CTL, port=None)


_PG_STATE: dict[str, Any] = {"url": None, "reason": None, "source": None, "decided": False}


@pytest.fixture(scope="session")
def pg_base_url(request: pytest.FixtureRequest) -> str | None:
    """The URL of a PostgreSQL server for the suite, or None (reason in _PG_STATE)."""
    if _PG_STATE["decided"]:
        return _PG_STATE["url"]
    _PG_STATE["decided"] = True
    reason = _pg_answers(LOCAL_PG_URL)
    if reason is None:
        _PG_STATE.update(url=LOCAL_PG_URL, source=f"server at {_redact(LOCAL_PG_URL)}")
        return LOCAL_PG_URL
    reasons = [f"{_redact(LOCAL_PG_URL)}: {reason}"]
    if PG_CTL is not None and hasattr(os, "geteuid") and os.geteuid() == 0:
        reasons.append(f"{PG_CTL} exists, but initdb refuses to run as root")
    elif PG_CTL is not None:
        try:
            proc = request.getfixturevalue("workpool_pg_proc")
            url = f"postgresql://{proc.user}@{proc.host}:{proc.port}/postgres"
            if proc.password:
                url = f"postgresql://{proc.user}:{proc.password}@{proc.host}:{proc.port}/postgres"
            again = _pg_answers(url)
            if again is None:
                _PG_STATE.update(url=url, source=f"throwaway server via {PG_CTL}")
                return url
            reasons.append(f"throwaway server: {again}")
        except Exception as exc:  # e.g. initdb refuses to run as root
            reasons.append(f"throwaway server via {PG_CTL}: {type(exc).__name__}: {exc}")
    else:
        reasons.append("no pg_ctl binaries under /usr/lib/postgresql/*/bin or on PATH")
    _PG_STATE["reason"] = "; ".join(reasons)
    return None


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    return url


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _PG_STATE["decided"] and _PG_STATE["url"] is None:
        outcome = (
            "FAILED (WORKPOOL_REQUIRE_POSTGRES=1)"
            if REQUIRE_PG
            else "SKIPPED (set WORKPOOL_REQUIRE_POSTGRES=1 to make this fail)"
        )
        terminalreporter.write_line(
            f"!!!!! POSTGRESQL TESTS {outcome}: no PostgreSQL available"
            f" ({_PG_STATE['reason']}) !!!!!",
            red=True,
            bold=True,
        )
    elif _PG_STATE["url"] is not None:
        terminalreporter.write_line(f"workpool tests: PostgreSQL from {_PG_STATE['source']}")


_WARNED: list[bool] = []


def _pg_schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}schema={schema}"


def _drop_schema(base: str, schema: str) -> None:
    import psycopg

    try:
        with psycopg.connect(base, connect_timeout=5, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '20s'")
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    except Exception as exc:  # leave a trace, never hide a test result behind teardown
        print(f"warning: could not drop test schema {schema}: {exc}", file=sys.stderr)


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A fresh, empty store for one test: SQLite file or PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'workpool.db'}"  # tmp_path is absolute: sqlite:////...
        return
    base = request.getfixturevalue("pg_base_url")
    if base is None:
        message = f"PostgreSQL unavailable: {_PG_STATE['reason']}"
        if REQUIRE_PG:
            pytest.fail(message + " (WORKPOOL_REQUIRE_POSTGRES=1)", pytrace=False)
        if not _WARNED:
            _WARNED.append(True)
            print(f"\n!!!!! {message} -- the postgres tests are SKIPPED !!!!!", file=sys.stderr)
        pytest.skip(message)
    schema = f"wp_test_{uuid.uuid4().hex[:12]}"
    try:
        yield _pg_schema_url(base, schema)
    finally:
        _drop_schema(base, schema)


def store_kind(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgres"


def transient_error(url: str) -> Exception:
    """An error the store at ``url`` retries a transaction after (``is_transient``),
    as a COMMIT whose reply was lost raises it: a lock on SQLite, a dropped
    connection on PostgreSQL."""
    import sqlite3

    import psycopg

    if store_kind(url) == "sqlite":
        return sqlite3.OperationalError("database is locked")
    return psycopg.OperationalError("server closed the connection unexpectedly")


def pg_schema_of(url: str) -> str | None:
    return dict(parse_qsl(urlsplit(url).query)).get("schema")


def create_table(app: Any, url: str, name: str, columns: str) -> str:
    """A user table in the store's database, in the test's schema on PostgreSQL (so
    teardown drops it too; the App creates the schema, so create it lazily): its
    qualified name."""
    schema = pg_schema_of(url)
    qualified = f'"{schema}".{name}' if schema else name
    with app.transaction() as tx:
        if schema:
            tx.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        tx.execute(f"CREATE TABLE {qualified} ({columns})")
    return qualified


@pytest.fixture
def app(store_url: str) -> Iterator[Any]:
    import workpool

    the_app = workpool.App(store_url)
    try:
        yield the_app
    finally:
        with contextlib.suppress(Exception):
            the_app.stop_workers()
        the_app.close()


# --- helpers -----------------------------------------------------------------------------


def ph(app_or_url: Any) -> str:
    """The driver's parameter placeholder for user SQL: ``?`` (SQLite) or ``%s`` (PostgreSQL)."""
    url = app_or_url if isinstance(app_or_url, str) else _app_url(app_or_url)
    return "?" if url.startswith("sqlite") else "%s"


def _app_url(app: Any) -> str:
    for attr in ("url", "_url", "database_url"):
        value = getattr(app, attr, None)
        if isinstance(value, str):
            return value
    store = getattr(app, "store", None) or getattr(app, "_store", None)
    value = getattr(store, "url", None)
    if isinstance(value, str):
        return value
    raise AssertionError("cannot tell the store of this App (no .url)")


def counted_calls(monkeypatch: Any, owner: Any, name: str) -> list[float]:
    """When each call of ``owner``'s method ``name`` began (monotonic): ``owner`` is a
    class (the calls of every instance) or one object."""
    calls: list[float] = []
    method = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def calls_at_rest(calls: list[Any], settle: float, seconds: float = 2.0) -> int:
    """How many of ``calls`` (a list some counted function appends to) a worker made
    in ``seconds``, after ``settle`` seconds for it to fall quiet."""
    time.sleep(settle)
    calls.clear()
    time.sleep(seconds)
    return len(calls)


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"condition not met within {timeout} s: {message or predicate}; last value {last!r}"
            )
        time.sleep(interval)


def holds_for(predicate: Callable[[], Any], duration: float, interval: float = 0.01) -> None:
    """Assert ``predicate`` stays true during ``duration`` seconds (a negative check)."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert predicate(), f"condition broke during the {duration} s window: {predicate}"
        time.sleep(interval)


class WorkerThread:
    """``app.run_worker`` in a background thread; errors are re-raised by ``join``."""

    def __init__(self, app: Any, **kwargs: Any) -> None:
        self.app = app
        self.kwargs = kwargs
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-worker", daemon=True)

    def _run(self) -> None:
        try:
            self.app.run_worker(**self.kwargs)
        except BaseException as exc:  # surfaced in join()
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.app.stop_workers()
            self.thread.join(10.0)
            raise AssertionError(
                f"run_worker({self.kwargs}) did not return within {timeout} s"
                + (" (and ignored stop_workers)" if self.thread.is_alive() else "")
            )
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 30.0) -> None:
        self.app.stop_workers()
        self.join(timeout)


def run_until_idle(app: Any, timeout: float = 30.0, **kwargs: Any) -> None:
    """Run a worker with ``until_idle=True``; a hang fails the test instead of the suite."""
    kwargs.setdefault("lease", 2.0)
    WorkerThread(app, until_idle=True, **kwargs).start().join(timeout)


@contextlib.contextmanager
def background_worker(
    app: Any, stop_timeout: float = 30.0, **kwargs: Any
) -> Iterator[WorkerThread]:
    """A worker serving until the block ends; then it is asked to stop and joined."""
    kwargs.setdefault("lease", 2.0)
    worker = WorkerThread(app, **kwargs).start()
    try:
        yield worker
    finally:
        worker.stop(stop_timeout)


def record_and_claim(store: Any, pool: str, work_id: str, result: str) -> tuple[Any, Any, Any]:
    """One transaction, as a worker's record that refills its slot: the success of
    ``work_id``'s attempt 1 (``result``: its encoded value), then a claim of 1 from
    ``pool``. Returns the (id, attempt) pairs the finish took, the attempts the
    claim took, and the roles of the statements left for the COMMIT."""
    seen: list[Any] = []

    def body(tx: Any) -> Any:
        now = time.time()
        done = store.finish_succeeded(
            tx, [(work_id, 1, result, pool, 0.0, None, "running")], now, "w1"
        )
        claimed = store.claim_later(tx, pool, 1, "w1", now)
        seen.append([d.role for d in tx.deferred])
        return lambda: (done(), claimed())

    done, claimed = store.run(body)()
    return done, claimed, seen[-1]


def end_and_claim(store: Any, work: Any, pool: str) -> tuple[Any, Any, Any]:
    """One transaction, as a hand-over at a pool's limit: ``end_attempt`` of
    ``work``, then a claim of 1 from ``pool``. Returns what the end answered (the
    ended attempt, or None), the attempts the claim took, and the roles of the
    statements left for the COMMIT."""
    seen: list[Any] = []

    def body(tx: Any) -> Any:
        ended = store.end_attempt(tx, work)
        claimed = store.claim_later(tx, pool, 1, "w1", time.time())
        seen.append([d.role for d in tx.deferred])
        return lambda: (ended(), claimed())

    ended, claimed = store.run(body)()
    return ended, claimed, seen[-1]


def finished(pool: Any, wid: str) -> Any:
    """The status if it is Finished, else None (for wait_for)."""
    status = pool.status(wid)
    return status if status.state == "finished" else None


def assert_pool_empty(pool: Any) -> None:
    """Nothing is pending, scheduled or running in ``pool``."""
    stats = pool.stats()
    assert (stats.running, stats.backlog, stats.scheduled) == (0, 0, 0), stats


class UserTable:
    """A user table in the store's database, for effects written by mutations/handlers."""

    def __init__(self, app: Any, url: str, name: str) -> None:
        self.app = app
        self.url = url
        self.p = ph(url)
        self.bare_name = name
        self.name = name

    def create(self) -> UserTable:
        self.name = create_table(self.app, self.url, self.bare_name, "k TEXT NOT NULL, v TEXT")
        return self

    def insert(self, tx: Any, k: str, v: str | None = None) -> None:
        tx.execute(f"INSERT INTO {self.name} (k, v) VALUES ({self.p}, {self.p})", (k, v))

    def rows(self) -> list[tuple[str, str | None]]:
        with self.app.transaction() as tx:
            return [
                tuple(r)
                for r in tx.execute(f"SELECT k, v FROM {self.name} ORDER BY k, v").fetchall()
            ]  # type: ignore[misc]

    def count(self, tx: Any = None) -> int:
        if tx is not None:
            return int(tx.execute(f"SELECT count(*) FROM {self.name}").fetchone()[0])
        with self.app.transaction() as tx2:
            return int(tx2.execute(f"SELECT count(*) FROM {self.name}").fetchone()[0])


@pytest.fixture
def user_table(app: Any, store_url: str) -> UserTable:
    return UserTable(app, store_url, f"user_{uuid.uuid4().hex[:8]}").create()


class Recorder:
    """Thread-safe record of calls and of how many run at once (also at each call)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []
        self.active = 0
        self.max_active = 0

    def enter(self, **info: Any) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.calls.append({"t": time.time(), "active": self.active, **info})

    def leave(self) -> None:
        with self.lock:
            self.active -= 1

    def add(self, **info: Any) -> None:
        with self.lock:
            self.calls.append({"t": time.time(), **info})

    def count(self, **match: Any) -> int:
        with self.lock:
            return sum(1 for c in self.calls if all(c.get(k) == v for k, v in match.items()))

    def values(self, key: str) -> list[Any]:
        with self.lock:
            return [c.get(key) for c in self.calls]


@pytest.fixture
def rec() -> Recorder:
    return Recorder()
