"""The supervisor of `workpool worker --processes N`, with real child processes.

The children here are small Python programs standing in for workers, so that
each way a child can end is made to happen on purpose (the CLI's own tests run
real workers under it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from workpool.cli import supervisor
from workpool.cli.supervisor import Supervisor

pytestmark = pytest.mark.timeout(60)


def _child(source: str) -> list[str]:
    return [sys.executable, "-c", source]


def _runs(directory: Path) -> int:
    return len(list(directory.iterdir()))


def test_a_crashed_child_is_started_again_and_a_clean_exit_ends_it(tmp_path: Path) -> None:
    # Each run leaves a file; a slot's first run crashes, its second exits cleanly.
    source = f"""
import os, sys, uuid
runs = {str(tmp_path)!r}
mine = [n for n in os.listdir(runs)]
open(os.path.join(runs, uuid.uuid4().hex), "w").close()
sys.exit(1 if len(mine) < 2 else 0)
"""
    status = Supervisor(_child(source), 2).run()
    assert status == 0
    assert _runs(tmp_path) == 4  # two crashes, each followed by a clean run


def test_a_usage_error_is_not_retried(tmp_path: Path) -> None:
    source = f"""
import os, sys, uuid
open(os.path.join({str(tmp_path)!r}, uuid.uuid4().hex), "w").close()
sys.exit(2)
"""
    assert Supervisor(_child(source), 1).run() == 2
    assert _runs(tmp_path) == 1


def test_a_stopped_supervisor_starts_no_more_and_reports_the_failure(tmp_path: Path) -> None:
    # Crashes at about 0.05 s and, restarted after 0.5 s, at 0.6 s; the next start
    # would be 1 s later, but SIGTERM comes at 1.2 s.
    source = f"""
import os, sys, uuid
open(os.path.join({str(tmp_path)!r}, uuid.uuid4().hex), "w").close()
sys.exit(3)
"""
    timer = threading.Timer(1.2, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert Supervisor(_child(source), 1).run() == 1
    finally:
        timer.cancel()
    assert _runs(tmp_path) == 2


def test_a_child_that_cannot_start_is_tried_again_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "no-such-program")
    timer = threading.Timer(1.2, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="workpool"):
            assert Supervisor([missing], 1).run() == 1
    finally:
        timer.cancel()
    failures = [json.loads(r.getMessage()) for r in caplog.records]
    assert [f["event"] for f in failures] == ["worker_process_start_failed"] * 2
    assert [f["restart_in"] for f in failures] == [0.5, 1.0]
    assert missing in failures[0]["error"]


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="count must be at least 1, got 0"):
        Supervisor(_child("pass"), 0)


def test_a_supervisor_gone_at_once_stops_the_child_only_after_its_worker_began(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop sent before the child's worker has begun to start would be lost, and
    the orphan would run on: the watch looks first a second after it began."""
    parent = os.getppid()
    parents = iter([parent])  # there when the child starts, gone at the next look
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))
    stopped = threading.Event()
    assert supervisor.watch_supervisor(parent, stopped.set)
    assert not stopped.wait(0.5), "stopped before the worker could begin to start"
    assert stopped.wait(5)


def test_a_child_whose_supervisor_is_gone_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getppid", lambda: 1)
    stopped = threading.Event()
    assert not supervisor.watch_supervisor(4242, stopped.set)
    assert not stopped.is_set()
