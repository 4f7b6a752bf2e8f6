"""The checker of a chaos run: proves the guarantees from the database and the records.

    python -m chaos.check OUT_DIR      # re-check a finished run (its store must still exist)

Inputs: ``run.json`` (processes, kill times, server faults), the records the
work wrote (``records/<pid>.jsonl``), the worker logs (``logs/``), the
enqueuers' outputs (``enqueuer-*.json``), the user tables ``chaos_items``,
``chaos_done``, ``chaos_mut`` and the store's own tables ``work`` and
``finished``, plus ``status_batch`` through the public API.

Every check that fails adds a line to ``violations``; the figures go to
``figures``. See docs/reliability.md for what each check proves.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

MAX_LISTED = 8  # examples listed per kind of violation
# Output lines that are neither workpool events nor a sign of trouble.
# (psycopg_pool's own log lines while connections are cut or the server restarts.)
BENIGN = ("discarding closed connection", "error connecting in", "error ignored terminating")


class Report:
    def __init__(self) -> None:
        self.violations: list[str] = []
        self.notes: list[str] = []
        self.figures: dict[str, Any] = {}

    def fail(self, what: str, examples: list[Any] | None = None, count: int | None = None) -> None:
        if examples is not None:
            n = len(examples) if count is None else count
            shown = ", ".join(str(e) for e in examples[:MAX_LISTED])
            more = f" (+{n - MAX_LISTED} more)" if n > MAX_LISTED else ""
            what = f"{what}: {n}: {shown}{more}"
        self.violations.append(what)


def _load_records(directory: Path, report: Report) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            try:
                lines.append(json.loads(line))
            except ValueError:
                report.fail(f"torn record line {path.name}:{number}: {line[:120]!r}")
    return lines


def _scan_logs(directory: Path, report: Report) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    stray: list[str] = []
    locked: list[str] = []
    for path in sorted(directory.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "database is locked" in line:
                locked.append(f"{path.name}: {line[:200]}")
            event = None
            stamp, _, rest = line.partition(" ")
            if rest.startswith("{"):
                try:
                    event = json.loads(rest)
                    event["_t"] = float(stamp)
                except ValueError:
                    event = None
            if isinstance(event, dict) and event.get("component") == "workpool":
                event["_log"] = path.name
                events.append(event)
                counts[str(event.get("event"))] += 1
            elif line.strip() and not any(b in line for b in BENIGN):
                stray.append(f"{path.name}: {line[:200]}")
    if locked:
        report.fail('"database is locked" in worker output', locked)
    tracebacks = [s for s in stray if "Traceback" in s]
    if tracebacks:
        report.fail("tracebacks in worker output (outside workpool's events)", tracebacks)
    bad_handler = [
        e
        for e in events
        if e.get("event") == "on_complete_failed"
        and "chaos: flaky on_complete" not in str(e.get("error"))
    ]
    if bad_handler:
        report.fail(
            "on_complete failed for a reason other than the planted one",
            [f"{e['work_id']}: {e.get('error')}" for e in bad_handler],
        )
    return {"events": events, "counts": dict(counts), "stray": stray}


def _sweep(intervals: list[tuple[float, float]]) -> tuple[int, float | None]:
    """The most intervals open at one instant, and when (ends sort before starts)."""
    points = [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals]
    points.sort(key=lambda p: (p[0], p[1]))
    best, when, level = 0, None, 0
    for t, step in points:
        level += step
        if level > best:
            best, when = level, t
    return best, when


def check(out: Path) -> dict[str, Any]:
    import os

    out = Path(out)
    run = json.loads((out / "run.json").read_text())
    report = Report()
    store = run["store"]
    report.notes.extend(run["anomalies"])
    for anomaly in run["anomalies"]:
        report.fail(f"harness: {anomaly}")

    os.environ["WORKPOOL_DATABASE_URL"] = run["url"]
    os.environ.setdefault("CHAOS_RECORDS", str(out / "records"))
    import workpool
    from chaos import chaos_app as ca

    app = workpool.App(run["url"])
    prefix = ca.PREFIX
    try:
        with app.transaction() as tx:
            items_rows = tx.execute(
                f"SELECT work_id, pool, fn, spec, parent, via FROM {ca.T_ITEMS}"
            ).fetchall()
            done_rows = tx.execute(f"SELECT work_id, kind, followup FROM {ca.T_DONE}").fetchall()
            mut_rows = tx.execute(f"SELECT work_id FROM {ca.T_MUT}").fetchall()
            active_rows = tx.execute(
                f"SELECT id, pool, state, attempt, worker_id FROM {prefix}work"
            ).fetchall()
            finished_rows = tx.execute(
                f"SELECT id, result, attempts, finished_at, handler_error FROM {prefix}finished"
            ).fetchall()
        items: dict[str, dict[str, Any]] = {}
        duplicates = []
        for work_id, pool, fn, spec, parent, via in items_rows:
            if work_id in items:
                duplicates.append(work_id)
            items[work_id] = {
                "pool": pool,
                "fn": fn,
                "spec": json.loads(spec),
                "parent": parent,
                "via": via,
            }
        if duplicates:
            report.fail("work ids recorded twice in chaos_items", duplicates)
        ids = sorted(items)
        statuses: dict[str, Any] = {}
        for pool_name in ("mixed", "tx"):
            pool = app.pool(pool_name)  # no options: reads the stored config, writes nothing
            in_pool = [i for i in ids if items[i]["pool"] == pool_name]
            for k in range(0, len(in_pool), 500):
                chunk = in_pool[k : k + 500]
                statuses.update(zip(chunk, pool.status_batch(chunk), strict=True))
    finally:
        app.close()

    finished = {
        r[0]: {
            "result": json.loads(r[1]),
            "attempts": int(r[2]),
            "finished_at": float(r[3]),
            "handler_error": r[4],
        }
        for r in finished_rows
    }
    figures = report.figures
    figures["items"] = len(items)
    figures["items_by_fn"] = dict(Counter(i["fn"] for i in items.values()))
    figures["followups"] = sum(1 for i in items.values() if i["parent"])
    figures["delayed"] = sum(1 for i in items.values() if i["spec"].get("run_after"))

    # 1. everything finished; nothing stuck pending or running ----------------------------
    if active_rows:
        report.fail(
            "work still active in the store (stuck)",
            [f"{r[0]} {r[1]} {r[2]} attempt {r[3]}" for r in active_rows],
        )
    not_finished = [
        f"{i}: {s!r}" for i, s in statuses.items() if s.state != "finished" or s.result is None
    ]
    if not_finished:
        report.fail("items not Finished with a result after the drain (stuck)", not_finished)
    unknown = sorted(({r[0] for r in active_rows} | set(finished)) - set(items))
    if unknown:
        report.fail("work in the store that nobody enqueued (orphans)", unknown)
    results: dict[str, str] = {}
    for work_id, status in statuses.items():
        if status.state == "finished" and status.result is not None:
            results[work_id] = status.result.kind
            row = finished.get(work_id)
            if row is None:
                report.fail(f"{work_id}: status Finished but no row in `finished`")
            elif row["result"].get("kind") != status.result.kind:
                report.fail(f"{work_id}: status {status.result.kind} but finished row {row}")
    figures["results"] = dict(Counter(results.values()))

    # 2. on_complete exactly once, with the right kind; follow-ups enqueued with it --------
    done_by: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
    for work_id, kind, followup in done_rows:
        done_by[work_id].append((kind, followup))
    handler_given_up = 0
    wrong_count, wrong_kind, stray_done = [], [], []
    for work_id, item in items.items():
        rows = done_by.get(work_id, [])
        if not item["spec"]["on_complete"]:
            if rows:
                stray_done.append(work_id)
            continue
        status = statuses.get(work_id)
        gave_up = status is not None and getattr(status, "on_complete_error", None)
        handler_given_up += bool(gave_up)
        expected = 0 if gave_up else 1
        if len(rows) != expected:
            wrong_count.append(f"{work_id}: {len(rows)} rows (expected {expected})")
        for kind, _ in rows:
            if work_id in results and kind != results[work_id]:
                wrong_kind.append(f"{work_id}: handler saw {kind}, status {results[work_id]}")
    if wrong_count:
        report.fail("on_complete did not run exactly once", wrong_count)
    if wrong_kind:
        report.fail("on_complete saw another result kind than the status", wrong_kind)
    if stray_done:
        report.fail("on_complete rows for work enqueued without on_complete", stray_done)
    figures["on_complete_given_up"] = handler_given_up
    followups = {f for rows in done_by.values() for _, f in rows if f}
    planted = {i for i, item in items.items() if item["parent"]}
    if followups != planted:
        report.fail(
            "follow-ups in chaos_done and chaos_items differ",
            sorted(followups ^ planted),
        )
    for work_id in planted:
        parent = items[work_id]["parent"]
        if not any(f == work_id for _, f in done_by.get(parent, [])):
            report.fail(f"follow-up {work_id} has no on_complete row of its parent {parent}")

    # 3. mutations exactly once in effect --------------------------------------------------
    mut_count = Counter(r[0] for r in mut_rows)
    bad_mut = []
    for work_id, item in items.items():
        if item["fn"] != "mut":
            if mut_count.get(work_id):
                bad_mut.append(f"{work_id}: {item['fn']} has mutation rows")
            continue
        expected = 1 if results.get(work_id) == "success" else 0
        if mut_count.get(work_id, 0) != expected:
            bad_mut.append(
                f"{work_id}: {mut_count.get(work_id, 0)} effects, result {results.get(work_id)}"
            )
        if item["spec"]["args"].get("fail") and results.get(work_id) == "success":
            bad_mut.append(f"{work_id}: a failing mutation reported success")
    if bad_mut:
        report.fail("mutation effects not exactly once", bad_mut)
    figures["mutation_effects"] = sum(mut_count.values())

    # 4. runs from the records: at least once, never after the end, within the limit -------
    records = _load_records(out / "records", report)
    procs = run["procs"]
    killed = {p["pid"]: p["killed_at"] for p in procs if p["killed_at"] is not None}
    ended = {p["pid"]: p["ended_at"] for p in procs if p["ended_at"] is not None}
    runs: dict[str, dict[str, Any]] = {}
    for rec in records:
        entry = runs.setdefault(rec["tok"], {"w": rec["w"], "a": rec["a"], "pid": rec["pid"]})
        entry["pool"] = rec["pool"]
        entry["k"] = rec["k"]
        if rec["ev"] == "s":
            entry["s"] = rec["t"]
        else:
            entry["e"] = rec["t"]
            entry["o"] = rec.get("o")
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    open_alive = []
    for entry in runs.values():
        if "s" not in entry:
            report.fail(f"end record without start: {entry}")
            continue
        starts[entry["w"]].append(entry)
        end = entry.get("e")
        if end is None:
            pid = entry["pid"]
            if pid in killed:
                end = killed[pid]
            else:
                end = ended.get(pid, float("inf"))
                open_alive.append(f"{entry['w']} attempt {entry['a']} pid {pid}")
        intervals[entry["pool"]].append((entry["s"], end))
    if open_alive:
        report.notes.append(
            f"{len(open_alive)} runs without an end record in processes that were not"
            f" SIGKILLed (counted open until the process exited): {open_alive[:MAX_LISTED]}"
        )
    figures["runs"] = len(runs)
    during = sum(1 for e in runs.values() if "s" in e and e["s"] < run["end"])
    figures["runs_per_s_during_chaos"] = round(during / run["seconds"], 1)
    figures["runs_cut_by_kill"] = sum(
        1 for e in runs.values() if "e" not in e and e["pid"] in killed
    )
    limits = ca.LIMITS
    figures["max_parallel"] = {}
    for pool_name, spans in intervals.items():
        peak, when = _sweep(spans)
        figures["max_parallel"][pool_name] = peak
        if peak > limits[pool_name]:
            report.fail(
                f"pool {pool_name}: {peak} runs at once at t={when:.3f}"
                f" (max_parallelism {limits[pool_name]})"
            )

    after_end = []
    too_many = []
    not_run = []
    wrong_outcome = []
    for work_id, item in items.items():
        mine = starts.get(work_id, [])
        row = finished.get(work_id)
        if row is not None:
            late = [e for e in mine if e["s"] > row["finished_at"]]
            if late:
                gap = late[0]["s"] - row["finished_at"]
                after_end.append(
                    f"{work_id} attempt {late[0]['a']} started {gap:.3f} s after it finished"
                )
        kind = results.get(work_id)
        if item["fn"] in ("act", "act_async"):
            attempts = {e["a"] for e in mine}
            cap = item["spec"]["max_attempts"]
            if len(attempts) > cap:
                too_many.append(f"{work_id}: {len(attempts)} attempts ran, max_attempts {cap}")
            if row is not None and kind == "success":
                final = [e for e in mine if e["a"] == row["attempts"] and e.get("o") == "ok"]
                if not final:
                    wrong_outcome.append(
                        f"{work_id}: Success but no successful run of attempt {row['attempts']}"
                    )
            if row is not None and kind == "failed":
                error = str(row["result"].get("error"))
                for mark, outcome in (("chaos: fatal", "fatal"), ("chaos: flaky", "flaky")):
                    if mark in error and not any(
                        e["a"] == row["attempts"] and e.get("o") == outcome for e in mine
                    ):
                        wrong_outcome.append(f"{work_id}: Failed({error!r}) without such a run")
        if kind in ("success",) and not mine:
            not_run.append(work_id)
    if after_end:
        report.fail("runs that started after their work had finished", after_end)
    if too_many:
        report.fail("actions run more often than their retry policy allows", too_many)
    if not_run:
        report.fail("work reported Success without any run", not_run)
    if wrong_outcome:
        report.fail("results that do not match what the runs did", wrong_outcome)
    figures["actions_run_more_than_once"] = sum(
        1
        for w, item in items.items()
        if item["fn"] in ("act", "act_async") and len(starts.get(w, [])) > 1
    )

    # 5. cancels --------------------------------------------------------------------------
    cancels: list[dict[str, Any]] = []
    enqueue_errors: list[dict[str, Any]] = []
    enqueued = 0
    latency_max = 0.0
    for path in sorted(out.glob("enqueuer-*.json")):
        data = json.loads(path.read_text())
        cancels.extend(data["cancels"])
        enqueue_errors.extend(data["errors"])
        enqueued += data["enqueued"]
        latency_max = max(latency_max, data["latency_max"])
    figures["enqueue_latency_max_s"] = round(latency_max, 3)
    pending_cancels = [c for c in cancels if c["ok"] and c["state"] == "pending"]
    running_cancels = [c for c in cancels if c["ok"] and c["state"] == "running"]
    figures["cancels"] = {
        "pending": len(pending_cancels),
        "running": len(running_cancels),
        "no_op": sum(1 for c in cancels if not c["ok"]),
    }
    started_anyway = []
    for c in pending_cancels:
        later = [e for e in starts.get(c["w"], []) if e["a"] > c["attempt"]]
        if later:
            started_anyway.append(f"{c['w']}: canceled pending, attempt {later[0]['a']} started")
        if results.get(c["w"]) != "canceled":
            started_anyway.append(f"{c['w']}: canceled pending, result {results.get(c['w'])}")
    if started_anyway:
        report.fail("canceled pending work started (or did not end Canceled)", started_anyway)
    retried_anyway = []
    for c in running_cancels:
        later = [e for e in starts.get(c["w"], []) if e["a"] > c["attempt"]]
        if later:
            retried_anyway.append(f"{c['w']}: canceled at attempt {c['attempt']}, retried")
    if retried_anyway:
        report.fail("canceled running work was retried", retried_anyway)
    canceled_never_started = sum(
        1 for w, k in results.items() if k == "canceled" and not starts.get(w)
    )
    figures["canceled_never_started"] = canceled_never_started

    # 6. errors that reached user code ----------------------------------------------------
    by_where = Counter(e["where"] for e in enqueue_errors)
    figures["user_code_errors"] = dict(by_where)
    if store == "sqlite" and enqueue_errors:
        report.fail(
            "errors reached user code on SQLite",
            [f"{e['where']}: {e['type']}: {e['message']}" for e in enqueue_errors],
        )
    if store == "postgres":
        library = [e for e in enqueue_errors if e["where"] in ("plain", "status", "enqueuer")]
        if library:
            report.fail(
                "errors reached user code from client calls made outside a user transaction",
                [f"{e['where']}: {e['type']}: {e['message']}" for e in library],
            )
        if any(f["kind"] in ("cut", "restart") for f in run["faults"]) is False and enqueue_errors:
            report.fail(
                "errors reached user code without any server fault",
                [f"{e['where']}: {e['type']}: {e['message']}" for e in enqueue_errors],
            )

    # 7. worker logs: lost attempts, recovery after kills ---------------------------------
    logs = _scan_logs(out / "logs", report)
    worker_pid: dict[str, int] = {}
    for event in logs["events"]:
        if event.get("event") == "worker_started":
            worker_pid[event["worker_id"]] = int(event["pid"])
    lost: dict[tuple[str, int], dict[str, Any]] = {}
    for event in logs["events"]:
        if event.get("event") == "work_lost":
            lost.setdefault((event["work_id"], int(event["attempt"])), event)
    rescues: list[float] = []  # kill -> the rescuer recorded the attempt as lost
    reruns: list[float] = []  # kill -> the next attempt of that work started
    lost_alive = []
    lost_by_kill = 0
    orphan_claims = 0
    # Actions requeued as never started, yet a run of that attempt began. (A mutation
    # may: its run is taken back with its transaction when that does not commit.)
    ran_orphans = []
    for (work_id, attempt), event in lost.items():
        if event.get("never_ran"):
            orphan_claims += 1
            began = [e for e in starts.get(work_id, []) if e["a"] == attempt]
            if began and event.get("fn_name") in ("act", "act_async"):
                ran_orphans.append(
                    f"{work_id} attempt {attempt}: run began {began[0]['s']:.3f},"
                    f" requeued {event.get('_t', float('nan')):.3f} by {event.get('worker_id')}"
                )
            continue
        pid = worker_pid.get(str(event.get("worker_id")))
        if pid is None or pid not in killed:
            lost_alive.append(f"{work_id} attempt {attempt} of pid {pid}")
            continue
        lost_by_kill += 1
        if "_t" in event:
            rescues.append(event["_t"] - killed[pid])
        rerun = [e["s"] for e in starts.get(work_id, []) if e["a"] > attempt]
        if rerun:
            reruns.append(min(rerun) - killed[pid])

    def stat(values: list[float], fn: Any) -> float | None:
        return round(float(fn(values)), 3) if values else None

    figures["kills"] = run["kills"]
    figures["lost_attempts_by_kills"] = lost_by_kill
    figures["lost_attempts_of_live_workers"] = len(lost_alive)
    figures["orphaned_claims_requeued"] = orphan_claims
    figures["kill_to_rescue_s"] = {
        "max": stat(rescues, max),
        "median": stat(rescues, statistics.median),
    }
    figures["kill_to_rerun_s"] = {
        "n": len(reruns),
        "max": stat(reruns, max),
        "median": stat(reruns, statistics.median),
    }
    if ran_orphans:
        report.fail("attempts requeued as never started that had started", ran_orphans)
    if lost_alive:
        report.notes.append(
            f"{len(lost_alive)} attempts were rescued from workers that were not killed"
            f" (their lease lapsed, e.g. while the server was down): {lost_alive[:MAX_LISTED]}"
        )
    figures["log_events"] = {
        k: v for k, v in sorted(logs["counts"].items()) if k not in ("report",)
    }
    figures["faults"] = dict(Counter(f["kind"] for f in run["faults"]))
    restarts = [f["seconds"] for f in run["faults"] if f["kind"] == "restart"]
    if restarts:
        figures["restart_seconds"] = restarts
    figures["drain_seconds"] = round(run["drain_seconds"], 1)
    figures["wall_seconds"] = run["seconds"]
    figures["workers"] = run["workers"]
    figures["enqueuers"] = run["enqueuers"]
    figures["seed"] = run["seed"]
    if enqueued + figures["followups"] != len(items):
        text = (
            f"enqueuers report {enqueued} items and handlers {figures['followups']} follow-ups,"
            f" but chaos_items holds {len(items)}"
        )
        # A batch whose COMMIT failed ambiguously may be stored whole: count its items.
        ambiguous = sum(e.get("items", 1) for e in enqueue_errors if e["where"] in ("tx", "record"))
        if store == "postgres" and 0 < len(items) - enqueued - figures["followups"] <= ambiguous:
            report.notes.append(f"{text} (commits that failed ambiguously under connection cuts)")
        else:
            report.fail(text)
    return {
        "store": store,
        "figures": figures,
        "violations": report.violations,
        "notes": report.notes,
        "stray_output": logs["stray"][:50],
    }


def print_report(report: dict[str, Any]) -> None:
    f = report["figures"]
    print(f"\n=== chaos run on {report['store']} ===")
    for key, value in f.items():
        print(f"  {key:32} {value}")
    if report["stray_output"]:
        print("  worker output that is not an event (first lines):")
        for line in report["stray_output"][:10]:
            print(f"    {line}")
    for note in report["notes"]:
        print(f"  note: {note}")
    if report["violations"]:
        print(f"\nVIOLATIONS ({len(report['violations'])}):")
        for v in report["violations"]:
            print(f"  - {v}")
    else:
        print("\nall checks passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    result = check(Path(sys.argv[1]))
    print_report(result)
    sys.exit(1 if result["violations"] else 0)
