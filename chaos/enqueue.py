"""An enqueuer process of the chaos run: enqueues batches at a steady pace, and cancels.

    python -m chaos.enqueue --seed 7 --items 1000 --seconds 60 --out enq-0.json

Half of the batches are enqueued inside the enqueuer's own transaction together
with their ``chaos_items`` rows (``tx=tx``); the other half with plain client
calls, recorded afterwards. Some items are canceled, each cancel in one
transaction that first locks the work row (PostgreSQL) or the database (SQLite),
reads the status and cancels, so the recorded "state before" is exactly what the
cancel acted on.

Every exception that reaches this code is caught and written to the output file:
the orchestrator counts them (on SQLite any of them is a violation).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from typing import Any

from chaos import chaos_app as ca


class Enqueuer:
    def __init__(self, seed: int, items: int, seconds: float) -> None:
        self.rng = random.Random(seed)
        self.items = items
        self.seconds = seconds
        self.enqueued = 0
        self.batches = 0
        self.errors: list[dict[str, Any]] = []
        self.cancels: list[dict[str, Any]] = []
        self.watch: dict[str, tuple[str, float]] = {}  # slow items to cancel once running
        self.latency_max = 0.0

    def error(self, where: str, exc: BaseException, items: int = 1) -> None:
        """Note an error that reached this user code; ``items``: how many work items
        an ambiguous commit may have stored without the enqueuer counting them."""
        self.errors.append(
            {
                "where": where,
                "items": items,
                "type": f"{type(exc).__module__}.{type(exc).__name__}",
                "message": str(exc)[:500],
                "t": time.time(),
                "traceback": traceback.format_exc()[-2000:],
            }
        )

    def run(self) -> None:
        start = time.time()
        deadline = start + self.seconds
        while time.time() < deadline and self.enqueued < self.items:
            spec, args = ca.random_batch(self.rng)
            ids = self.enqueue(spec, args)
            for work_id in ids:
                if spec.get("slow") and self.rng.random() < 0.7:
                    self.watch[work_id] = (spec["pool"], time.time() + 60.0)
                elif spec.get("run_after") and self.rng.random() < 0.3:
                    self.cancel(spec["pool"], work_id)  # most likely still pending
                elif self.rng.random() < 0.02:
                    self.cancel(spec["pool"], work_id)  # whatever state it is in
            self.cancel_running()
            # Pace: items spread evenly over the enqueueing window.
            ahead = start + self.enqueued * self.seconds / self.items - time.time()
            if ahead > 0:
                time.sleep(min(ahead, 0.5))

    def enqueue(self, spec: dict[str, Any], args: list[dict[str, Any]]) -> list[str]:
        self.batches += 1
        began = time.monotonic()
        ids: list[str] = []
        if self.rng.random() < 0.5:
            try:
                with ca.app.transaction() as tx:
                    ids = ca.enqueue(spec, args, tx=tx, via="tx")
            except Exception as exc:  # the whole batch rolled back (or an ambiguous commit)
                self.error("tx", exc, len(args))
                return []
        else:
            try:
                ids = ca.enqueue(spec, args)
            except Exception as exc:
                self.error("plain", exc)
                return []
            self.record_plain(spec, args, ids)
        self.latency_max = max(self.latency_max, time.monotonic() - began)
        self.enqueued += len(ids)
        return ids

    def record_plain(
        self, spec: dict[str, Any], args: list[dict[str, Any]], ids: list[str]
    ) -> None:
        """Record plainly enqueued ids; retried until it sticks (once, even after an
        ambiguous commit)."""
        for _ in range(600):
            try:
                with ca.app.transaction() as tx:
                    found = tx.execute(
                        f"SELECT count(*) FROM {ca.T_ITEMS} WHERE work_id = {ca.P}", (ids[0],)
                    ).fetchone()[0]
                    if not found:
                        ca.record_items(tx, spec, args, ids, None, "plain")
                return
            except Exception as exc:
                self.error("record", exc)
                time.sleep(0.1)
        raise SystemExit("could not record enqueued ids for a minute")

    def cancel(self, pool_name: str, work_id: str) -> None:
        pool = ca.POOLS[pool_name]
        try:
            with ca.app.transaction() as tx:
                if not ca.IS_SQLITE:
                    # Lock the row: no claim can change it between status and cancel.
                    tx.execute(
                        f"SELECT 1 FROM {ca.PREFIX}work WHERE id = %s FOR UPDATE", (work_id,)
                    )
                status = pool.status(work_id, tx=tx)
                ok = pool.cancel(work_id, tx=tx)
        except Exception as exc:  # rolled back: nothing canceled, nothing recorded
            self.error("cancel", exc)
            return
        attempt = None
        if status.state == "running":
            attempt = status.attempt
        elif status.state == "pending":
            attempt = status.previous_attempts
        self.cancels.append(
            {"w": work_id, "state": status.state, "attempt": attempt, "ok": ok, "t": time.time()}
        )

    def cancel_running(self) -> None:
        if not self.watch:
            return
        by_pool: dict[str, list[str]] = {}
        now = time.time()
        for work_id, (pool_name, until) in list(self.watch.items()):
            if now > until:
                del self.watch[work_id]
            else:
                by_pool.setdefault(pool_name, []).append(work_id)
        for pool_name, ids in by_pool.items():
            try:
                statuses = ca.POOLS[pool_name].status_batch(ids)
            except Exception as exc:
                self.error("status", exc)
                continue
            for work_id, status in zip(ids, statuses, strict=True):
                if status.state == "running":
                    del self.watch[work_id]
                    self.cancel(pool_name, work_id)
                elif status.state == "finished":
                    del self.watch[work_id]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--items", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    enqueuer = Enqueuer(opts.seed, opts.items, opts.seconds)
    try:
        enqueuer.run()
    except Exception as exc:
        enqueuer.error("enqueuer", exc)
    with open(opts.out, "w") as out:
        json.dump(
            {
                "enqueued": enqueuer.enqueued,
                "batches": enqueuer.batches,
                "latency_max": enqueuer.latency_max,
                "errors": enqueuer.errors,
                "cancels": enqueuer.cancels,
            },
            out,
        )
    ca.app.close()


if __name__ == "__main__":
    main()
