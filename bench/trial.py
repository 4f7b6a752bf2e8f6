"""One trial: one system, one workload, one repetition, in its own process.

`python bench/trial.py SPEC_JSON` prints progress on stderr and, last, one line
`RESULT {json}` on stdout. The orchestrator (run.py) starts one process per trial so
that no system's global state (DBOS's singleton, cached settings, open pools)
leaks into the next one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from common import (
    Rec,
    RecordReader,
    WorkerProcs,
    max_overlap,
    percentile,
    pg_server_cpu_seconds,
    settle,
    start_workers,
    tree_cpu_seconds,
    verify_once,
)
from systems import system_class
from systems.base import System

POLL_S = 0.005  # record polling while work is running (cheap: new bytes only)
FINAL_POLL_S = 0.002  # store polling once every job has reported


def log(msg: str) -> None:
    print(f"[trial] {msg}", file=sys.stderr, flush=True)


class Ctx:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.params: dict[str, Any] = spec["params"]
        self.record_dir: str = spec["record_dir"]
        self.tmp_dir: str = spec["tmp_dir"]
        self.reader = RecordReader(self.record_dir)
        self.workers: WorkerProcs | None = None
        self.timeout: float = float(spec.get("timeout", 300))

    def start(self, system: System, n: int | None = None) -> WorkerProcs:
        procs, cfg = system.worker_plan()
        if n is not None:
            procs = n
        cfg = dict(cfg, record_dir=self.record_dir)
        self.workers = start_workers(system.name, procs, cfg, self.tmp_dir)
        self.worker_count = procs
        return self.workers

    def wait_ok(self, n_ok: int, t0: float, distinct: bool = False) -> float | None:
        """Poll records until ``n_ok`` successes; the perf_counter time then (None: timeout)."""
        assert self.workers is not None
        while True:
            self.reader.poll()
            count = (
                len({r.i for r in self.reader.records if r.ok})
                if distinct
                else self.reader.ok_count
            )
            if count >= n_ok:
                return time.perf_counter()
            if time.perf_counter() - t0 > self.timeout:
                return None
            self.workers.check()
            time.sleep(POLL_S)

    def wait_drained(self, system: System, n_ok: int, t0: float) -> float | None:
        """Every job reported success and the store holds none queued or running."""
        if self.wait_ok(n_ok, t0) is None:
            return None
        while system.unfinished() > 0:
            if time.perf_counter() - t0 > self.timeout:
                return None
            time.sleep(FINAL_POLL_S)
        return time.perf_counter()


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[k : k + size] for k in range(0, len(items), size)]


def enqueue_all(system: System, task: str, args: list[dict[str, Any]], batch: int) -> float:
    t = time.perf_counter()
    for part in chunks(args, batch):
        system.enqueue_batch(task, part)
    return time.perf_counter() - t


# --- workloads --------------------------------------------------------------------------------
def w_drain(system: System, ctx: Ctx) -> dict[str, Any]:
    n, batch = int(ctx.params["n"]), int(ctx.params["batch"])
    size = int(ctx.params.get("pad", 0))
    # Random hex: a run of one letter would compress to nothing in PostgreSQL's TOAST.
    pad = random.Random(0).randbytes(size).hex()[:size]
    args = [{"i": i, "pad": pad} if pad else {"i": i} for i in range(n)]
    enqueue_s = enqueue_all(system, "noop", args, batch)
    log(f"enqueued {n} in {enqueue_s:.2f}s")
    workers = ctx.start(system)
    w0, s0 = tree_cpu_seconds(workers.pids()), pg_server_cpu_seconds()
    t0 = time.perf_counter()
    workers.go()
    t1 = ctx.wait_drained(system, n, t0)
    w1, s1 = tree_cpu_seconds(workers.pids()), pg_server_cpu_seconds()
    ctx.reader.poll()
    check = verify_once(ctx.reader.records, n)
    out: dict[str, Any] = {
        "enqueue_rate": n / enqueue_s,
        "workers": ctx.worker_count,
        **check,
        **system.extra_verify(),
    }
    if t1 is None:
        out["error"] = f"timeout after {ctx.timeout:.0f}s ({check['distinct']}/{n} done)"
        return out
    out["drain_s"] = t1 - t0
    out["drain_rate"] = n / (t1 - t0)
    # Where a drain's time goes on a machine that the workers and the server share: CPU per job.
    out["worker_us_per_job"] = 1e6 * (w1 - w0) / n
    if s0 is not None and s1 is not None and system.store == "postgresql":
        out["server_us_per_job"] = 1e6 * (s1 - s0) / n
    if system.spec.get("on_complete"):
        rows, distinct = out.get("on_complete_rows"), out.get("on_complete_distinct")
        out["exactly_once"] = bool(out["exactly_once"] and rows == n and distinct == n)
    if not out["exactly_once"]:
        out["error"] = f"not exactly once: {check}"
    return out


def w_latency(system: System, ctx: Ctx) -> dict[str, Any]:
    rate, seconds = float(ctx.params["rate"]), float(ctx.params["seconds"])
    n = int(rate * seconds)
    workers = ctx.start(system, 1)
    workers.go()
    time.sleep(1.0)  # let the worker reach its idle wait
    system.enqueue_one("noop", {"i": -1})  # warm the client connection
    time.sleep(0.5)
    enq_at: dict[int, float] = {}
    call_s: list[float] = []
    start = time.perf_counter()
    for k in range(n):
        target = start + k / rate
        delay = target - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = time.time()
        c = time.perf_counter()
        system.enqueue_one("noop", {"i": k})
        call_s.append(time.perf_counter() - c)
        enq_at[k] = t
    t0 = time.perf_counter()
    done = ctx.wait_ok(n + 1, t0)  # + the warm-up job
    ctx.reader.poll()
    lat = [(r.t0 - enq_at[r.i]) * 1000 for r in ctx.reader.records if r.ok and r.i >= 0]
    check = verify_once([r for r in ctx.reader.records if r.i >= 0], n)
    out: dict[str, Any] = {
        "p50_ms": percentile(lat, 50),
        "p95_ms": percentile(lat, 95),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else None,
        "enqueue_call_p50_ms": percentile(call_s, 50) * 1000,
        "achieved_rate": n / (t0 - start),
        **check,
    }
    if done is None:
        out["error"] = f"timeout ({check['distinct']}/{n} started)"
    return out


def w_idle(system: System, ctx: Ctx) -> dict[str, Any]:
    """One worker in its latency configuration with nothing to do: what it costs at
    rest, in CPU of its own processes and (PostgreSQL, local server) of the server's."""
    seconds, warm_s = float(ctx.params["seconds"]), float(ctx.params["settle"])
    workers = ctx.start(system, 1)
    workers.go()
    time.sleep(warm_s)  # past start-up: connecting, migrating, first reads
    server = system.store == "postgresql"
    w0, s0, t0 = tree_cpu_seconds(workers.pids()), pg_server_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    w1, s1, t1 = tree_cpu_seconds(workers.pids()), pg_server_cpu_seconds(), time.perf_counter()
    workers.check()
    out: dict[str, Any] = {"worker_cpu_pct": 100.0 * (w1 - w0) / (t1 - t0)}
    if server and s0 is not None and s1 is not None:
        out["server_cpu_pct"] = 100.0 * (s1 - s0) / (t1 - t0)
    return out


