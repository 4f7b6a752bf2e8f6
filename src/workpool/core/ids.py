"""Work ids: UUIDv7 strings, time-ordered so inserts stay local in every index."""

from __future__ import annotations

import os
import time
import uuid

_RAND_BYTES = 10  # 74 of these 80 bits end up in the id, beside the millisecond time


def new_work_ids(count: int) -> list[str]:
    """``count`` fresh ids; one call to the OS random source for the whole batch."""
    millis = (time.time_ns() // 1_000_000) & ((1 << 48) - 1)
    pool = os.urandom(_RAND_BYTES * count)
    ids = []
    for i in range(count):
        rand = int.from_bytes(pool[i * _RAND_BYTES : (i + 1) * _RAND_BYTES], "big")
        value = millis << 80
        value |= 0x7 << 76  # version 7
        value |= ((rand >> 62) & 0xFFF) << 64  # 12 random bits
        value |= 0b10 << 62  # RFC 4122 variant
        value |= rand & ((1 << 62) - 1)
        ids.append(str(uuid.UUID(int=value)))
    return ids
