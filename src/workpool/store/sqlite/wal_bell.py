"""WalBell: rings when a SQLite database's write-ahead log is written (Linux inotify).

Every commit in WAL mode appends to the ``-wal`` file, so a watcher can block until
one may have happened instead of reading ``PRAGMA data_version`` every few
milliseconds. The bell only says "look now": the caller still reads
``data_version``, which alone tells a commit of another connection from anything
else. Where inotify is missing (macOS, Windows, a kernel without it, its limits
reached), ``WalBell.open`` returns None and the caller keeps polling.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from contextlib import suppress

from workpool.store.fds import InputWait

# From <sys/inotify.h>; the same on every Linux architecture.
IN_MODIFY = 0x00000002
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class WalBell:
    def __init__(self, fd: int, wal_name: bytes) -> None:
        self.fd = fd
        self.wal_name = wal_name
        self._input = InputWait()

    @classmethod
    def open(cls, db_path: str) -> WalBell | None:
        """A bell for the database file at ``db_path``; None where inotify is unavailable.

        It watches the directory, not the file: SQLite deletes the ``-wal`` file when
        its last connection closes and creates it anew with the next one.
        """
        if not sys.platform.startswith("linux"):
            return None
        try:
            # The interpreter's own symbols include the C library's (and finding
            # libc by name runs ldconfig: 5 ms a watcher).
            libc = ctypes.CDLL(None, use_errno=True)
            init, add = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError):
            return None
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        # SQLite puts the log beside the file a symbolic link points to.
        path = os.path.realpath(db_path)
        mask = IN_MODIFY | IN_CREATE | IN_MOVED_TO
        if add(fd, os.fsencode(os.path.dirname(path)), mask) < 0:
            os.close(fd)
            return None
        return cls(fd, os.fsencode(os.path.basename(path) + "-wal"))

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` s; True if the log was written (or events were lost)
        since the last call. Events that arrived meanwhile ring at once; after
        ``interrupt`` every wait returns False at once."""
        if not self._input.wait(self.fd, timeout):
            return False
        rang = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return rang
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, mask, _, size = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                name = data[start : start + size].rstrip(b"\0")
                rang = rang or name == self.wal_name or bool(mask & IN_Q_OVERFLOW)
                offset = start + size

    def interrupt(self) -> None:
        self._input.interrupt()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with suppress(OSError):
                os.close(fd)
        self._input.close()
