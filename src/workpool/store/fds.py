"""readable(): which file descriptors have input, by poll() where the system has it.

select() refuses descriptors numbered 1024 and above, which a worker running inside
a busy application process (many sockets and files open) reaches.
"""

from __future__ import annotations

import select
from collections.abc import Sequence


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
