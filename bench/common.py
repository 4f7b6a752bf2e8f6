"""Shared plumbing for the benchmark: databases, records, worker processes, statistics.

Every job of every system reports what it did by appending one line to a
per-process record file (``os.write`` on an O_APPEND descriptor: one syscall,
no database round trip), so "every job ran exactly once" is checked the same
way for every system:

    <job index> <attempt> <ok 1|0> <start unix time> <end unix time>
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
PG_ADMIN_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


# --- PostgreSQL -------------------------------------------------------------------------------
def pg_url(dbname: str) -> str:
    """The admin URL with its database name replaced."""
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{dbname}"


def pg_admin() -> Any:
    import psycopg

    return psycopg.connect(PG_ADMIN_URL, autocommit=True)


def pg_create_db(dbname: str) -> str:
    """A fresh, empty database ``dbname`` (dropped first when it exists); its URL."""
    with pg_admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{dbname}"')
    return pg_url(dbname)


def pg_drop_db(dbname: str) -> None:
    if not dbname:
        return
    try:
        with pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    except Exception as exc:  # cleanup must never hide the result
        print(f"warning: could not drop database {dbname}: {exc}", file=sys.stderr)


def pg_drop_stale() -> list[str]:
    """Drop trial databases left by runs whose trial process is gone (e.g. a server restart
    interrupted their cleanup)."""
    import re

    dropped = []
    with pg_admin() as conn:
        names = [r[0] for r in conn.execute("SELECT datname FROM pg_database").fetchall()]
    for name in names:
        m = re.fullmatch(r"bench_(?:workpool|pgqueuer|procrastinate|dbos|bare)_(\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            pg_drop_db(name)
            dropped.append(name)
    return dropped


def pg_checkpoint() -> None:
    """Write out what earlier trials left dirty in PostgreSQL's buffers, so that a
    checkpoint does not land inside the next trial's timing (best effort)."""
    try:
        with pg_admin() as conn:
            conn.execute("CHECKPOINT")
    except Exception as exc:
        print(f"warning: CHECKPOINT failed: {exc}", file=sys.stderr)


