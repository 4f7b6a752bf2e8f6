"""workpool alone on workloads beyond the issue's: the paths a user meets that
the side-by-side benchmark does not time (queries, mutations, async actions,
failures, many pools, a 200k batch, status and cancel of it, a drain of 500k,
scheduled work, producers on threads, in asyncio and in processes, producer
processes beside draining workers, CPU-bound actions on two workers that share
a pool's limit, a burst of them on two idle workers, and CPU-bound actions under
`workpool worker --processes`).

    bench/.venv/bin/python bench/further.py [--store sqlite|postgresql] [--only a,b]

Each workload gets a fresh store (a new SQLite file; PostgreSQL: the database
`bench_further`, dropped and created again) and runs its worker in this process
(`run_worker(until_idle=True)`, concurrency 400), so rates are of one process, not
comparable with bench/run.py's two worker processes; `processes`, `mixed`,
`shares`, `burst` and `cpu` spawn producer or worker processes of their own. It prints
one line per number; nothing is checked against a target.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

import workpool

PG_ADMIN = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
DB = "bench_further"


def fresh_url(store: str) -> str:
    if store == "sqlite":
        return f"sqlite:///{tempfile.mkdtemp(prefix='wp-further-')}/workpool.db"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB}")
    return PG_ADMIN.rsplit("/", 1)[0] + f"/{DB}"


def build(store: str) -> Any:
    return build_at(fresh_url(store))


def build_at(url: str) -> Any:
    logger = logging.getLogger("workpool")
    if not logger.handlers:  # in spawned processes too: only the numbers are printed
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    app = workpool.App(url)

    @app.action(name="noop")
    def noop(i: int) -> None:
        pass

    @app.action(name="anoop")
    async def anoop(i: int) -> None:
        pass

    @app.action(name="fail")
    def fail(i: int) -> None:
        raise RuntimeError("planned")

    @app.mutation(name="mutation")
    def mutation(tx: Any, i: int) -> int:
        return i

    @app.query(name="query")
    def query(tx: Any, i: int) -> int:
        return i

    @app.action(name="burn")
    def burn(ms: float) -> int:
        until = time.thread_time() + ms / 1000.0
        while time.thread_time() < until:
            pass
        return os.getpid()

    return app


def drain(app: Any) -> float:
    started = time.perf_counter()
    app.run_worker(concurrency=400, until_idle=True)
    return time.perf_counter() - started


def report(store: str, what: str, value: str) -> None:
    print(f"{store:10s} {what:55s} {value}", flush=True)


def enqueue_and_drain(
    label: str, enqueue: str, fn: str, n: int = 10_000, **kw: Any
) -> Callable[[str], None]:
    def workload(store: str) -> None:
        app = build(store)
        pool = app.pool("p", max_parallelism=100_000)
        getattr(pool, enqueue)(fn, [{"i": i} for i in range(n)], **kw)
        report(store, f"drain {n:,} {label}: jobs/s", f"{n / drain(app):,.0f}")
        app.close()

    return workload


def many_pools(store: str) -> None:
    app = build(store)
    pools = [app.pool(f"p{k}", max_parallelism=10) for k in range(50)]
    for pool in pools:
        pool.enqueue_action_batch("noop", [{"i": i} for i in range(200)])
    report(store, "drain 50 pools x 200 (limit 10 each) jobs/s", f"{10_000 / drain(app):,.0f}")
    app.close()


def big_batch(store: str) -> None:
    app = build(store)
    pool = app.pool("p", max_parallelism=100_000)
    n = 200_000
    started = time.perf_counter()
    ids = pool.enqueue_action_batch("noop", [{"i": i} for i in range(n)])
    report(
        store, f"one enqueue batch of {n:,}: jobs/s", f"{n / (time.perf_counter() - started):,.0f}"
    )
    started = time.perf_counter()
    pool.stats()
    report(
        store, f"stats() with {n:,} pending: ms", f"{(time.perf_counter() - started) * 1e3:,.0f}"
    )
    started = time.perf_counter()
    pool.status_batch(ids[:20_000])
    report(store, "status_batch of 20,000: ms", f"{(time.perf_counter() - started) * 1e3:,.0f}")
    started = time.perf_counter()
    canceled = pool.cancel_all()
    report(store, f"cancel_all of {canceled:,}: s", f"{time.perf_counter() - started:.2f}")
    app.close()


def long_drain(store: str) -> None:
    """Half a million jobs: whether the rate holds up as the backlog is worked off
    (on PostgreSQL every job leaves dead rows that claims walk until a VACUUM)."""
    app = build(store)
    n, part = 500_000, 100_000
    done = itertools.count(1)
    marks: list[float] = []

    @app.action(name="counted")
    def counted(i: int) -> None:
        if next(done) % part == 0:
            marks.append(time.perf_counter())

    pool = app.pool("p", max_parallelism=100_000)
    for start in range(0, n, 10_000):
        pool.enqueue_action_batch(counted, [{"i": i} for i in range(start, start + 10_000)])
    started = time.perf_counter()
    seconds = drain(app)
    rates = [part / (b - a) for a, b in zip([started, *marks], marks, strict=False)]
    report(store, f"drain {n:,} no-op actions: jobs/s", f"{n / seconds:,.0f}")
    report(
        store,
        f"  each {part:,} of them, first to last: jobs/s",
        ", ".join(f"{r:,.0f}" for r in rates),
    )
    app.close()


def scheduled(store: str) -> None:
    app = build(store)
    pool = app.pool("p", max_parallelism=100_000)
    now = time.time()
    for k in range(20):
        pool.enqueue_action_batch("noop", [{"i": i} for i in range(250)], run_at=now + 0.5 + k / 10)
    drain(app)
    stats = pool.stats()
    report(
        store,
        "5,000 scheduled over 2 s: lag p50/p99 (buckets)/max ms",
        f"{stats.start_lag_p50 * 1e3:.1f} / {stats.start_lag_p99 * 1e3:.1f}"
        f" / {stats.start_lag_max * 1e3:.1f}",
    )
    app.close()


def threads(store: str) -> None:
    app = build(store)
    pool = app.pool("p", max_parallelism=100_000)
    pool.enqueue_action("noop", {"i": 0})  # connect first
    for count in (1, 4, 16):
        calls = 4000 // count

        def produce(calls: int = calls) -> None:
            for i in range(calls):
                pool.enqueue_action("noop", {"i": i})

        workers = [threading.Thread(target=produce) for _ in range(count)]
        started = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        rate = count * calls / (time.perf_counter() - started)
        report(store, f"single enqueues from {count} thread(s): calls/s", f"{rate:,.0f}")
    app.close()


def _produce_in_process(url: str, calls: int, ready: Any, go: Any, took: Any) -> None:
    app = build_at(url)
    pool = app.pool("p")
    pool.enqueue_action("noop", {"i": 0})  # connect first
    ready.release()
    go.wait()
    started = time.perf_counter()
    for i in range(calls):
        pool.enqueue_action("noop", {"i": i})
    took.put((started, time.perf_counter()))
    app.close()


def processes(store: str) -> None:
    app = build(store)
    app.pool("p", max_parallelism=100_000)
    url = app.url
    app.close()
    spawn = multiprocessing.get_context("spawn")
    for count in (1, 4, 16):
        calls = 8000 // count
        ready, go, took = spawn.Semaphore(0), spawn.Event(), spawn.Queue()
        args = (url, calls, ready, go, took)
        children = [spawn.Process(target=_produce_in_process, args=args) for _ in range(count)]
        for child in children:
            child.start()
        for _ in children:
            ready.acquire()
        go.set()
        spans = [took.get() for _ in children]
        for child in children:
            child.join()
        rate = count * calls / (max(e for _, e in spans) - min(s for s, _ in spans))
        report(store, f"single enqueues from {count} process(es): calls/s", f"{rate:,.0f}")


def _work_in_process(url: str, stop: Any, concurrency: int = 100) -> None:
    app = build_at(url)
    threading.Thread(target=lambda: (stop.wait(), app.stop_workers()), daemon=True).start()
    app.run_worker(concurrency=concurrency)
    app.close()


def _produce_for(url: str, seconds: float, ready: Any, go: Any, took: Any) -> None:
    app = build_at(url)
    pool = app.pool("p")
    pool.enqueue_action("noop", {"i": 0})
    ready.release()
    go.wait()
    calls, until = 0, time.perf_counter() + seconds
    while time.perf_counter() < until:
        pool.enqueue_action("noop", {"i": calls})
        calls += 1
    took.put(calls)
    app.close()


def mixed(store: str) -> None:
    """Producer processes enqueue one item at a time while 2 worker processes drain."""
    spawn = multiprocessing.get_context("spawn")
    for count in (1, 4):
        app = build(store)
        pool = app.pool("p", max_parallelism=100_000)
        pool.enqueue_action("noop", {"i": 0})  # writes the limit before anyone reads it
        stop = spawn.Event()
        workers = [spawn.Process(target=_work_in_process, args=(app.url, stop)) for _ in range(2)]
        for worker in workers:
            worker.start()
        ready, go, took = spawn.Semaphore(0), spawn.Event(), spawn.Queue()
        args = (app.url, 5.0, ready, go, took)
        children = [spawn.Process(target=_produce_for, args=args) for _ in range(count)]
        for child in children:
            child.start()
        for _ in children:
            ready.acquire()
        time.sleep(1.0)  # the workers are up and idle
        go.set()
        calls = sum(took.get() for _ in children)
        for child in children:
            child.join()
        while (stats := pool.stats()).backlog or stats.running:
            time.sleep(0.05)
        stop.set()
        for worker in workers:
            worker.join(30)
        lags = f"{stats.start_lag_p50 * 1e3:.0f} / {stats.start_lag_p99 * 1e3:.0f}"
        report(
            store,
            f"{count} producer process(es) + 2 workers: enqueues/s, lag p50/p99 ms",
            f"{calls / 5.0:,.0f}, {lags}",
        )
        app.close()


def _on_two_workers(
    store: str, limit: int, concurrency: int, jobs: int, ms: float
) -> tuple[float, list[int]]:
    """``jobs`` CPU-bound actions of ``ms`` enqueued in one batch to 2 idle worker
    processes of ``concurrency`` slots, in a pool of ``limit``: seconds from the
    enqueue until none is left, and how many jobs each process ran."""
    app = build(store)
    pool = app.pool("p", max_parallelism=limit)
    pool.stats()  # writes the limit before the workers read it
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    workers = [
        spawn.Process(target=_work_in_process, args=(app.url, stop, concurrency)) for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    time.sleep(2.0)  # both are up, and each has read that the other serves the pool
    started = time.perf_counter()
    ids = pool.enqueue_action_batch("burn", [{"ms": ms}] * jobs)
    while (stats := pool.stats()).backlog or stats.running:
        time.sleep(0.01)
    took = time.perf_counter() - started
    stop.set()
    for worker in workers:
        worker.join(30)
    ran = collections.Counter(status.result.return_value for status in pool.status_batch(ids))
    app.close()
    return took, sorted(ran.values())


def shares(store: str) -> None:
    """160 CPU-bound actions of 20 ms, a pool of limit 4, 2 worker processes of 4
    slots: how long, and how many each process ran. Until round 38 the first worker
    to claim kept all 4 slots (its records refilled them), so the pool ran on one
    process's GIL: one core (3.2 s) where two would take 1.6."""
    took, ran = _on_two_workers(store, limit=4, concurrency=4, jobs=160, ms=20.0)
    report(
        store,
        "160 CPU-bound actions of 20 ms, limit 4, 2 workers of 4 slots: s, jobs per worker",
        f"{took:.2f}, {ran}",
    )


