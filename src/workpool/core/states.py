"""The states work moves through and the transitions allowed between them, as data.

``finished`` work no longer lives in the active table: it is a row of the
results table, read by ``status`` until its retention expires.
"""

from __future__ import annotations

from enum import StrEnum


class WorkState(StrEnum):
    PENDING = "pending"  # waiting for its due time and a free slot
    RUNNING = "running"  # an attempt holds a slot, under a worker's lease
    # The attempt's action returned and gave its slot to the next attempt; its
    # outcome is not recorded yet. Still under the worker's lease.
    ENDED = "ended"
    COMPLETING = "completing"  # result fixed; its on_complete waits for a (re)try
    FINISHED = "finished"  # on_complete committed (or given up); result retained


P, R, C, F = WorkState.PENDING, WorkState.RUNNING, WorkState.COMPLETING, WorkState.FINISHED
E = WorkState.ENDED
# The states whose attempt's outcome may still be recorded (its run is over or not).
RECORDABLE = frozenset({R, E})

# name -> (from states, to state). Each store operation performs exactly one of
# these as a compare-and-set on (state, attempt); tests cover them by name.
TRANSITIONS: dict[str, tuple[frozenset[WorkState], WorkState]] = {
    "claim": (frozenset({P}), R),
    "end": (frozenset({R}), E),
    "retry": (frozenset({R, E}), P),
    "finish": (frozenset({R, E}), F),
    "finish_handler_failed": (frozenset({R, E}), C),
    "cancel_pending": (frozenset({P}), F),
    "cancel_pending_with_handler": (frozenset({P}), C),
    "rescue_retry": (frozenset({R, E}), P),
    "rescue_finish": (frozenset({R, E}), F),
    "rescue_handler_failed": (frozenset({R, E}), C),
    "finalize": (frozenset({C}), F),
    "finalize_failed": (frozenset({C}), C),
}


def allowed(name: str, current: WorkState) -> bool:
    sources, _ = TRANSITIONS[name]
    return current in sources
