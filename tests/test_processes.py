"""Real ``workpool worker`` processes on one database: the limit holds across them, and
SIGKILL / SIGTERM / SIGSTOP lose nothing and double nothing (PRODUCT.md §1, §3, §4).

Actions append one JSON line per event to a shared file opened with O_APPEND
(atomic for short writes), so the test can rebuild who ran what, when.
Mutations and on_complete handlers write rows into a user table in the store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import workpool
from conftest import UserTable, store_kind, wait_for

pytestmark = pytest.mark.timeout(180)

APP_SOURCE = textwrap.dedent(
    """
    import json, os, time
    import workpool

    app = workpool.App()  # $WORKPOOL_DATABASE_URL
    LOG = os.environ["WP_TEST_LOG"]
    TABLE = os.environ["WP_TEST_TABLE"]
    P = "?" if app.url.startswith("sqlite") else "%s"


    def log(**fields):
        line = json.dumps({"pid": os.getpid(), "t": time.time(), **fields}) + "\\n"
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


    @app.action(name="span")
    def span(i, dur):
        attempt = workpool.current().attempt
        start = time.time()
        log(ev="start", i=i, attempt=attempt)
        time.sleep(dur)
        log(ev="end", i=i, attempt=attempt, start=start, end=time.time())
        return i


    @app.mutation(name="effect")
    def effect(tx, i, dur=0.0):
        if dur:
            time.sleep(dur)
        tx.execute(f"INSERT INTO {TABLE} (k, v) VALUES ({P}, {P})",
                   (f"mut:{i}", str(workpool.current().attempt)))
        return i


    @app.mutation(name="done")
    def done(tx, work_id, context, result):
        tx.execute(f"INSERT INTO {TABLE} (k, v) VALUES ({P}, {P})",
                   (f"done:{work_id}", result.kind))
    """
)


class Harness:
    """The app module on disk, imported here too, plus helpers to start workers."""

    def __init__(self, tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp_path
        self.url = store_url
        self.log = tmp_path / "events.jsonl"
        self.log.touch()
        self.module = f"wp_proc_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{self.module}.py").write_text(APP_SOURCE)
        table_name = f"effects_{uuid.uuid4().hex[:8]}"
        monkeypatch.setenv("WORKPOOL_DATABASE_URL", store_url)
        monkeypatch.setenv("WP_TEST_LOG", str(self.log))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.appnames: dict[int, str] = {}
        spec = importlib.util.spec_from_file_location(self.module, tmp_path / f"{self.module}.py")
        assert spec is not None and spec.loader is not None
        self.table = None
        # The module reads WP_TEST_TABLE at import: compute the qualified name first.
        probe = workpool.App(store_url)
        try:
            self.table = UserTable(probe, store_url, table_name)
            self.table.create()
        finally:
            probe.close()
        monkeypatch.setenv("WP_TEST_TABLE", self.table.name)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        self.mod = mod
        self.app: Any = mod.app
        self.table.app = self.app
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        }

    def start_worker(self, *args: str) -> subprocess.Popen[bytes]:
        n = len(self.procs)
        out = open(self.dir / f"worker{n}.out", "wb")  # noqa: SIM115 - closed with the process
        # Tag the worker's PostgreSQL sessions (application_name), so freeze() finds them.
        appname = f"wp_test_worker_{uuid.uuid4().hex[:8]}"
        env = dict(self.env)
        if store_kind(self.url) == "postgres":
            env["WORKPOOL_DATABASE_URL"] = f"{self.url}&application_name={appname}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "workpool", "worker", f"{self.module}:app", *args],
            cwd=self.dir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        self.procs.append(proc)
        self.appnames[proc.pid] = appname
        return proc

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        n = self.procs.index(proc)
        return (self.dir / f"worker{n}.out").read_text(errors="replace")[-4000:]

    def wait(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(
                f"worker {proc.pid} did not exit within {timeout} s; output:\n{self.output(proc)}"
            ) from None

    def freeze(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGSTOP ``proc`` at a moment it holds no open database transaction.

        A process frozen inside a transaction would hold SQLite's write lock (or
        PostgreSQL row/advisory locks) until SIGCONT: a hazard of the test, not a
        behaviour under test, so retry until the freeze lands between transactions.
        """
        deadline = time.monotonic() + 20
        while True:
            proc.send_signal(signal.SIGSTOP)
            if not self._transaction_open(proc):
                return
            proc.send_signal(signal.SIGCONT)
            assert time.monotonic() < deadline, "could not freeze the worker between transactions"
            time.sleep(0.02)

    def _transaction_open(self, proc: subprocess.Popen[bytes]) -> bool:
        if store_kind(self.url) == "sqlite":
            import sqlite3

            conn = sqlite3.connect(self.url[len("sqlite:///") :], timeout=0.2, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
                return False
            except sqlite3.OperationalError:
                return True
            finally:
                conn.close()
        import psycopg

        base = self.url.split("?", 1)[0]
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                " AND state IS NOT NULL AND state <> 'idle'",
                (self.appnames[proc.pid],),
            ).fetchone()
            return bool(row and row[0])

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def rows(self) -> list[tuple[str, str | None]]:
        return self.table.rows()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.app.close()


