"""Work ids: UUIDv7 strings, time-ordered so inserts stay local in every index."""

from __future__ import annotations

import os
import time

_RAND_BYTES = 10  # 20 hex digits an id; 74 of their 80 bits end up in the id
_VARIANT = "89ab" * 4  # a random hex digit's low 2 bits give the RFC 4122 variant digit


def new_work_ids(count: int) -> list[str]:
    """``count`` fresh ids in ascending order; one call to the OS random source."""
    millis = (time.time_ns() // 1_000_000) & ((1 << 48) - 1)
    # Formatted by slicing one hex string: through uuid.UUID this took 4 us an id,
    # by integer arithmetic per id 1 us, this way 0.5 us. The 48-bit time and the
    # version are the same for all; then 3 random digits, the variant digit with 2
    # random bits, and 15 random digits.
    stamp = f"{millis:012x}"
    prefix = f"{stamp[:8]}-{stamp[8:]}-7"
    digits = os.urandom(_RAND_BYTES * count).hex()
    ids = [
        f"{prefix}{digits[j : j + 3]}-{_VARIANT[int(digits[j + 3], 16)]}"
        f"{digits[j + 4 : j + 7]}-{digits[j + 7 : j + 19]}"
        for j in range(0, 2 * _RAND_BYTES * count, 2 * _RAND_BYTES)
    ]
    # Sorted, so a batch's items get ascending ids: claims take due work by due time
    # and then id, so a batch runs in the order of its items, and its rows are
    # inserted, claimed and finished in index order. In random order every claim of
    # 100 rewrote pages all over the batch's rows (SQLite drain +15-20 %).
    ids.sort()
    return ids
