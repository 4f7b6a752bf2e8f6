"""The benchmark orchestrator: every system on the same workloads, one table.

    python bench/run.py [--quick] [--systems a,b] [--workloads x,y] [--repeat N]

Each (repetition, workload, system) is one trial process (bench/trial.py) with a
fresh database or SQLite file; systems are interleaved inside each repetition so
that slow drift of the machine hits all of them alike. Results: a table on
stdout, bench/results/latest.json and bench/results/throughput.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from common import (
    BENCH_DIR,
    QUIET_BUSY,
    pg_available,
    pg_drop_stale,
    settle,
)
from report import build_summary, plot, print_report, versions
from systems import SYSTEMS, system_class

RETRY = {"max_attempts": 3, "backoff": 0.01}

FULL: dict[str, dict[str, Any]] = {
    "drain": {"n": 20_000, "batch": 1_000},
    "latency": {"rate": 100, "seconds": 15},
    "limit": {"n": 400, "limit": 5, "ms": 20},
    "retries": {"n": 1_000, "batch": 1_000, **RETRY},
    "on_complete": {"n": 20_000, "batch": 1_000},
    "scale_small": {"pending": 10_000, "warm": 1_000, "k": 9_000, "batch": 5_000},
    "scale_large": {"pending": 1_000_000, "warm": 1_000, "k": 9_000, "batch": 5_000},
    "big": {"n": 50, "size": 800_000},
    "idle": {"seconds": 10, "settle": 3},
    "limit_wide": {"n": 2_000, "limit": 50, "ms": 20},
    "latency_fast": {"rate": 1_000, "seconds": 5},
}
QUICK: dict[str, dict[str, Any]] = {
    "drain": {"n": 2_000, "batch": 1_000},
    "latency": {"rate": 100, "seconds": 3},
    "limit": {"n": 100, "limit": 5, "ms": 20},
    "retries": {"n": 200, "batch": 200, **RETRY},
    "on_complete": {"n": 2_000, "batch": 1_000},
    "scale_small": {"pending": 10_000, "warm": 200, "k": 2_000, "batch": 5_000},
    "scale_large": {"pending": 100_000, "warm": 200, "k": 2_000, "batch": 5_000},
    "big": {"n": 10, "size": 800_000},
    "idle": {"seconds": 3, "settle": 1},
    "limit_wide": {"n": 500, "limit": 50, "ms": 20},
    "latency_fast": {"rate": 1_000, "seconds": 2},
}
# user-facing workload names -> trial workloads
GROUPS = {
    "drain": ["drain"],
    "latency": ["latency"],
    "limit": ["limit"],
    "retries": ["retries"],
    "on_complete": ["on_complete"],
    "scale": ["scale_small", "scale_large"],
    "big": ["big"],
    "idle": ["idle"],
    # Beyond the workloads, last so as not to move the others in a run: the
    # global limit at 50 rather than 5, and enqueues at 1,000 a second, not 100.
    "limit_wide": ["limit_wide"],
    "latency_fast": ["latency_fast"],
}
# The idle worker runs in its latency configuration: what that latency costs at rest.
BASE = {
    "scale_small": "scale",
    "scale_large": "scale",
    "idle": "latency",
    "limit_wide": "limit",
    "latency_fast": "latency",
}
# Slow workloads run --repeat-scale times (3 by default, as the rest; 1 until round
# 19, when single runs of scale swung by tens of per cent): scale fills a million
# rows, idle waits 13 s per system.
SINGLE = {"scale_small", "scale_large", "idle"}


def system_spec(system: str, workload: str, params: dict[str, Any]) -> dict[str, Any]:
    cls = system_class(system)
    spec: dict[str, Any] = {}
    if workload == "on_complete":
        spec["on_complete"] = True
    if workload == "big" and cls.has_on_complete:
        spec["on_complete"] = True
    if BASE.get(workload, workload) == "limit":
        spec["limit"] = params["limit"]
    if workload == "retries":
        spec["retry"] = {"max_attempts": params["max_attempts"], "backoff": params["backoff"]}
    return spec


def trial_timeout(workload: str, params: dict[str, Any]) -> float:
    if workload in ("latency", "latency_fast"):
        return 60.0 + params["seconds"]
    if workload.startswith("scale"):
        return 300.0
    return 240.0


def settle_summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    waits = sorted(t["result"].get("_settle_s", 0.0) for t in trials)
    busy = [t["result"].get("_busy_before") for t in trials]
    return {
        "quiet_busy": QUIET_BUSY,
        "wait_median_s": waits[len(waits) // 2] if waits else 0.0,
        "wait_max_s": waits[-1] if waits else 0.0,
        "not_quiet": sum(1 for b in busy if b is not None and b > QUIET_BUSY),
    }


def run_trial(
    system: str, workload: str, params: dict[str, Any], verbose: bool, postgres: bool
) -> dict[str, Any]:
    timeout = trial_timeout(workload, params)
    spec = {
        "system": system,
        "workload": workload,
        "base_workload": BASE.get(workload, workload),
        "params": params,
        "system_spec": system_spec(system, workload, params),
        "timeout": timeout,
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = str(BENCH_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    settled_s, busy = settle(postgres)
    t = time.monotonic()
    load = os.getloadavg()[0]  # 1-minute load average as the trial starts
    try:
        proc = subprocess.run(
            [sys.executable, str(BENCH_DIR / "trial.py"), json.dumps(spec)],
            capture_output=True,
            timeout=timeout + 600,  # fill time of the scale workload comes on top
            env=env,
            cwd=str(BENCH_DIR),
        )
    except subprocess.TimeoutExpired:
        return {"error": "trial process timed out"}
    result: dict[str, Any] = {"error": "no RESULT line"}
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if verbose or "error" in result:
        err = proc.stderr.decode(errors="replace").strip()
        if err and "error" in result:
            print(err[-3000:], file=sys.stderr)
    result["_wall_s"] = round(time.monotonic() - t, 2)
    result["_load"] = round(load, 2)
    result["_settle_s"] = round(settled_s, 2)
    result["_busy_before"] = None if busy is None else round(busy, 3)
    return result


def git_state() -> str:
    """The workpool commit measured, and whether src/ had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=str(BENCH_DIR.parent),
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "src"],
            capture_output=True,
            text=True,
            cwd=str(BENCH_DIR.parent),
            timeout=10,
        ).stdout.strip()
        return head + (" + uncommitted src changes" if dirty else "")
    except Exception:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 repetition")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    ap.add_argument("--workloads", default=",".join(GROUPS), help="comma-separated")
    ap.add_argument("--repeat", type=int, default=None, help="repetitions (default 3, quick 1)")
    ap.add_argument(
        "--repeat-scale",
        type=int,
        default=3,
        help="repetitions of the slow workloads (scale, idle)",
    )
    ap.add_argument(
        "--args-bytes",
        type=int,
        default=0,
        help="pad each job's args in drain and on_complete with this many bytes (default 0)",
    )
    ap.add_argument("--out", default=str(BENCH_DIR / "results"), help="results directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    groups = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for g in groups:
        if g not in GROUPS:
            ap.error(f"unknown workload {g!r}; known: {', '.join(GROUPS)}")
    workloads = [w for g in groups for w in GROUPS[g]]
    repeat = args.repeat or (1 if args.quick else 3)
    if args.args_bytes < 0:
        ap.error(f"--args-bytes must be 0 or more, not {args.args_bytes}")
    params = dict(QUICK if args.quick else FULL)
    if args.args_bytes:
        # The same jobs, each carrying a string of that many bytes more in its args,
        # as an application's ids, keys and small documents would.
        for w in ("drain", "on_complete"):
            params[w] = dict(params[w], pad=args.args_bytes)

    if any(system_class(s).store == "postgresql" for s in systems) and not pg_available():
        print(
            "PostgreSQL at 127.0.0.1:5432 (db test, user postgres) does not answer:"
            " PostgreSQL systems will fail",
            file=sys.stderr,
        )

    postgres = pg_available()
    if postgres:
        for name in pg_drop_stale():
            print(f"dropped stale database {name}", file=sys.stderr)
    started = time.time()
    load_start = os.getloadavg()[0]
    print(
        f"workpool benchmark: {'quick' if args.quick else 'full'} mode, {repeat} repetition(s),"
        f" systems {', '.join(systems)}",
        flush=True,
    )
    trials: list[dict[str, Any]] = []
    for r in range(repeat):
        for w in workloads:
            if w in SINGLE and r >= max(args.repeat_scale, 1):
                continue
            for s in systems:
                t = time.monotonic()
                res = run_trial(s, w, params[w], args.verbose, postgres)
                trials.append({"system": s, "workload": w, "repeat": r, "result": res})
                brief = "n/a: " + res["na"] if "na" in res else res.get("error") or "ok"
                print(
                    f"  [{r + 1}/{repeat}] {w:<12} {s:<16} {time.monotonic() - t:6.1f}s  "
                    f"{str(brief)[:100]}",
                    flush=True,
                )

    summary = build_summary(trials, systems, workloads)
    meta = {
        "mode": "quick" if args.quick else "full",
        "repeat": repeat,
        "repeat_scale": args.repeat_scale,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "params": {w: params[w] for w in workloads},
        "versions": versions(),
        "workpool_git": git_state(),
        "cpus": os.cpu_count(),
        "load_start": round(load_start, 2),
        "load_end": round(os.getloadavg()[0], 2),
        "load_trials_max": round(
            max((t["result"].get("_load", 0.0) for t in trials), default=0.0), 2
        ),
        "notes": {s: system_class(s).notes for s in systems},
        "settle": settle_summary(trials),
    }
    text, targets = print_report(summary, systems, workloads, meta)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    out = {"meta": meta, "summary": summary, "targets": targets, "trials": trials}
    with open(os.path.join(args.out, "latest.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(os.path.join(args.out, "latest.txt"), "w") as f:
        f.write(text + "\n")
    try:
        plot(summary, systems, os.path.join(args.out, "throughput.png"))
    except Exception as exc:  # the table and JSON matter more than the picture
        print(f"plot failed: {exc}", file=sys.stderr)
    print(
        f"results: {os.path.join(args.out, 'latest.json')}, throughput.png"
        f" ({meta['duration_s']:.0f}s)"
    )


if __name__ == "__main__":
    main()