@pytest.fixture
def harness(tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch):
    h = Harness(tmp_path, store_url, monkeypatch)
    try:
        yield h
    finally:
        h.close()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1])
    )  # an end sorts before a start at a tie
    best = current = 0
    for _, delta in points:
        current += delta
        best = max(best, current)
    return best


def test_max_overlap_helper():
    assert max_overlap([(0, 1), (1, 2)]) == 1
    assert max_overlap([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert max_overlap([]) == 0


def test_worker_processes_never_exceed_the_limit(harness: Harness, store_url: str):
    n_workers = 3 if store_kind(store_url) == "sqlite" else 4
    pool = harness.app.pool("shared_limit", max_parallelism=3)
    wids = pool.enqueue_action_batch(harness.mod.span, [{"i": i, "dur": 0.2} for i in range(36)])
    # Each worker refills the slots it frees in the same transaction, so a worker able
    # to run the whole limit keeps it; with 2 slots each, reaching 3 needs two of them.
    procs = [
        harness.start_worker("--concurrency", "2", "--until-idle", "--lease", "2")
        for _ in range(n_workers)
    ]
    for proc in procs:
        assert harness.wait(proc, 120) == 0, harness.output(proc)

    ends = [e for e in harness.events() if e["ev"] == "end"]
    assert sorted(e["i"] for e in ends) == list(range(36))
    assert max_overlap([(e["start"], e["end"]) for e in ends]) <= 3
    assert max_overlap([(e["start"], e["end"]) for e in ends]) == 3
    assert len({e["pid"] for e in ends}) >= 2, "the work should be shared by the processes"
    assert [s.result for s in pool.status_batch(wids)] == [workpool.Success(i) for i in range(36)]


def test_sigkill_mid_attempt_loses_nothing(harness: Harness):
    retry = workpool.RetryBehavior(max_attempts=5, initial_backoff=0.05)
    pool = harness.app.pool("crashy", max_parallelism=6)
    actions = pool.enqueue_action_batch(
        harness.mod.span,
        [{"i": i, "dur": 0.6} for i in range(12)],
        retry=retry,
        on_complete=harness.mod.done,
    )
    mutations = pool.enqueue_mutation_batch(
        harness.mod.effect,
        [{"i": i, "dur": 0.02} for i in range(12)],
        on_complete=harness.mod.done,
    )
    victim = harness.start_worker("--concurrency", "4", "--lease", "1")
    wait_for(
        lambda: (
            sum(1 for e in harness.events() if e["ev"] == "start" and e["pid"] == victim.pid) >= 2
        ),
        timeout=30,
        message="victim never started work",
    )
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    killed_events = harness.events()
    started_by_victim = {
        e["i"] for e in killed_events if e["ev"] == "start" and e["pid"] == victim.pid
    }
    ended_by_victim = {e["i"] for e in killed_events if e["ev"] == "end" and e["pid"] == victim.pid}
    cut_short = started_by_victim - ended_by_victim
    assert cut_short, "the kill should interrupt at least one running attempt"

    rescuer = harness.start_worker("--concurrency", "4", "--until-idle", "--lease", "1")
    assert harness.wait(rescuer, 120) == 0, harness.output(rescuer)

    statuses = pool.status_batch(actions + mutations)
    assert [s.result for s in statuses] == [workpool.Success(i) for i in range(12)] * 2
    rows = harness.rows()
    mut_rows = Counter(k for k, _ in rows if k.startswith("mut:"))
    assert mut_rows == Counter({f"mut:{i}": 1 for i in range(12)}), "mutation effects not once"
    done_rows = Counter(k for k, _ in rows if k.startswith("done:"))
    assert done_rows == Counter({f"done:{w}": 1 for w in actions + mutations}), (
        "on_complete not exactly once per work"
    )
    assert all(v == "success" for k, v in rows if k.startswith("done:"))
    # Every attempt the kill cut short ran again to the end in the rescuer.
    ends = [e for e in harness.events() if e["ev"] == "end"]
    for i in cut_short:
        assert any(e["i"] == i and e["pid"] == rescuer.pid for e in ends), i


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_stops_claiming_and_finishes_running_work(harness: Harness, sig):
    pool = harness.app.pool("graceful", max_parallelism=5)
    wids = pool.enqueue_action_batch(
        harness.mod.span, [{"i": i, "dur": 0.6} for i in range(8)], on_complete=harness.mod.done
    )
    leaving = harness.start_worker("--concurrency", "2", "--lease", "2")
    wait_for(
        lambda: (
            sum(1 for e in harness.events() if e["ev"] == "start" and e["pid"] == leaving.pid) >= 2
        ),
        timeout=30,
        message="worker never started work",
    )
    term_at = time.time()
    leaving.send_signal(sig)
    code = harness.wait(leaving, 30)
    assert code == 0, harness.output(leaving)

    events = harness.events()
    mine = [e for e in events if e["pid"] == leaving.pid]
    started = {e["i"] for e in mine if e["ev"] == "start"}
    ended = {e["i"] for e in mine if e["ev"] == "end"}
    assert started == ended, "running work must finish before the worker exits"
    assert not [e for e in mine if e["ev"] == "start" and e["t"] > term_at], "claimed after SIGTERM"
    assert len(started) < 8
    # What the leaving worker finished is recorded, not redone.
    for wid, i in zip(wids, range(8), strict=True):
        if i in ended:
            assert pool.status(wid) == workpool.Finished(workpool.Success(i))

    rest = harness.start_worker("--concurrency", "4", "--until-idle", "--lease", "2")
    assert harness.wait(rest, 120) == 0, harness.output(rest)
    all_ends = Counter(e["i"] for e in harness.events() if e["ev"] == "end")
    assert all_ends == Counter(range(8)), "each action ran exactly once"
    assert [s.result for s in pool.status_batch(wids)] == [workpool.Success(i) for i in range(8)]
    done_rows = Counter(k for k, _ in harness.rows() if k.startswith("done:"))
    assert done_rows == Counter({f"done:{w}": 1 for w in wids})


def test_a_frozen_worker_is_fenced_when_it_wakes_up(harness: Harness):
    """SIGSTOP past the lease: the work is rescued and re-run elsewhere; the late completion
    of the old attempt after SIGCONT changes nothing (no second on_complete, no count)."""
    retry = workpool.RetryBehavior(max_attempts=3, initial_backoff=0.05)
    pool = harness.app.pool("frozen")
    wid = pool.enqueue_action(
        harness.mod.span, {"i": 7, "dur": 1.5}, retry=retry, on_complete=harness.mod.done
    )
    frozen = harness.start_worker("--concurrency", "1", "--lease", "1")
    try:
        wait_for(
            lambda: any(e["ev"] == "start" and e["pid"] == frozen.pid for e in harness.events()),
            timeout=30,
        )
        harness.freeze(frozen)
        rescuer = harness.start_worker("--concurrency", "2", "--until-idle", "--lease", "1")
        assert harness.wait(rescuer, 60) == 0, harness.output(rescuer)
        assert pool.status(wid) == workpool.Finished(workpool.Success(7))
    finally:
        frozen.send_signal(signal.SIGCONT)
    # The frozen worker wakes up, finishes attempt 1 and tries to record it.
    wait_for(
        lambda: any(e["ev"] == "end" and e["pid"] == frozen.pid for e in harness.events()),
        timeout=20,
        message="the frozen attempt never ended",
    )
    frozen.send_signal(signal.SIGTERM)
    assert harness.wait(frozen, 30) == 0, harness.output(frozen)

    done_rows = [(k, v) for k, v in harness.rows() if k.startswith("done:")]
    assert done_rows == [(f"done:{wid}", "success")]
    assert pool.status(wid) == workpool.Finished(workpool.Success(7))
    stats = pool.stats()
    assert stats.succeeded == 1, stats
    attempts = sorted(e["attempt"] for e in harness.events() if e["ev"] == "start")
    assert attempts == [1, 2]


def test_worker_serves_only_the_pools_it_is_given(harness: Harness):
    a = harness.app.pool("only_a")
    b = harness.app.pool("only_b")
    wa = a.enqueue_action(harness.mod.span, {"i": 1, "dur": 0.0})
    wb = b.enqueue_action(harness.mod.span, {"i": 2, "dur": 0.0})
    proc = harness.start_worker("--pool", "only_a", "--until-idle", "--lease", "2")
    assert harness.wait(proc, 60) == 0, harness.output(proc)
    assert a.status(wa) == workpool.Finished(workpool.Success(1))
    assert b.status(wb).state == "pending"


def test_cli_status_shows_the_pools(harness: Harness):
    pool = harness.app.pool("visible", max_parallelism=7)
    pool.enqueue_action(harness.mod.span, {"i": 1, "dur": 0.0}, run_after=60)
    out = subprocess.run(
        [sys.executable, "-m", "workpool", "status", f"{harness.module}:app"],
        cwd=harness.dir,
        env=harness.env,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr.decode()
    assert "visible" in out.stdout.decode()


def test_cli_rejects_a_bad_app_spec(harness: Harness):
    out = subprocess.run(
        [sys.executable, "-m", "workpool", "worker", "no_such_module:app", "--until-idle"],
        cwd=harness.dir,
        env=harness.env,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr.decode()
