"""Work ids: UUIDv7 strings, time-ordered so inserts stay local in every index."""

from __future__ import annotations

import os
import time
import uuid


def new_work_id() -> str:
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version 7
    value |= ((rand >> 62) & 0xFFF) << 64  # 12 random bits
    value |= 0b10 << 62  # RFC 4122 variant
    value |= rand & ((1 << 62) - 1)
    return str(uuid.UUID(int=value))