def cpu_busy(seconds: float) -> float | None:
    """The share of all CPUs busy over the next ``seconds`` (None where /proc/stat is
    missing): idle and iowait count as not busy."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)

    try:
        busy0, all0 = sample()
        time.sleep(seconds)
        busy1, all1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / max(all1 - all0, 1)


QUIET_BUSY = 0.15  # a trial starts once the CPUs were this idle for QUIET_WINDOW_S ...
QUIET_WINDOW_S = 0.5
QUIET_MAX_S = 15.0  # ... or after this long: a machine that never quiets still gets measured


def settle(postgres: bool = True) -> tuple[float, float | None]:
    """Let the previous trial's after-effects pass before the next one starts: a
    PostgreSQL checkpoint, then a wait for quiet CPUs. Without it a trial could run
    beside a late checkpoint or the exit of the last trial's processes, and the
    noise lands on whichever system comes next. (seconds waited, last busy share)"""
    t = time.monotonic()
    if postgres:
        pg_checkpoint()
    busy = cpu_busy(QUIET_WINDOW_S)
    while busy is not None and busy > QUIET_BUSY and time.monotonic() - t < QUIET_MAX_S:
        busy = cpu_busy(QUIET_WINDOW_S)
    return time.monotonic() - t, busy


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads, ended ones included (0 once it
    is gone). Read from its CPU-time clock, in nanoseconds, where Linux gives one: in
    /proc it is counted in 10 ms ticks, which measured an idle worker (a few ms a
    second) only to 0.1 % of a core over the idle workload's 10 s."""
    with contextlib.suppress(OSError, OverflowError):
        # The clock id that glibc's clock_getcpuclockid(pid) makes: the pid's
        # complement, shifted, with CPUCLOCK_SCHED (2), the whole process's clock.
        return time.clock_gettime(((~pid) << 3) | 2)
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, command name) of every process (empty without /proc)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
                out.append((int(entry), int(rest.split()[1]), head.split("(", 1)[1]))
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of these processes and all their descendants (Linux /proc)."""
    procs = _processes()
    wanted, frontier = set(pids), list(pids)
    while frontier:
        parent = frontier.pop()
        for pid, ppid, _ in procs:
            if ppid == parent and pid not in wanted:
                wanted.add(pid)
                frontier.append(pid)
    return sum(_cpu_seconds(pid) for pid in wanted)


def pg_server_cpu_seconds() -> float | None:
    """CPU seconds of every local ``postgres`` process (None: no local server seen)."""
    pids = [pid for pid, _, name in _processes() if name == "postgres"]
    return sum(_cpu_seconds(pid) for pid in pids) if pids else None


def pg_available() -> bool:
    try:
        with pg_admin() as conn:
            conn.execute("SELECT 1")
        return True
    except Exception:
        return False


# --- records ----------------------------------------------------------------------------------
_record_fd: int | None = None


def open_record(record_dir: str) -> None:
    """Called once in each worker process: where its jobs append their lines."""
    global _record_fd
    path = os.path.join(record_dir, f"rec-{os.getpid()}.txt")
    _record_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def record(
    i: int, attempt: int = 1, ok: int = 1, t0: float | None = None, t1: float | None = None
) -> None:
    if t0 is None:
        t0 = time.time()
    if t1 is None:
        t1 = t0
    assert _record_fd is not None, "open_record() was not called in this process"
    os.write(_record_fd, b"%d %d %d %.6f %.6f\n" % (i, attempt, ok, t0, t1))


@dataclass
class Rec:
    i: int
    attempt: int
    ok: int
    t0: float
    t1: float


# A record line whose ok field is 1: "i attempt 1 t0 t1".
_OK_LINE = re.compile(rb"^-?\d+ \d+ 1 ", re.MULTILINE)


class RecordReader:
    """Incremental reader of all record files in a directory (cheap to poll).

    A poll counts the successes in what it read (one regular expression over the
    new lines) and keeps the lines; they become ``records`` only when asked. The
    trial polls every 5 ms on the same two cores as the system it measures, and
    parsing each line as it came cost it some 1.6 us a job (33 ms of a 20,000-job
    drain that took 260 ms): a tax on every system, heaviest on the fastest.
    """

    def __init__(self, record_dir: str) -> None:
        self.dir = record_dir
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}
        self._lines: list[bytes] = []  # complete lines read, not yet parsed
        self._records: list[Rec] = []
        self.ok_count = 0

    def poll(self) -> int:
        for name in os.listdir(self.dir):
            if not name.startswith("rec-"):
                continue
            path = os.path.join(self.dir, name)
            offset = self.offsets.get(name, 0)
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            if size <= offset:
                continue
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            self.offsets[name] = offset + len(chunk)
            data = self.partial.pop(name, b"") + chunk
            cut = data.rfind(b"\n") + 1
            if cut < len(data):
                self.partial[name] = data[cut:]
            if cut:
                lines = data[:cut]
                self._lines.append(lines)
                self.ok_count += len(_OK_LINE.findall(lines))
        return self.ok_count

    @property
    def records(self) -> list[Rec]:
        """Every record read so far, parsed."""
        for lines in self._lines:
            for line in lines.split(b"\n"):
                if line:
                    a, b, c, d, e = line.split()
                    self._records.append(Rec(int(a), int(b), int(c), float(d), float(e)))
        self._lines = []
        return self._records


def verify_once(records: list[Rec], n: int) -> dict[str, Any]:
    """Every index 0..n-1 succeeded exactly once: counts, duplicates, missing."""
    ok = [r.i for r in records if r.ok]
    distinct = set(ok)
    missing = n - len(distinct & set(range(n)))
    dupes = len(ok) - len(distinct)
    return {
        "ok_records": len(ok),
        "distinct": len(distinct),
        "duplicates": dupes,
        "missing": missing,
        "exactly_once": dupes == 0 and missing == 0 and len(distinct) == n,
    }


def max_overlap(records: list[Rec]) -> int:
    """The largest number of [t0, t1) intervals open at one instant."""
    events: list[tuple[float, int]] = []
    for r in records:
        events.append((r.t0, 1))
        events.append((r.t1, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at equal times
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def percentile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return s[lo]
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: list[float]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return percentile(vals, 50) if vals else math.nan


# --- worker processes -------------------------------------------------------------------------
@dataclass
class WorkerProcs:
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def go(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(b"GO\n")
            p.stdin.flush()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def check(self) -> None:
        """Raise when a worker died on its own (its log says why)."""
        for p, log in zip(self.procs, self.logs, strict=True):
            if p.poll() is not None and p.returncode not in (0, -signal.SIGTERM, -signal.SIGINT):
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"worker {p.pid} exited with {p.returncode}:\n{tail}")

    def stop(self, grace: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.procs:
            if p.stdin is not None:
                with contextlib.suppress(OSError):
                    p.stdin.close()


def start_workers(
    system: str, n: int, config: dict[str, Any], log_dir: str, ready_timeout: float = 60.0
) -> WorkerProcs:
    """Start ``n`` worker processes of ``system``; return once each printed READY."""
    procs = WorkerProcs()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(BENCH_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    for k in range(n):
        log = Path(log_dir) / f"worker-{system}-{k}-{time.time_ns()}.log"
        cfg = dict(config, worker_index=k)
        errf = open(log, "wb")  # noqa: SIM115 (handed to the child)
        p = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "worker.py"), system, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errf,
            env=env,
            cwd=str(BENCH_DIR),
        )
        errf.close()
        procs.procs.append(p)
        procs.logs.append(log)
    deadline = time.monotonic() + ready_timeout
    for p, log in zip(procs.procs, procs.logs, strict=True):
        assert p.stdout is not None
        line = b""
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line or line.strip() == b"READY":
                break
        if line.strip() != b"READY":
            procs.stop(grace=2)
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"worker of {system} did not become ready:\n{tail}")
    return procs


def wait_for_go() -> None:
    """Worker side: announce readiness, then block until the trial says GO."""
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if line.strip() != "GO":
        sys.exit(0)