def slot_use(ok: list[Rec], limit: int, wall0: float, wall1: float) -> dict[str, float]:
    """Where the limit workload's time went, from the jobs' own start and end times:
    the wait for the first start after the go, the mean job (its sleep and the
    record), the mean idle time of a slot between one job's end and the next one's
    start, and the time from the last end until the drain was seen. Together they
    make up the run: the share of the ideal throughput is what they leave."""
    if not ok:
        return {}
    first, last = min(r.t0 for r in ok), max(r.t1 for r in ok)
    busy = sum(r.t1 - r.t0 for r in ok)
    return {
        "first_start_ms": (first - wall0) * 1e3,
        "job_ms": busy / len(ok) * 1e3,
        "gap_ms": (limit * (last - first) - busy) / max(len(ok) - limit, 1) * 1e3,
        "tail_ms": (wall1 - last) * 1e3,
    }


def w_limit(system: System, ctx: Ctx) -> dict[str, Any]:
    n, limit, ms = int(ctx.params["n"]), int(ctx.params["limit"]), float(ctx.params["ms"])
    enqueue_all(system, "sleep", [{"i": i, "ms": ms} for i in range(n)], 400)
    workers = ctx.start(system)
    wall0 = time.time()
    t0 = time.perf_counter()
    workers.go()
    t1 = ctx.wait_drained(system, n, t0)
    wall1 = time.time()
    ctx.reader.poll()
    check = verify_once(ctx.reader.records, n)
    ideal = limit * 1000.0 / ms
    ok = [r for r in ctx.reader.records if r.ok]
    out: dict[str, Any] = {
        "max_concurrency": max_overlap(ok),
        "limit": limit,
        "ideal_rate": ideal,
        "workers": ctx.worker_count,
        **check,
        **slot_use(ok, limit, wall0, wall1),
    }
    if t1 is None:
        out["error"] = "timeout"
        return out
    out["rate"] = n / (t1 - t0)
    out["share_of_ideal"] = out["rate"] / ideal
    if out["max_concurrency"] > limit:
        out["error"] = f"limit exceeded: {out['max_concurrency']} > {limit}"
    return out


def w_retries(system: System, ctx: Ctx) -> dict[str, Any]:
    n, batch = int(ctx.params["n"]), int(ctx.params["batch"])
    attempts = int(system.spec["retry"]["max_attempts"])
    enqueue_all(system, "flaky", [{"i": i} for i in range(n)], batch)
    workers = ctx.start(system)
    t0 = time.perf_counter()
    workers.go()
    t1 = ctx.wait_drained(system, n, t0)
    ctx.reader.poll()
    check = verify_once(ctx.reader.records, n)
    failed = sum(1 for r in ctx.reader.records if not r.ok)
    out: dict[str, Any] = {
        **check,
        "failed_attempts": failed,
        "attempts_ok": failed == n * (attempts - 1),
        "workers": ctx.worker_count,
    }
    if t1 is None:
        out["error"] = f"timeout ({check['distinct']}/{n} succeeded)"
        return out
    out["rate"] = n / (t1 - t0)
    if not check["exactly_once"]:
        out["error"] = f"not exactly once: {check}"
    return out


