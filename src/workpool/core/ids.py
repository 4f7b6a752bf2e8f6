"""Work ids: UUIDv7 strings, time-ordered so inserts stay local in every index."""

from __future__ import annotations

import os
import time

_LOW_SPAN = 1 << 48  # the last 12 hex digits, where a batch counts up


def new_work_ids(count: int) -> list[str]:
    """``count`` fresh ids in ascending order; one call to the OS random source.

    A batch's ids share the 48-bit millisecond and 26 random bits, and count up in
    their last 48 bits from a random start (RFC 9562's "monotonic random"). So they
    come out in order without a sort, each for one integer format (a batch of
    1,000: 0.70 -> 0.26 us an id, against 74 random bits an id, sorted; a single id
    2.1 -> 2.2 us). Two batches made in the same millisecond share an id only if
    their 26 bits match and their ranges overlap: for two batches of 1,000, about
    2**-63, less than the 2**-54 of their million pairs of random ids.
    """
    rand = int.from_bytes(os.urandom(10))
    # Room below 2**48 for the whole batch: counting never carries into the rest.
    start = (rand >> 26) % (_LOW_SPAN - count + 1)
    first = (
        (time.time_ns() // 1_000_000 & (_LOW_SPAN - 1)) << 80
        | 0x7 << 76  # the version
        | (rand & 0xFFF) << 64
        | 0x2 << 62  # the RFC 4122 variant
        | (rand >> 12 & 0x3FFF) << 48
        | start
    )
    digits = f"{first:032x}"
    head = f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-"
    # A single enqueue's last digits are formatted already: 2.2 us an id, against
    # 2.85 through the loop below.
    if count == 1:
        return [head + digits[20:]]
    # Ascending, so a batch's items get ascending ids: claims take due work by due
    # time and then id, so a batch runs in the order of its items, and its rows are
    # inserted, claimed and finished in index order. In random order every claim of
    # 100 rewrote pages all over the batch's rows (SQLite drain +15-20 %).
    return [f"{head}{low:012x}" for low in range(start, start + count)]
