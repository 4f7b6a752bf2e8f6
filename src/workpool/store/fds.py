"""Waiting for input on file descriptors: ``readable()``, and ``InputWait``, a wait
that another thread can interrupt (a worker that stops).

Both use poll() where the system has it: select() refuses descriptors numbered
1024 and above, which a worker running inside a busy application process (many
sockets and files open) reaches.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence
from contextlib import suppress


def readable(fds: Sequence[int], timeout: float) -> list[int]:
    """The descriptors of ``fds`` with input (or closed, or in error) within
    ``timeout`` seconds; an empty list when the time ran out."""
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        return [fd for fd, _ in poller.poll(timeout * 1000.0)]
    ready, _, _ = select.select(list(fds), [], [], timeout)  # Windows: sockets only
    return list(ready)


class InputWait:
    """Waits for input on a descriptor until ``interrupt()``, from any thread, ends
    the wait in progress and every later one (a socket pair polled beside it)."""

    def __init__(self) -> None:
        self._bell, self._ring = socket.socketpair()
        self.interrupted = False

    def wait(self, fd: int, timeout: float) -> bool:
        """True when ``fd`` has input (or is closed) within ``timeout`` seconds;
        False when the time ran out or the wait was interrupted."""
        if self.interrupted:
            return False
        bell = self._bell.fileno()
        ready = readable([fd, bell], timeout)
        return bool(ready) and bell not in ready

    def interrupt(self) -> None:
        self.interrupted = True
        with suppress(OSError):  # closed already: nothing waits
            self._ring.send(b"x")  # never read: every later poll sees it too

    def close(self) -> None:
        self._bell.close()
        self._ring.close()
