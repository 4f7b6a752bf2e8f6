"""The operator commands on both stores: status (--watch), inspect, pause, resume, set,
cancel, dashboard and the worker's --metrics-port.

The app module lives in tmp_path and opens ``workpool.App()``, so its store is
$WORKPOOL_DATABASE_URL: the test's ``store_url`` (SQLite only for the two tests
of terminal drawing, tokens and ports, which no store changes). The test enqueues and checks
through its own App on the same database. In-process commands run with click's
CliRunner, each on a freshly imported module (as a new process would); the
commands that serve or watch run as real processes and are stopped by signal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import workpool
from conftest import background_worker, wait_for
from workpool.cli import main, ops

pytestmark = pytest.mark.timeout(60)

APP_SOURCE = """
import time
import workpool

app = workpool.App()
mail = app.pool("mail")


@app.action(name="ping")
def ping(n: int, sleep: float = 0.0) -> int:
    time.sleep(sleep)
    return n * 2
"""


@dataclass
class Cli:
    """The user's app module in tmp_path (the cwd), and the test's own App on its store."""

    directory: Path
    module: str
    url: str
    app: workpool.App

    @property
    def spec(self) -> str:
        return f"{self.module}:app"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "WORKPOOL_DATABASE_URL": self.url, "PYTHONUNBUFFERED": "1"}

    def __call__(self, *args: str) -> Result:
        """``workpool ARGS`` in this process, on a fresh import of the app module."""
        try:
            return CliRunner().invoke(main, list(args), env={"COLUMNS": "120"})
        finally:
            loaded = sys.modules.pop(self.module, None)
            if loaded is not None:
                loaded.app.close()

    def json(self, *args: str) -> Any:
        result = self(*args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        # A suite started in the background (`make test &`) has SIGINT ignored, and exec
        # keeps an ignored signal ignored: the command would never see the Ctrl-C that
        # `stop` sends. A handled signal is reset to its default at exec, as a terminal
        # would give it.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "workpool", *args],
                cwd=self.directory,
                env={**self.env, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        finally:
            signal.signal(signal.SIGINT, previous)


@contextmanager
def app_module(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    module = f"opsapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(APP_SOURCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("WORKPOOL_DATABASE_URL", url)
    app = workpool.App(url)

    @app.action(name="ping")
    def ping(n: int, sleep: float = 0.0) -> int:
        return n * 2

    app.pool("mail").configure(max_parallelism=2)  # stored before any command runs
    try:
        yield Cli(tmp_path, module, url, app)
    finally:
        app.stop_workers()
        app.close()


@pytest.fixture
def cli(store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    with app_module(store_url, tmp_path, monkeypatch) as module:
        yield module


@pytest.fixture
def sqlite_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    """For what the store cannot change (terminal drawing, tokens, ports): SQLite only."""
    with app_module(f"sqlite:///{tmp_path / 'ops.db'}", tmp_path, monkeypatch) as module:
        yield module


def one_line_error(result: Result, expected: str, status: int = 1) -> None:
    assert result.exit_code == status, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 or "Usage:" in result.stderr, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.output


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> tuple[str, str]:
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out, err


# --- status ------------------------------------------------------------------------------


def test_status_says_why_the_backlog_waits(cli: Cli) -> None:
    mail = cli.app.pool("mail")
    mail.enqueue_action_batch("ping", [{"n": i} for i in range(3)])
    mail.enqueue_action("ping", {"n": 9}, run_after=600)

    result = cli("status", cli.spec)

    assert result.exit_code == 0, result.output
    assert "start lag p50" in result.stdout
    assert "why the backlog waits" in result.stdout
    assert "due work, free slots: is a worker serving it?" in result.stdout
    pools = {p["pool"]: p for p in cli.json("status", cli.spec)}
    assert (pools["mail"]["backlog"], pools["mail"]["scheduled"]) == (3, 1)

    cli.app.pool("mail").pause()
    assert "paused: nothing starts" in cli("status", cli.spec).stdout


def test_status_shows_the_stored_limit_not_the_modules(cli: Cli) -> None:
    (cli.directory / f"{cli.module}.py").write_text(
        textwrap.dedent(APP_SOURCE).replace(
            'app.pool("mail")', 'app.pool("mail", max_parallelism=4)'
        )
    )
    assert cli("set", cli.spec, "mail", "--max-parallelism", "7").exit_code == 0
    assert cli.json("status", cli.spec)[0]["max_parallelism"] == 7


def test_status_watch_streams_json_lines_until_ctrl_c(cli: Cli) -> None:
    proc = cli.popen("status", cli.spec, "--watch", "--json", "--interval", "0.2")
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    cli.app.pool("mail").enqueue_action("ping", {"n": 1})
    deadline = time.monotonic() + 10
    while True:
        latest = json.loads(proc.stdout.readline())
        if latest["pools"][0]["backlog"] == 1:
            break
        assert time.monotonic() < deadline, latest
    _, err = stop(proc)
    assert proc.returncode == 0, err
    assert first["pools"][0]["pool"] == "mail"
    assert "Traceback" not in err


def test_status_watch_table_until_ctrl_c(sqlite_cli: Cli) -> None:
    cli = sqlite_cli
    proc = cli.popen(
        "status", cli.spec, "--watch", "--interval", "0.2", env={"TTY_COMPATIBLE": "1"}
    )
    assert proc.stdout is not None
    seen = 0
    while seen < 2:  # the table drawn, then redrawn: the live view is running
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        seen += "why the backlog waits" in line
    _, err = stop(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


# --- inspect -----------------------------------------------------------------------------


def test_inspect_explains_each_state(cli: Cli) -> None:
    mail = cli.app.pool("mail")
    later = mail.enqueue_action("ping", {"n": 1}, run_after=600)
    due = mail.enqueue_action("ping", {"n": 2})

    result = cli("inspect", cli.spec, later)
    assert result.exit_code == 0, result.output
    assert "scheduled: its first attempt may start in 9 min" in result.stdout
    assert '{"n": 1}' in result.stdout and "ping (action)" in result.stdout

    detail = cli.json("inspect", cli.spec, due)
    assert detail["status"] == {**detail["status"], "state": "pending", "reason": "due"}
    assert detail["info"]["args"] == {"n": 2} and detail["info"]["fn_name"] == "ping"
    assert "due now with a free slot" in detail["explanation"]

    mail.pause()
    assert cli.json("inspect", cli.spec, due)["status"]["reason"] == "paused"
    assert "`workpool resume APP mail`" in cli("inspect", cli.spec, due).stdout

    mail.resume()
    mail.cancel(later)
    with background_worker(cli.app):
        wait_for(lambda: mail.status(due).state == "finished")
    detail = cli.json("inspect", cli.spec, due)
    assert detail["info"]["result"] == {"kind": "success", "return_value": 4}
    assert detail["explanation"] == "finished: succeeded."
    assert "finished: canceled." in cli("inspect", cli.spec, later).stdout


def test_inspect_of_an_unknown_id_is_one_line(cli: Cli) -> None:
    one_line_error(cli("inspect", cli.spec, "nope"), "no work item 'nope'")


# --- pause, resume, set ------------------------------------------------------------------


def test_pause_resume_and_set(cli: Cli) -> None:
    mail = cli.app.pool("mail")

    result = cli("pause", cli.spec, "mail")
    assert result.exit_code == 0, result.output
    assert "paused (max_parallelism was 2" in result.stdout
    assert mail.stats().paused
    assert "already paused" in cli("pause", cli.spec, "mail").stdout

    assert cli.json("resume", cli.spec, "mail") == {
        "pool": "mail",
        "max_parallelism": 2,
        "paused": False,
        "previous_max_parallelism": 0,
    }
    assert "was not paused" in cli("resume", cli.spec, "mail").stdout

    result = cli("set", cli.spec, "mail", "--max-parallelism", "7", "--log-level", "info")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "pool 'mail': max_parallelism 2 -> 7, log_level INFO"
    assert mail.stats().max_parallelism == 7
    assert cli.json("set", cli.spec, "mail", "--max-parallelism", "0")["paused"] is True
    assert cli.json("resume", cli.spec, "mail")["max_parallelism"] == 7


def test_steering_errors(cli: Cli) -> None:
    one_line_error(cli("pause", cli.spec, "nope"), "no pool named 'nope' (pools: mail)")
    one_line_error(cli("resume", cli.spec, "nope"), "no pool named 'nope'")
    one_line_error(cli("set", cli.spec, "mail"), "nothing to set", status=2)
    one_line_error(cli("set", cli.spec, "mail", "--max-parallelism", "-1"), "Invalid value", 2)
    one_line_error(cli("pause", "nomodule_xyz:app", "mail"), "cannot import", status=2)
    assert cli.app.pool("mail").stats().max_parallelism == 2  # nothing changed


# --- cancel ------------------------------------------------------------------------------


def test_cancel_work_ids(cli: Cli) -> None:
    mail = cli.app.pool("mail")
    a, b = mail.enqueue_action_batch("ping", [{"n": 1}, {"n": 2}], run_after=600)

    result = cli("cancel", cli.spec, a, "unknown-id")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "canceled 1 of 2 work items",
        "  unknown-id: unknown or expired",
    ]
    assert cli.json("cancel", cli.spec, a, b) == {a: "not changed", b: "canceled"}
    assert [s.result for s in mail.status_batch([a, b])] == [workpool.Canceled()] * 2


def test_cancel_a_whole_pool_in_chunks(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "CANCEL_CHUNK", 5)
    mail = cli.app.pool("mail")
    ids = mail.enqueue_action_batch("ping", [{"n": i} for i in range(12)])
    ids += mail.enqueue_action_batch("ping", [{"n": i} for i in range(2)], run_after=600)

    result = cli("cancel", cli.spec, "--pool", "mail", "--all")

    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "canceled 14 work items of pool 'mail'"
    assert all(s.result == workpool.Canceled() for s in mail.status_batch(ids))
    assert cli.json("cancel", cli.spec, "--pool", "mail", "--all") == {
        "pool": "mail",
        "canceled": 0,
    }


@pytest.mark.parametrize(
    "args",
    [[], ["--all"], ["--pool", "mail"], ["some-id", "--pool", "mail", "--all"]],
    ids=["nothing", "all-without-pool", "pool-without-all", "ids-and-all"],
)
def test_cancel_usage_errors(cli: Cli, args: list[str]) -> None:
    result = cli("cancel", cli.spec, *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


# --- the HTTP servers --------------------------------------------------------------------


def http(method: str, url: str, token: str | None = None, body: Any = None) -> tuple[int, Any, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = json.dumps(body).encode() if body is not None else b"" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text), text
    except ValueError:
        return status, None, text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_dashboard_command_prints_its_address_and_guards_changes(cli: Cli) -> None:
    proc = cli.popen("dashboard", cli.spec, "--port", "0", "--token", "s3cret")
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    match = re.search(r"(http://127\.0\.0\.1:\d+)/#token=s3cret", "".join(lines))
    assert match, lines
    base = match.group(1)
    try:
        status, body, _ = http("GET", f"{base}/api/pools")
        assert status == 200 and [p["pool"] for p in body["pools"]] == ["mail"]
        assert http("POST", f"{base}/api/pools/mail/pause")[0] == 401
        assert http("POST", f"{base}/api/pools/mail/pause", token="wrong")[0] == 401
        assert not cli.app.pool("mail").stats().paused
        status, body, _ = http("POST", f"{base}/api/pools/mail/pause", token="s3cret")
        assert status == 200 and body["pool"]["paused"] is True
        assert cli.app.pool("mail").stats().paused
    finally:
        _, err = stop(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_dashboard_token_from_the_environment_and_port_in_use(sqlite_cli: Cli) -> None:
    cli = sqlite_cli
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = cli("dashboard", cli.spec, "--port", port)
        one_line_error(result, f"cannot listen on 127.0.0.1:{port}")
    env_proc = cli.popen(
        "dashboard", cli.spec, "--port", "0", env={"WORKPOOL_DASHBOARD_TOKEN": "from-env"}
    )
    assert env_proc.stdout is not None
    lines = [env_proc.stdout.readline() for _ in range(3)]
    stop(env_proc, signal.SIGTERM)
    assert "  token  from-env\n" in lines, lines
    assert env_proc.returncode == 0


def test_worker_serves_metrics_of_every_pool(cli: Cli) -> None:
    mail = cli.app.pool("mail")
    port = free_port()
    proc = cli.popen("worker", cli.spec, "--metrics-port", str(port), "--lease", "2")
    try:
        ids = mail.enqueue_action_batch("ping", [{"n": i} for i in range(5)])
        wait_for(lambda: all(s.state == "finished" for s in mail.status_batch(ids)), 20)

        def scraped() -> str | None:
            try:
                text = http("GET", f"http://127.0.0.1:{port}/metrics")[2]
            except OSError:  # not listening yet
                return None
            done = 'workpool_completed_total{pool="mail",status="success"} 5.0' in text
            return text if done else None

        text = wait_for(scraped, 15)
    finally:
        _, err = stop(proc, signal.SIGTERM)
    assert proc.returncode == 0, err
    assert f"metrics at http://127.0.0.1:{port}/metrics" in err
    for line in (
        'workpool_pool_max_parallelism{pool="mail"} 2.0',
        'workpool_pool_paused{pool="mail"} 0.0',
        'workpool_pool_backlog{pool="mail"} 0.0',
        'workpool_start_lag_seconds_count{pool="mail"} 5.0',
        "workpool_store_up 1.0",
    ):
        assert line in text, text


# --- help --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", ["inspect", "pause", "resume", "set", "cancel", "dashboard", "status", "worker"]
)
def test_every_new_command_has_short_help(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout
    assert len(result.stdout.splitlines()) < 45