def burst(store: str) -> None:
    """A burst of 300 CPU-bound actions of 2 ms, no limit, to 2 idle worker processes
    of 400 slots: how long, and how many each process ran. A claim may take all
    300; one worker that did ran them on its own GIL, one core (0.6 s) where two
    would take 0.3 (round 49: a claim of a burst takes its worker's share, on
    SQLite too)."""
    took, ran = _on_two_workers(store, limit=100_000, concurrency=400, jobs=300, ms=2.0)
    report(
        store,
        "a burst of 300 CPU-bound actions of 2 ms, 2 workers of 400 slots: s, jobs per worker",
        f"{took:.2f}, {ran}",
    )


CPU_APP = """
import os, sys
sys.path.insert(0, {bench!r})
from further import build_at
app = build_at(os.environ["FURTHER_URL"])
"""


def cpu(store: str) -> None:
    """200 CPU-bound actions of 20 ms drained by one command, `workpool worker
    --until-idle --concurrency 4`, with 1 and 2 processes (`--processes`, round 39):
    seconds from the command's start to its exit, start-up included, and how many
    jobs each process ran. One core's work is 4 s."""
    directory = tempfile.mkdtemp(prefix="wp-further-cpu-")
    with open(os.path.join(directory, "cpu_app.py"), "w") as module:
        module.write(CPU_APP.format(bench=os.path.dirname(os.path.abspath(__file__))))
    for processes in (1, 2):
        app = build(store)
        pool = app.pool("p", max_parallelism=100_000)
        ids = pool.enqueue_action_batch("burn", [{"ms": 20.0}] * 200)
        command = ["worker", "cpu_app:app", "--until-idle", "--concurrency", "4"]
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "workpool", *command, "--processes", str(processes)],
            cwd=directory,
            env={**os.environ, "FURTHER_URL": app.url},
            stderr=subprocess.DEVNULL,
            check=True,
        )
        took = time.perf_counter() - started
        ran = collections.Counter(status.result.return_value for status in pool.status_batch(ids))
        report(
            store,
            f"200 CPU-bound actions of 20 ms, --processes {processes}: s, jobs per process",
            f"{took:.2f}, {sorted(ran.values())}",
        )
        app.close()


