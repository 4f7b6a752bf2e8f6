"""``workpool worker --processes N``: N worker processes, each restarted if it crashes.

A worker process runs sync actions on threads, so its CPU-bound actions share one
core (Python's GIL); a machine's other cores need more processes. Each child is
a plain ``workpool worker`` of the same APP and options, so the pools' limits
hold across them as across any workers.

The children run in a session of their own: a terminal's Ctrl-C reaches the
supervisor alone, which passes one SIGTERM to each child per signal it gets (the
second asks them to leave without waiting for running work, as for one worker).
A child that exits cleanly (it was stopped, or it found its pools idle under
``--until-idle``) is not replaced; one that crashes or is killed is started
again after a backoff that grows while it keeps crashing. A child whose
supervisor vanished (``kill -9``) stops by itself within a second
(``watch_supervisor``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from workpool.observability import events

# A crashed child waits RESTART_FIRST_S before it starts again, doubling with each
# crash in a row up to RESTART_MAX_S; one that ran STEADY_S resets the count.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STEADY_S = 30.0
POLL_S = 0.1
# What a child exits with when APP or an option is wrong (click's usage errors and
# the CLI's AppLoadError): starting it again cannot help.
USAGE_ERROR = 2


class _Child:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.crashes = 0
        # When to start it (again): at once at first; None while it runs and once it
        # exited for good.
        self.restart_at: float | None = 0.0
        self.exit_code = 0


class Supervisor:
    """Runs ``count`` children of the command ``argv`` until they have all exited;
    each is started with ``--supervised-by <this process's pid>`` appended."""

    def __init__(self, argv: Sequence[str], count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count!r}")
        self.argv = list(argv)
        self.children = [_Child() for _ in range(count)]
        self.stopping = False
        self._signals: list[int] = []

    def run(self) -> int:
        """Supervise until every child has exited; the exit status for the command:
        0 if each child's last exit was clean, 2 for a usage error, else 1."""
        restore = self._install_signals()
        try:
            while any(c.proc is not None or c.restart_at is not None for c in self.children):
                while self._signals:
                    self._signals.pop()
                    self.stop()
                now = time.monotonic()
                for child in self.children:
                    self._tend(child, now)
                time.sleep(POLL_S)
        except BaseException:
            self.stop()  # no child outlives its supervisor's failure
            for child in self.children:
                if child.proc is not None:
                    child.proc.wait()
            raise
        finally:
            restore()
        codes = [c.exit_code for c in self.children]
        if USAGE_ERROR in codes:
            return USAGE_ERROR
        return 1 if any(codes) else 0

    def _tend(self, child: _Child, now: float) -> None:
        proc = child.proc
        if proc is not None:
            code = proc.poll()
            if code is None:
                return
            child.proc = None
            child.exit_code = code
            if code == 0 or self.stopping:
                child.restart_at = None
                return
            if code == USAGE_ERROR:
                self.stop()
                child.restart_at = None
                return
            steady = now - child.started_at >= STEADY_S
            self._again(child, now, steady, "worker_process_crashed", pid=proc.pid, **_exit(code))
            return
        if child.restart_at is None:
            return
        if self.stopping:
            child.restart_at = None
        elif now >= child.restart_at:
            child.started_at = now
            try:
                child.proc = subprocess.Popen(
                    [*self.argv, "--supervised-by", str(os.getpid())], start_new_session=True
                )
            except OSError as exc:  # out of processes or memory, for now
                child.exit_code = 1
                self._again(child, now, False, "worker_process_start_failed", error=str(exc))
                return
            child.restart_at = None

    def _again(self, child: _Child, now: float, steady: bool, event: str, **fields: Any) -> None:
        """Start ``child`` again after the backoff its crashes in a row have earned."""
        child.crashes = 1 if steady else child.crashes + 1
        delay = min(RESTART_FIRST_S * 2 ** (child.crashes - 1), RESTART_MAX_S)
        child.restart_at = now + delay
        events.worker_event(event, 30, **fields, restart_in=delay)

    def stop(self) -> None:
        """Ask every child to leave (a second call: without waiting for running work)."""
        self.stopping = True
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: FrameType | None) -> None:
            self._signals.append(signum)  # passed on by the loop, which may be in Popen

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore


def _exit(code: int) -> dict[str, int | str]:
    """How a child ended, as Popen's returncode tells it (negative: killed by a signal)."""
    if code >= 0:
        return {"exit_code": code}
    try:
        return {"signal": signal.Signals(-code).name}
    except ValueError:
        return {"signal": str(-code)}


def watch_supervisor(pid: int, stop: Callable[[], None]) -> bool:
    """In a child: call ``stop`` once the process ``pid`` is no longer its parent.

    False if it is not its parent already (the child should not start at all).
    The first look comes a second after this returns: ``stop`` (``App.stop_workers``)
    reaches only a worker that has begun to start, which the caller does next.
    """
    if os.getppid() != pid:
        return False

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != pid:
                stop()
                return

    threading.Thread(target=watch, name="workpool-supervisor-watch", daemon=True).start()
    return True


def child_argv(app_spec: str, options: Sequence[str]) -> list[str]:
    """The command that runs one child worker: this Python, ``-m workpool worker``."""
    return [sys.executable, "-m", "workpool", "worker", app_spec, *options]
