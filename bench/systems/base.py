"""The small interface every benchmarked system implements.

A trial (one system, one workload, one repetition) runs in its own process:

    sys = SystemClass(spec)          # spec: workload, record_dir, tmp_dir, limit, retry, ...
    sys.setup()                      # fresh database / file, schema installed
    ids = sys.enqueue_batch("noop", [{"i": 0}, ...])   # the system's own batch API
    n, cfg = sys.worker_plan()       # its best configuration on 2 cores for this workload
    ... workers started as subprocesses: `python bench/worker.py NAME CFG` -> worker_main(cfg)
    sys.unfinished()                 # jobs queued or running, from the system's own store
    sys.teardown()

Tasks (every system registers the same four, recording through common.record):
    noop(i)             record and return
    sleep(i, ms)        sleep ms milliseconds (async sleep on async systems), record start/end
    flaky(i)            fail on attempts 1 and 2, succeed on attempt 3 (the retries workload)
    big(i, blob)        check len(blob) and record (the big-payload workload)
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

BIG_LEN_KEY = "n"


class System:
    name: ClassVar[str] = "?"
    store: ClassVar[str] = "?"  # "sqlite" | "postgresql"
    # workload -> one-word reason why this system cannot run it
    na: ClassVar[dict[str, str]] = {}
    # human-readable notes on the configuration used (printed in the README/JSON)
    notes: ClassVar[str] = ""
    # a completion hook that takes a context (workpool): the big-payload workload sends
    # its 800 KB context there; the others carry the same bytes as a second argument
    has_on_complete: ClassVar[bool] = False

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.workload: str = spec["workload"]
        self.db = ""  # the trial's PostgreSQL database, once created

    # --- lifecycle --------------------------------------------------------------------------
    def _db_name(self, base: str) -> str:
        """A PostgreSQL database of this trial only (several runs may share a server)."""
        self.db = f"{base}_{os.getpid()}"
        return self.db

    def setup(self) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        pass

    # --- client side ------------------------------------------------------------------------
    def enqueue_batch(self, task: str, args_list: list[dict[str, Any]]) -> list[Any]:
        raise NotImplementedError

    def enqueue_one(self, task: str, args: dict[str, Any]) -> Any:
        return self.enqueue_batch(task, [args])[0]

    def unfinished(self) -> int:
        raise NotImplementedError

    def status_cost(self, ids: list[Any]) -> float:
        """Seconds per status lookup of one job (the scale workload)."""
        raise NotImplementedError

    def extra_verify(self) -> dict[str, Any]:
        """System-side checks after a workload (e.g. on_complete rows)."""
        return {}

    # --- workers ----------------------------------------------------------------------------
    def worker_plan(self) -> tuple[int, dict[str, Any]]:
        """How many worker processes, and the config each receives."""
        raise NotImplementedError


def flaky_should_fail(attempt: int) -> bool:
    """``attempt`` counts from 1: attempts 1 and 2 fail, 3 succeeds."""
    return attempt < 3
