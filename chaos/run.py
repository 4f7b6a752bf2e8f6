"""The chaos run: worker processes killed at random, server faults, then a proof.

    python -m chaos.run --store sqlite --seconds 240
    python -m chaos.run --store postgres --seconds 240 --restart-server

Timeline: the orchestrator creates a fresh store (a SQLite file, or a fresh
PostgreSQL schema ``chaos_<random>`` that is dropped afterwards), starts
``--workers`` real ``workpool worker chaos.chaos_app:app --lease 2`` processes
and ``--enqueuers`` enqueuer processes (chaos/enqueue.py), then for ``--seconds``
SIGKILLs one random worker every ~``--kill-every`` seconds and starts a new one
at once; on PostgreSQL it also cuts every connection of the run
(``pg_terminate_backend``) every ~``--cut-every`` seconds and, with
``--restart-server``, restarts the server twice. Enqueuing stops at 75 % of the
wall time. Then: SIGTERM to every worker, a final ``workpool worker
--until-idle`` drains what is left (with a timeout), and chaos/check.py proves
the guarantees from the database and from the records the work wrote. Exit
status 0 only when no check failed.

Everything the run leaves (SQLite file, records, worker logs, run.json,
report.json) stays in ``--out`` (default: a new directory under /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
LEASE = 2.0
APP_SPEC = "chaos.chaos_app:app"


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


def with_params(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    for key, value in params.items():
        query.setdefault(key, value)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))


def admin_conninfo(url: str) -> str:
    """The URL without workpool's own parameters, for plain psycopg connections."""
    parts = urlsplit(url)
    query = [
        (k, v)
        for k, v in parse_qsl(parts.query)
        if k not in ("schema", "pool_size", "application_name")
    ]
    query.append(("application_name", "workpool-chaos-admin"))
    return urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(query), ""))


class Proc:
    """One child process and what the orchestrator knows of it."""

    def __init__(self, role: str, n: int, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.role = role
        self.n = n
        self.popen = popen
        self.pid = popen.pid
        self.log_path = log_path
        self.started = time.time()
        self.killed_at: float | None = None
        self.ended_at: float | None = None
        self.returncode: int | None = None
        self.note = ""
        self.pool: str | None = None  # the one pool it serves, if not all

    def poll(self) -> bool:
        """True once the process has exited (and was reaped)."""
        if self.returncode is None:
            code = self.popen.poll()
            if code is None:
                return False
            self.returncode = code
            self.ended_at = time.time()
        return True

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "n": self.n,
            "pid": self.pid,
            "log": self.log_path.name,
            "started": self.started,
            "killed_at": self.killed_at,
            "ended_at": self.ended_at,
            "returncode": self.returncode,
            "note": self.note,
            "pool": self.pool,
        }