def w_scale(system: System, ctx: Ctx) -> dict[str, Any]:
    pending, k, batch = int(ctx.params["pending"]), int(ctx.params["k"]), int(ctx.params["batch"])
    warm = int(ctx.params.get("warm", 0))
    ids: list[Any] = []
    t = time.perf_counter()
    for start in range(0, pending, batch):
        ids += system.enqueue_batch(
            "noop", [{"i": i} for i in range(start, min(start + batch, pending))]
        )
    fill_s = time.perf_counter() - t
    log(f"filled {pending} in {fill_s:.1f}s")
    # What the fill leaves behind (its checkpoint, autovacuum of the new rows) passes
    # first, as before every trial: what is measured is the cost of a claim and a
    # status at that backlog, not of the fill. Until round 19 it fell inside either,
    # by chance: a PostgreSQL status() at a million rows was 0.30 ms in one run and
    # 0.53 in another.
    settle()
    out: dict[str, Any] = {"pending": pending, "fill_rate": pending / fill_s}
    try:
        out["status_ms"] = system.status_cost(ids) * 1000
    except NotImplementedError:
        out["status_ms"] = None
    workers = ctx.start(system)
    t0 = time.perf_counter()
    workers.go()
    # The rate from the warm-th job to the k-th: the workers' start (threads,
    # connections, first plans) is not the claim cost this compares, and a window
    # of a few hundred milliseconds keeps the 5 ms record polling out of the ratio.
    ta = ctx.wait_ok(warm, t0) if warm else t0
    t1 = ctx.wait_ok(k, t0)
    if ta is None or t1 is None:
        out["error"] = "timeout"
        return out
    out["claim_rate"] = (k - warm) / (t1 - ta)
    return out


def w_big(system: System, ctx: Ctx) -> dict[str, Any]:
    n, size = int(ctx.params["n"]), int(ctx.params["size"])
    blob = "x" * size
    context = "y" * size
    if system.spec.get("on_complete"):
        system.spec["context"] = context  # workpool: context travels to on_complete
        args = [{"i": i, "blob": blob} for i in range(n)]
    else:
        args = [{"i": i, "blob": blob, "ctx": context} for i in range(n)]  # same bytes
    enqueue_s = enqueue_all(system, "big", args, 10)
    workers = ctx.start(system)
    w0, s0 = tree_cpu_seconds(workers.pids()), pg_server_cpu_seconds()
    t0 = time.perf_counter()
    workers.go()
    t1 = ctx.wait_drained(system, n, t0)
    w1, s1 = tree_cpu_seconds(workers.pids()), pg_server_cpu_seconds()
    ctx.reader.poll()
    check = verify_once(ctx.reader.records, n)
    mb = n * 2 * size / 1e6
    out: dict[str, Any] = {"enqueue_rate": n / enqueue_s, "enqueue_mb_s": mb / enqueue_s, **check}
    out.update(system.extra_verify())
    if t1 is None:
        out["error"] = "timeout"
        return out
    out["drain_rate"] = n / (t1 - t0)
    out["drain_mb_s"] = mb / (t1 - t0)
    out["worker_ms_per_job"] = 1e3 * (w1 - w0) / n
    if s0 is not None and s1 is not None and system.store == "postgresql":
        out["server_ms_per_job"] = 1e3 * (s1 - s0) / n
    return out


WORKLOADS: dict[str, Callable[[System, Ctx], dict[str, Any]]] = {
    "drain": w_drain,
    "latency": w_latency,
    "latency_fast": w_latency,
    "limit": w_limit,
    "limit_wide": w_limit,
    "idle": w_idle,
    "retries": w_retries,
    "on_complete": w_drain,
    "scale_small": w_scale,
    "scale_large": w_scale,
    "big": w_big,
}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    name, workload = spec["system"], spec["workload"]
    cls = system_class(name)
    base = spec.get("base_workload", workload)
    if base in cls.na:
        return {"na": cls.na[base]}
    tmp = tempfile.mkdtemp(prefix=f"bench-{name}-{workload}-")
    record_dir = os.path.join(tmp, "records")
    os.makedirs(record_dir)
    spec = dict(spec, tmp_dir=tmp, record_dir=record_dir)
    sys_spec = dict(spec["system_spec"], workload=base, tmp_dir=tmp, record_dir=record_dir)
    system = cls(sys_spec)
    ctx = Ctx(spec)
    try:
        system.setup()
        return WORKLOADS[workload](system, ctx)
    finally:
        if ctx.workers is not None:
            ctx.workers.stop()
        try:
            system.teardown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