def async_producers(store: str) -> None:
    app = build(store)
    pool = app.pool("p", max_parallelism=100_000)
    pool.enqueue_action("noop", {"i": 0})

    async def main(tasks: int) -> float:
        async def produce() -> None:
            for i in range(4000 // tasks):
                await pool.enqueue_action_async("noop", {"i": i})

        started = time.perf_counter()
        await asyncio.gather(*(produce() for _ in range(tasks)))
        return 4000 / (time.perf_counter() - started)

    for tasks in (1, 8):
        report(
            store,
            f"enqueue_action_async from {tasks} task(s): calls/s",
            f"{asyncio.run(main(tasks)):,.0f}",
        )
    app.close()


WORKLOADS: dict[str, Callable[[str], None]] = {
    "actions": enqueue_and_drain("no-op actions", "enqueue_action_batch", "noop"),
    "async": enqueue_and_drain("async no-op actions", "enqueue_action_batch", "anoop"),
    "mutations": enqueue_and_drain("mutations", "enqueue_mutation_batch", "mutation"),
    "queries": enqueue_and_drain("queries", "enqueue_query_batch", "query"),
    "failures": enqueue_and_drain("failing actions", "enqueue_action_batch", "fail"),
    "retries": enqueue_and_drain(
        "actions failing 3 tries (10 ms backoff)",
        "enqueue_action_batch",
        "fail",
        1000,
        retry=workpool.RetryBehavior(3, 0.01, 2.0),
    ),
    "pools": many_pools,
    "big-batch": big_batch,
    "long-drain": long_drain,
    "scheduled": scheduled,
    "threads": threads,
    "async-producers": async_producers,
    "processes": processes,
    "mixed": mixed,
    "shares": shares,
    "burst": burst,
    "cpu": cpu,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["sqlite", "postgresql"], action="append")
    parser.add_argument("--only", help="comma-separated: " + ", ".join(WORKLOADS))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    for store in args.store or ["sqlite", "postgresql"]:
        for name in names:
            WORKLOADS[name](store)
    if "postgresql" in (args.store or ["postgresql"]):
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")


if __name__ == "__main__":
    main()