class Chaos:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.out = Path(opts.out or tempfile.mkdtemp(prefix=f"workpool-chaos-{opts.store}-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.records = self.out / "records"
        self.logs = self.out / "logs"
        self.records.mkdir(exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.run_id = uuid.uuid4().hex[:10]
        self.created_schema: str | None = None
        self.url = self._url()
        self.app_name = dict(parse_qsl(urlsplit(self.url).query)).get("application_name")
        self.env = {
            **os.environ,
            "WORKPOOL_DATABASE_URL": self.url,
            "CHAOS_RECORDS": str(self.records),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: list[Proc] = []
        self.counter = 0
        self.faults: list[dict[str, Any]] = []
        self.anomalies: list[str] = []

    # --- setup ------------------------------------------------------------------------------
    def _url(self) -> str:
        opts = self.opts
        if opts.store == "sqlite":
            url = opts.url or f"sqlite:///{self.out / 'chaos.db'}"
            if not url.startswith("sqlite"):
                raise SystemExit("--store sqlite needs a sqlite:/// URL")
            return url
        url = opts.url or DEFAULT_PG
        if not url.startswith("postgres"):
            raise SystemExit("--store postgres needs a postgresql:// URL")
        if "schema" not in dict(parse_qsl(urlsplit(url).query)):
            self.created_schema = f"chaos_{self.run_id}"
            url = with_params(url, schema=self.created_schema)
        # Our own application_name: the connection cuts hit this run only, never other
        # users of the server (the library sets application_name=workpool by default).
        return with_params(url, application_name=f"workpool_chaos_{self.run_id}")

    def setup(self) -> None:
        os.environ["WORKPOOL_DATABASE_URL"] = self.url
        os.environ["CHAOS_RECORDS"] = str(self.records)
        from chaos import chaos_app as ca

        with ca.app.transaction() as tx:  # migrates the store (and creates the schema) first
            ca.create_tables(tx)
        for pool in ca.POOLS.values():
            pool.configure()  # the pools' options are stored before any worker starts
        ca.app.close()

    def drop_schema(self) -> None:
        if self.created_schema is None or self.opts.keep:
            return
        import psycopg

        for _ in range(30):
            try:
                with psycopg.connect(
                    admin_conninfo(self.url), connect_timeout=5, autocommit=True
                ) as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{self.created_schema}" CASCADE')
                return
            except Exception as exc:
                last = exc
                time.sleep(1.0)
        log(f"could not drop schema {self.created_schema}: {last}")

    # --- processes --------------------------------------------------------------------------
    def spawn(self, role: str, argv: list[str]) -> Proc:
        n = self.counter
        self.counter += 1
        log_path = self.logs / f"{role}-{n:03d}.log"
        with open(log_path, "wb") as out:
            popen = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc = Proc(role, n, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_worker(self, *extra: str, pool: str | None = None) -> Proc:
        """A worker process; ``pool``: serve only that pool (--split-pools)."""
        argv = [sys.executable, "-m", "workpool", "worker", APP_SPEC, "--lease", str(LEASE)]
        argv += ["--concurrency", str(self.opts.concurrency), "--shutdown-grace", "10", *extra]
        if pool is not None:
            argv += ["--pool", pool]
        proc = self.spawn("drain" if "--until-idle" in extra else "worker", argv)
        proc.pool = pool
        return proc

    def live_workers(self) -> list[Proc]:
        return [p for p in self.procs if p.role == "worker" and not p.poll()]

    def wait_started(self, proc: Proc, timeout: float = 20.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and not proc.poll():
            if b'"worker_started"' in proc.log_path.read_bytes():
                return
            time.sleep(0.05)

    def kill(self, proc: Proc) -> None:
        proc.killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.popen.wait()
        proc.poll()

    # --- faults -----------------------------------------------------------------------------
    def cut_connections(self) -> None:
        import psycopg

        began = time.time()
        try:
            with psycopg.connect(
                admin_conninfo(self.url), connect_timeout=5, autocommit=True
            ) as conn:
                rows = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = %s",
                    (self.app_name,),
                ).fetchall()
            self.faults.append({"kind": "cut", "t": began, "connections": len(rows)})
        except Exception as exc:
            self.faults.append({"kind": "cut", "t": began, "error": str(exc)[:200]})

    def restart_server(self) -> None:
        versions = sorted(
            (d for d in os.listdir("/etc/postgresql") if d.replace(".", "").isdigit()),
            key=lambda v: float(v),
        )
        if not versions:
            raise SystemExit("--restart-server: no cluster under /etc/postgresql")
        version = versions[-1]
        began = time.time()
        done = subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        ended = time.time()
        self.faults.append(
            {
                "kind": "restart",
                "t": began,
                "seconds": round(ended - began, 3),
                "returncode": done.returncode,
                "output": (done.stdout + done.stderr)[-500:],
            }
        )
        log(f"server restarted in {ended - began:.1f} s (exit {done.returncode})")
        if done.returncode != 0:
            self.anomalies.append(f"pg_ctlcluster restart failed: {done.stderr[-300:]}")

    # --- the run ----------------------------------------------------------------------------
    def run(self) -> int:
        opts = self.opts
        log(f"store {opts.store}: {self.url}")
        log(f"out: {self.out}")
        self.setup()
        t0 = time.time()
        end = t0 + opts.seconds
        enqueue_window = opts.seconds * 0.75
        for k in range(opts.workers):
            # --split-pools: half the workers serve pool mixed, half pool tx.
            self.start_worker(pool=("mixed", "tx")[k % 2] if opts.split_pools else None)
        enqueuers = []
        for k in range(opts.enqueuers):
            enqueuers.append(
                self.spawn(
                    "enqueuer",
                    [
                        sys.executable,
                        "-m",
                        "chaos.enqueue",
                        "--seed",
                        str(opts.seed * 1000 + k),
                        "--items",
                        str(opts.items // opts.enqueuers),
                        "--seconds",
                        str(enqueue_window),
                        "--out",
                        str(self.out / f"enqueuer-{k}.json"),
                    ],
                )
            )
        next_kill = t0 + self._kill_gap()
        cut_every = opts.cut_every if opts.store == "postgres" else 0.0
        next_cut = t0 + cut_every * self.rng.uniform(0.5, 1.5) if cut_every else float("inf")
        restarts = [t0 + opts.seconds * f for f in (0.35, 0.7)] if opts.restart_server else []
        kills = 0
        last_note = t0
        while time.time() < end:
            now = time.time()
            for proc in self.procs:
                if (
                    proc.role == "worker"
                    and proc.poll()
                    and proc.killed_at is None
                    and not proc.note
                ):
                    self.exited_by_itself(proc)
                    self.start_worker(pool=proc.pool)
            if opts.kill_every > 0 and now >= next_kill:
                live = self.live_workers()
                if live:
                    victim = self.rng.choice(live)
                    self.kill(victim)
                    kills += 1
                    self.start_worker(pool=victim.pool)  # its replacement, at once
                next_kill = now + self._kill_gap()
            if now >= next_cut:
                self.cut_connections()
                next_cut = now + cut_every * self.rng.uniform(0.5, 1.5)
            if restarts and now >= restarts[0]:
                restarts.pop(0)
                self.restart_server()
            if now - last_note >= 15:
                last_note = now
                log(f"{now - t0:.0f} s: {kills} kills, {len(self.faults)} server faults")
            time.sleep(0.02)
        log(f"wall time over: {kills} kills, {len(self.faults)} server faults; stopping")

        for proc in enqueuers:
            try:
                proc.popen.wait(timeout=max(60.0, opts.seconds))
            except subprocess.TimeoutExpired:
                self.anomalies.append(f"enqueuer pid {proc.pid} did not finish; killed")
                proc.popen.kill()
                proc.popen.wait()
            proc.poll()
            if proc.returncode != 0:
                self.anomalies.append(
                    f"enqueuer pid {proc.pid} exited with {proc.returncode}"
                    f" (log {proc.log_path.name})"
                )
        stopped_at = time.time()
        for proc in self.live_workers():
            self.wait_started(proc)  # SIGTERM before its handler is installed kills it
            proc.popen.send_signal(signal.SIGTERM)
        for proc in [p for p in self.procs if p.role == "worker"]:
            try:
                proc.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.anomalies.append(f"worker pid {proc.pid} ignored SIGTERM for 30 s; killed")
                self.kill(proc)
            proc.poll()
            if proc.killed_at is None and proc.returncode != 0 and not proc.note:
                self.anomalies.append(
                    f"worker pid {proc.pid} exited with {proc.returncode} after SIGTERM"
                    f" (log {proc.log_path.name})"
                )
        log(f"workers stopped in {time.time() - stopped_at:.1f} s; draining")

        drain_began = time.time()
        drain = self.start_worker("--until-idle")
        try:
            drain.popen.wait(timeout=opts.drain_timeout)
        except subprocess.TimeoutExpired:
            self.anomalies.append(
                f"the final --until-idle worker did not finish within {opts.drain_timeout} s"
            )
            drain.popen.send_signal(signal.SIGTERM)
            try:
                drain.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill(drain)
        drain.poll()
        if drain.killed_at is None and drain.returncode != 0:
            self.anomalies.append(f"the drain worker exited with {drain.returncode}")
        drain_seconds = time.time() - drain_began
        log(f"drained in {drain_seconds:.1f} s; checking")

        run_info = {
            "store": opts.store,
            "url": self.url,
            "seed": opts.seed,
            "seconds": opts.seconds,
            "workers": opts.workers,
            "enqueuers": opts.enqueuers,
            "concurrency": opts.concurrency,
            "split_pools": opts.split_pools,
            "lease": LEASE,
            "t0": t0,
            "end": end,
            "drain_seconds": drain_seconds,
            "kills": kills,
            "faults": self.faults,
            "anomalies": self.anomalies,
            "procs": [p.to_json() for p in self.procs],
        }
        (self.out / "run.json").write_text(json.dumps(run_info, indent=1))

        from chaos import check

        report = check.check(self.out)
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        check.print_report(report)
        return 1 if report["violations"] else 0

    def exited_by_itself(self, proc: Proc) -> None:
        """A worker died without being killed: fine only if it could not start (exit 1
        with a one-line "unavailable" error) while the server was restarting."""
        text = proc.log_path.read_text(errors="replace")
        restarting = any(
            f["kind"] == "restart"
            and f["t"] - 1 <= (proc.ended_at or 0) <= f["t"] + f["seconds"] + 15
            for f in self.faults
        )
        if (
            restarting
            and proc.returncode == 1
            and "unavailable" in text
            and "Traceback" not in text
        ):
            proc.note = "could not start while the server restarted"
            self.faults.append(
                {"kind": "worker_start_refused", "t": proc.ended_at, "pid": proc.pid}
            )
            return
        proc.note = "exited by itself"
        self.anomalies.append(
            f"worker pid {proc.pid} exited by itself with {proc.returncode}"
            f" (log {proc.log_path.name}): {text.strip().splitlines()[-1:] if text.strip() else ''}"
        )

    def _kill_gap(self) -> float:
        return float(self.opts.kill_every) * self.rng.uniform(0.5, 1.5)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m chaos.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--store", choices=["sqlite", "postgres"], required=True)
    parser.add_argument("--url", help="store URL (default: a new SQLite file / a new PG schema)")
    parser.add_argument("--seconds", type=float, default=240.0, help="wall time of the chaos")
    parser.add_argument("--workers", type=int, default=4, help="worker processes at any time")
    parser.add_argument("--concurrency", type=int, default=8, help="--concurrency of each worker")
    parser.add_argument("--enqueuers", type=int, default=3, help="enqueuer processes")
    parser.add_argument(
        "--items",
        type=int,
        default=None,
        help="items the enqueuers enqueue (default: 60 a second of the enqueueing window)",
    )
    parser.add_argument(
        "--kill-every", type=float, default=2.0, help="mean seconds between SIGKILLs (0: none)"
    )
    parser.add_argument(
        "--cut-every",
        type=float,
        default=5.0,
        help="PostgreSQL: mean seconds between connection cuts (0: none)",
    )
    parser.add_argument(
        "--restart-server",
        action="store_true",
        help="PostgreSQL: restart the server (pg_ctlcluster) at 35 %% and 70 %% of the run",
    )
    parser.add_argument(
        "--split-pools",
        action="store_true",
        help="each worker serves one pool (alternately mixed, tx) instead of both",
    )
    parser.add_argument("--drain-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", help="directory for the run's files (default: new under /tmp)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the PostgreSQL schema the run created"
    )
    opts = parser.parse_args(argv)
    if opts.items is None:
        opts.items = int(60 * 0.75 * opts.seconds)
    if opts.seed is None:
        opts.seed = random.randrange(10**6)
    if opts.restart_server and opts.store != "postgres":
        parser.error("--restart-server needs --store postgres")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    chaos = Chaos(opts)
    log(f"seed {opts.seed}")
    try:
        return chaos.run()
    finally:
        for proc in chaos.procs:
            if not proc.poll():
                proc.popen.kill()
                proc.popen.wait()
        chaos.drop_schema()


if __name__ == "__main__":
    sys.exit(main())
