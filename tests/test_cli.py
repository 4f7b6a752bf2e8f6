"""The `workpool` command: status, worker, demo, and the one-line APP errors.

SQLite only, but for the drain of `worker --processes`, which runs on both stores:
the command line adds nothing else store-specific (the library's suite covers both
stores), and the demo is the SQLite demo by design.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from workpool.cli import main

pytestmark = pytest.mark.timeout(60)

APP_SOURCE = """
import os
import time

import workpool

app = workpool.App({url!r})
mail = app.pool("mail", max_parallelism=2)
other = app.pool("other", max_parallelism=1)
NOT_AN_APP = 42


@app.action(name="ping")
def ping(n: int) -> int:
    return n * 2


@app.action(name="whoami")
def whoami(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@app.mutation(name="note")
def note(tx, n: int) -> None:
    tx.execute("CREATE TABLE IF NOT EXISTS notes (n INTEGER)")
    tx.execute("INSERT INTO notes (n) VALUES (?)", (n,))
"""


@dataclass
class AppModule:
    """A user's app module in its own directory (the cwd), on its own SQLite file."""

    directory: Path
    name: str
    url: str

    @property
    def spec(self) -> str:
        return f"{self.name}:app"

    def write(self, name: str, source: str) -> None:
        (self.directory / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()  # the directory may have been listed before

    def load(self) -> Any:
        """The module, imported in this process (as `workpool status` would)."""
        if str(self.directory) not in sys.path:
            sys.path.insert(0, str(self.directory))
        return importlib.import_module(self.name)


def _app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> Iterator[AppModule]:
    # Unique module names: modules imported in-process stay in sys.modules.
    name = f"cliapp_{uuid.uuid4().hex[:8]}"
    module = AppModule(tmp_path, name, url)
    module.write(name, APP_SOURCE.format(url=url))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_app puts the cwd first
    before = set(sys.modules)
    yield module
    for added in set(sys.modules) - before:
        if added.startswith(("cliapp_", "broken_", "notapp_")):
            loaded = sys.modules.pop(added)
            app = getattr(loaded, "app", None)
            if app is not None and hasattr(app, "close"):
                app.close()


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AppModule]:
    yield from _app_module(tmp_path, monkeypatch, f"sqlite:///{tmp_path / 'app.db'}")


@pytest.fixture
def app_module_on_each_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store_url: str
) -> Iterator[AppModule]:
    yield from _app_module(tmp_path, monkeypatch, store_url)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def run_cli(*args: str, cwd: Path, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """`python -m workpool ARGS` in a real process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100"}
    env.pop("WORKPOOL_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "workpool", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status_json(spec: str) -> dict[str, dict[str, Any]]:
    result = invoke("status", spec, "--json")
    assert result.exit_code == 0, result.output
    return {entry["pool"]: entry for entry in json.loads(result.stdout)}


# --- status ------------------------------------------------------------------------------


def test_status_table_shows_backlog_right_after_enqueue(app_module: AppModule) -> None:
    mod = app_module.load()
    mod.mail.enqueue_action_batch(mod.ping, [{"n": i} for i in range(3)])

    result = invoke("status", app_module.spec)

    assert result.exit_code == 0, result.output
    for column in (
        "pool",
        "limit",
        "running",
        "due",
        "backlog",
        "scheduled",
        "later",
        "finished",
        "failure rate",
    ):
        assert column in result.stdout
    mail = next(line for line in result.stdout.splitlines() if " mail " in line)
    # pool, limit, running, due backlog, scheduled later, finished, failure rate
    assert mail.split() == ["mail", "2", "0", "3", "0", "0", "-"]


def test_status_json_lists_every_pool_with_its_stats(app_module: AppModule) -> None:
    mod = app_module.load()
    mod.mail.enqueue_action_batch(mod.ping, [{"n": i} for i in range(3)])
    mod.mail.enqueue_action(mod.ping, {"n": 9}, run_after=600)

    pools = status_json(app_module.spec)

    assert set(pools) == {"mail", "other"}  # declared in the module, created in the store
    mail = pools["mail"]
    assert (mail["backlog"], mail["scheduled"], mail["running"], mail["finished"]) == (3, 1, 0, 0)
    assert (mail["max_parallelism"], mail["paused"], mail["window"]) == (2, False, 3600.0)
    assert pools["other"]["backlog"] == 0


def test_status_shows_a_paused_pool(app_module: AppModule) -> None:
    mod = app_module.load()
    mod.other.configure(max_parallelism=0)

    result = invoke("status", app_module.spec)

    assert result.exit_code == 0, result.output
    other = next(line for line in result.stdout.splitlines() if " other " in line)
    assert "paused" in other


def test_status_of_an_empty_database(app_module: AppModule) -> None:
    name = f"notapp_{uuid.uuid4().hex[:8]}"
    app_module.write(
        name, f"import workpool\napp = workpool.App('sqlite:///{app_module.directory}/e.db')\n"
    )
    result = invoke("status", f"{name}:app")
    assert result.exit_code == 0, result.output
    assert "no pools yet" in result.stdout
    assert json.loads(invoke("status", f"{name}:app", "--json").stdout) == []


# --- worker ------------------------------------------------------------------------------


def test_worker_until_idle_drains_only_the_pools_it_serves(app_module: AppModule) -> None:
    mod = app_module.load()
    mail_ids = mod.mail.enqueue_action_batch(mod.ping, [{"n": i} for i in range(3)])
    mod.mail.enqueue_mutation(mod.note, {"n": 7})
    mod.other.enqueue_action(mod.ping, {"n": 1})

    proc = run_cli(
        "worker",
        app_module.spec,
        "--pool",
        "mail",
        "--until-idle",
        "--concurrency",
        "4",
        "--lease",
        "2",
        cwd=app_module.directory,
    )

    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    pools = status_json(app_module.spec)
    assert (pools["mail"]["finished"], pools["mail"]["backlog"]) == (4, 0)
    assert (pools["mail"]["succeeded"], pools["mail"]["failed"]) == (4, 0)
    assert pools["other"]["backlog"] == 1  # not served by this worker
    results = [s.result.return_value for s in mod.mail.status_batch(mail_ids)]
    assert results == [0, 2, 4]
    with mod.app.transaction() as tx:
        assert tx.execute("SELECT n FROM notes").fetchall() == [(7,)]


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"event": "{name}"' in line:
            found.append(json.loads(line))
    return found


def _wait_for(what: str, check: Any, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{what}: {log.read_text()}"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # exited but not yet reaped by its new parent: a zombie (Linux tells)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return os.path.isdir("/proc")  # it went meanwhile, or there is no /proc to ask


def _worker_process(app_module: AppModule, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """`workpool worker APP ARGS` in a real process, its stderr in ``log``."""
    env = {**os.environ}
    env.pop("WORKPOOL_DATABASE_URL", None)
    with log.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "workpool", "worker", app_module.spec, *args],
            cwd=app_module.directory,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def test_worker_stops_gracefully_on_sigterm(app_module: AppModule) -> None:
    log = app_module.directory / "worker.log"
    proc = _worker_process(app_module, log, "--lease", "2")
    try:
        _wait_for("the worker", lambda: "worker_started" in log.read_text(), proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "worker_stopped" in log.read_text()
    assert "Traceback" not in log.read_text()


# --- worker --processes ------------------------------------------------------------------


def test_worker_processes_share_the_work_and_leave_when_idle(
    app_module_on_each_store: AppModule,
) -> None:
    app_module = app_module_on_each_store
    mod = app_module.load()
    wide = mod.app.pool("wide", max_parallelism=8)
    ids = wide.enqueue_action_batch(mod.whoami, [{"seconds": 0.15}] * 24)

    proc = run_cli(
        "worker",
        app_module.spec,
        "--processes",
        "2",
        "--concurrency",
        "2",
        "--until-idle",
        "--lease",
        "2",
        cwd=app_module.directory,
    )

    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    results = [s.result for s in wide.status_batch(ids)]
    assert all(r is not None and r.kind == "success" for r in results), results
    pids = {r.return_value for r in results if r is not None}
    # One process alone would take 1.8 s at 2 at a time: the other starts well before.
    assert len(pids) == 2
    assert os.getpid() not in pids and proc.stderr.count('"worker_stopped"') == 2


def test_worker_processes_replace_a_killed_one_and_stop_on_sigterm(
    app_module: AppModule,
) -> None:
    log = app_module.directory / "worker.log"
    proc = _worker_process(app_module, log, "--processes", "2", "--lease", "2")
    try:
        _wait_for("two workers", lambda: len(_events(log, "worker_started")) == 2, proc, log)
        first, second = (e["pid"] for e in _events(log, "worker_started"))
        os.kill(first, signal.SIGKILL)
        _wait_for("a third worker", lambda: len(_events(log, "worker_started")) == 3, proc, log)
        crashed = _events(log, "worker_process_crashed")
        assert [(e["pid"], e["signal"]) for e in crashed] == [(first, "SIGKILL")]
        third = _events(log, "worker_started")[2]["pid"]
        assert third not in (first, second)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stopped = _events(log, "worker_stopped")
    assert len(stopped) == 2, log.read_text()  # the survivor and the new one, gracefully
    assert _gone(second) and _gone(third)
    assert "Traceback" not in log.read_text()


def test_worker_processes_leave_when_their_supervisor_is_killed(app_module: AppModule) -> None:
    log = app_module.directory / "worker.log"
    proc = _worker_process(app_module, log, "--processes", "2", "--lease", "2")
    try:
        _wait_for("two workers", lambda: len(_events(log, "worker_started")) == 2, proc, log)
        pids = [e["pid"] for e in _events(log, "worker_started")]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(_events(log, "worker_stopped")) == 2, log.read_text()  # deregistered


def test_worker_rejects_bad_option_values_as_usage_errors(app_module: AppModule) -> None:
    for args in (
        ["--concurrency", "0"],
        ["--lease", "0"],
        ["--concurrency", "many"],
        ["--processes", "0"],
    ):
        result = invoke("worker", app_module.spec, *args)
        assert result.exit_code == 2, (args, result.output)
        assert "Invalid value" in result.stderr


# --- APP errors: one line, exit status 2, no traceback -----------------------------------


def _one_line_error(result: Result, expected: str, status: int = 2) -> None:
    assert result.exit_code == status, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("workpool: error: ")
    assert expected in lines[0]
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # no stray exception inside


def test_app_without_colon(app_module: AppModule) -> None:
    _one_line_error(invoke("status", app_module.name), "APP must look like 'module:attribute'")


def test_app_module_not_found(app_module: AppModule) -> None:
    _one_line_error(
        invoke("status", "no_such_module_xyz:app"),
        "cannot import 'no_such_module_xyz': No module named 'no_such_module_xyz'",
    )


def test_app_attribute_missing(app_module: AppModule) -> None:
    _one_line_error(
        invoke("worker", f"{app_module.name}:nope"),
        f"module '{app_module.name}' has no attribute 'nope'",
    )


def test_app_attribute_not_an_app(app_module: AppModule) -> None:
    _one_line_error(
        invoke("status", f"{app_module.name}:NOT_AN_APP"), "is a int, not a workpool.App"
    )


def test_app_module_raising_on_import(app_module: AppModule) -> None:
    name = f"broken_{uuid.uuid4().hex[:8]}"
    app_module.write(name, "import workpool\n\nsettings = 1 / 0\n")
    _one_line_error(
        invoke("status", f"{name}:app"),
        f"cannot import '{name}': ZeroDivisionError: division by zero (at {name}.py:3)",
    )


def test_app_module_with_syntax_error(app_module: AppModule) -> None:
    name = f"broken_{uuid.uuid4().hex[:8]}"
    app_module.write(name, "def oops(:\n    pass\n")
    _one_line_error(invoke("worker", f"{name}:app"), f"cannot import '{name}': SyntaxError")


def test_app_error_in_a_real_process_prints_one_line(app_module: AppModule) -> None:
    proc = run_cli("worker", "no_such_module_xyz:app", "--until-idle", cwd=app_module.directory)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        "workpool: error: cannot import 'no_such_module_xyz': "
        "No module named 'no_such_module_xyz'\n"
    )


def test_library_error_is_one_line_with_exit_status_1(app_module: AppModule) -> None:
    name = f"notapp_{uuid.uuid4().hex[:8]}"
    missing = app_module.directory / "missing-dir" / "x.db"
    app_module.write(name, f"import workpool\napp = workpool.App('sqlite:///{missing}')\n")
    _one_line_error(invoke("status", f"{name}:app"), "directory", status=1)


# --- help --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["worker"], ["status"], ["demo"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout
    assert len(result.stdout.splitlines()) < 40  # short


# --- demo --------------------------------------------------------------------------------


def test_demo_runs_and_checks_its_promises(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    proc = run_cli("demo", "--items", "200", "--db", str(db), cwd=tmp_path, timeout=60)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "limit respected: yes" in out
    assert "on_complete exactly once: yes" in out
    assert "one report per delivery: yes" in out
    assert "cancel: yes" in out
    assert "total wall time:" in out
    assert proc.stderr == ""  # the worker's log lines do not reach the screen
    assert db.exists()


def test_demo_refuses_an_existing_database(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    db.write_text("")
    result = invoke("demo", "--db", str(db))
    assert result.exit_code == 2
    assert "exists" in result.stderr
    assert db.read_text() == ""


def test_demo_stops_at_the_seconds_limit(tmp_path: Path) -> None:
    proc = run_cli("demo", "--items", "20000", "--seconds-limit", "0.5", cwd=tmp_path, timeout=60)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopped at the 0.5 s limit" in proc.stdout
    assert "limit respected: yes" in proc.stdout
    assert "on_complete exactly once: yes" in proc.stdout
