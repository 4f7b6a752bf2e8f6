"""Medians, the results table, the target verdicts, the JSON summary and the plot."""

from __future__ import annotations

import importlib.metadata
import math
from typing import Any

from common import median
from systems import system_class

# (workload, metric key, label, kind) — kind: rate | ms | us | pct | share | count | bool | x
ROWS: list[tuple[str, str, str, str]] = [
    ("drain", "enqueue_rate", "batch enqueue jobs/s", "rate"),
    ("drain", "drain_rate", "drain jobs/s", "rate"),
    ("drain", "exactly_once", "every job exactly once", "bool"),
    ("drain", "worker_us_per_job", "drain: worker CPU us/job", "us"),
    ("drain", "server_us_per_job", "drain: PostgreSQL CPU us/job", "us"),
    ("latency", "p50_ms", "enqueue->start p50 ms", "ms"),
    ("latency", "p95_ms", "p95 ms", "ms"),
    ("latency", "p99_ms", "p99 ms", "ms"),
    ("latency", "max_ms", "max ms", "ms"),
    ("latency", "enqueue_call_p50_ms", "single enqueue call p50 ms", "ms"),
    ("limit", "max_concurrency", "max concurrency (limit 5)", "count"),
    ("limit", "share_of_ideal", "throughput / ideal 250/s", "share"),
    ("limit", "gap_ms", "slot idle between jobs ms", "ms"),
    ("limit", "first_start_ms", "go -> first start ms", "ms"),
    ("retries", "rate", "jobs/s (2 fails + 1 success)", "rate"),
    ("retries", "exactly_once", "succeeded exactly once", "bool"),
    ("on_complete", "drain_rate", "drain jobs/s with on_complete", "rate"),
    ("on_complete", "oc_share", "share of plain drain", "share"),
    ("on_complete", "exactly_once", "job + on_complete exactly once", "bool"),
    ("scale_small", "claim_rate", "claim jobs/s, small backlog", "rate"),
    ("scale_large", "claim_rate", "claim jobs/s, large backlog", "rate"),
    ("scale", "claim_ratio", "large / small claim rate", "share"),
    ("scale_small", "status_ms", "status() ms, small backlog", "ms"),
    ("scale_large", "status_ms", "status() ms, large backlog", "ms"),
    ("scale", "status_ratio", "large / small status ms", "share"),
    ("scale_large", "fill_rate", "fill jobs/s (large backlog)", "rate"),
    ("big", "enqueue_mb_s", "enqueue MB/s (800KB+800KB)", "rate"),
    ("big", "drain_rate", "drain jobs/s", "rate"),
    ("big", "exactly_once", "every job exactly once", "bool"),
    ("big", "worker_ms_per_job", "big: worker CPU ms/job", "ms"),
    ("big", "server_ms_per_job", "big: PostgreSQL CPU ms/job", "ms"),
    ("idle", "worker_cpu_pct", "idle worker CPU % of a core", "pct"),
    ("idle", "server_cpu_pct", "PostgreSQL server CPU %", "pct"),
    ("limit_wide", "max_concurrency", "max concurrency (limit 50)", "count"),
    ("limit_wide", "share_of_ideal", "throughput / ideal 2,500/s", "share"),
    ("limit_wide", "gap_ms", "slot idle between jobs ms", "ms"),
    ("latency_fast", "p50_ms", "1,000/s: enqueue->start p50 ms", "ms"),
    ("latency_fast", "p95_ms", "p95 ms", "ms"),
    ("latency_fast", "p99_ms", "p99 ms", "ms"),
    ("latency_fast", "enqueue_call_p50_ms", "single enqueue call p50 ms", "ms"),
]
WORKPOOL = {"sqlite": "workpool-sqlite", "postgresql": "workpool-pg"}


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("workpool", "pgqueuer", "procrastinate", "dbos", "huey", "psycopg", "asyncpg"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "-"
    return out


def build_summary(
    trials: list[dict[str, Any]], systems: list[str], workloads: list[str]
) -> dict[str, dict[str, Any]]:
    """system -> workload -> {na | metrics (medians; max for max_concurrency), errors, runs}."""
    summary: dict[str, dict[str, Any]] = {}
    for s in systems:
        summary[s] = {}
        for w in workloads:
            results = [t["result"] for t in trials if t["system"] == s and t["workload"] == w]
            if not results:
                continue
            if all("na" in r for r in results):
                summary[s][w] = {"na": results[0]["na"]}
                continue
            keys = {k for r in results for k, v in r.items() if not k.startswith("_")}
            metrics: dict[str, Any] = {}
            for k in sorted(keys):
                vals = [r[k] for r in results if k in r]
                if all(isinstance(v, bool) for v in vals):
                    metrics[k] = all(vals)
                elif all(isinstance(v, int | float) and v is not None for v in vals):
                    metrics[k] = max(vals) if k == "max_concurrency" else median(vals)
            errors = [r["error"] for r in results if "error" in r]
            summary[s][w] = {"metrics": metrics, "errors": errors, "runs": len(results)}
        # derived rows
        d, oc = _m(summary, s, "drain", "drain_rate"), _m(summary, s, "on_complete", "drain_rate")
        if d and oc and "on_complete" in summary[s] and "metrics" in summary[s]["on_complete"]:
            summary[s]["on_complete"]["metrics"]["oc_share"] = oc / d
        small, large = summary[s].get("scale_small"), summary[s].get("scale_large")
        if small or large:
            scale: dict[str, Any] = {}
            if (small and "na" in small) or (large and "na" in large):
                scale = {"na": (small or large or {}).get("na")}
            else:
                m: dict[str, Any] = {}
                cs, cl = (
                    _m(summary, s, "scale_small", "claim_rate"),
                    _m(summary, s, "scale_large", "claim_rate"),
                )
                if cs and cl:
                    m["claim_ratio"] = cl / cs
                ss, sl = (
                    _m(summary, s, "scale_small", "status_ms"),
                    _m(summary, s, "scale_large", "status_ms"),
                )
                if ss and sl:
                    m["status_ratio"] = sl / ss
                scale = {"metrics": m, "errors": []}
            summary[s]["scale"] = scale
    return summary


def _m(summary: dict[str, Any], system: str, workload: str, key: str) -> Any:
    entry = summary.get(system, {}).get(workload)
    if not entry or "metrics" not in entry:
        return None
    v = entry["metrics"].get(key)
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def fmt(v: Any, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "bool":
        return "yes" if v else "NO"
    if kind == "rate":
        if v >= 100_000:
            return f"{v / 1000:.0f}k"
        if v >= 10_000:
            return f"{v / 1000:.1f}k"
        if v >= 1_000:
            return f"{v / 1000:.2f}k"
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    if kind == "ms":
        if v < 0.1:
            return f"{v:.3f}"
        return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"
    if kind == "share":
        return f"{v * 100:.0f}%"
    if kind == "pct":
        return f"{v:.2f}%"
    if kind == "us":
        return f"{v:.0f}" if v >= 10 else f"{v:.1f}"
    if kind == "count":
        return f"{v:.0f}"
    return f"{v:.2f}"


def _ratio_text(v: Any, wp: Any, kind: str) -> str:
    if kind not in ("rate", "ms", "us", "pct") or not v or not wp:
        return ""
    r = wp / v
    return f" wp{r:.2f}x" if r < 10 else f" wp{r:.0f}x"


def _targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: Any, goal: float, op: str, show: str, detail: str = "") -> None:
        if value is None:
            verdict = "n/a"
        else:
            ok = value >= goal if op == ">=" else value <= goal
            verdict = "PASS" if ok else "MISS"
        out.append(
            {
                "target": name,
                "value": value,
                "goal": goal,
                "op": op,
                "verdict": verdict,
                "show": show,
                "detail": detail,
            }
        )

    def ratio(a: Any, b: Any) -> Any:
        return a / b if a and b else None

    wps, wpp = "workpool-sqlite", "workpool-pg"
    r = ratio(
        _m(summary, wpp, "drain", "drain_rate"), _m(summary, "pgqueuer", "drain", "drain_rate")
    )
    add("drain PG: workpool-pg / pgqueuer", r, 2.0, ">=", "x")
    r = ratio(_m(summary, wps, "drain", "drain_rate"), _m(summary, "huey", "drain", "drain_rate"))
    add("drain SQLite: workpool-sqlite / huey", r, 3.0, ">=", "x")
    r = ratio(
        _m(summary, wps, "drain", "drain_rate"), _m(summary, "bare-sqlite", "drain", "drain_rate")
    )
    add("drain SQLite: workpool / bare floor", r, 0.5, ">=", "%")
    r = ratio(
        _m(summary, wpp, "drain", "drain_rate"), _m(summary, "bare-pg", "drain", "drain_rate")
    )
    add("drain PG: workpool / bare floor", r, 0.5, ">=", "%")
    for sysname, label in ((wps, "SQLite"), (wpp, "PG")):
        add(
            f"batch enqueue {label} (jobs/s)",
            _m(summary, sysname, "drain", "enqueue_rate"),
            100_000,
            ">=",
            "rate",
        )
    for sysname, label in ((wps, "SQLite"), (wpp, "PG")):
        add(
            f"start latency p50 {label} (ms)",
            _m(summary, sysname, "latency", "p50_ms"),
            3.0,
            "<=",
            "ms",
        )
        add(
            f"start latency p99 {label} (ms)",
            _m(summary, sysname, "latency", "p99_ms"),
            10.0,
            "<=",
            "ms",
        )
    for sysname, label in ((wps, "SQLite"), (wpp, "PG")):
        mc = _m(summary, sysname, "limit", "max_concurrency")
        lim = _m(summary, sysname, "limit", "limit") or 5
        add(f"global limit never exceeded {label} (max seen)", mc, lim, "<=", "count")
        add(
            f"global limit throughput {label} (of ideal)",
            _m(summary, sysname, "limit", "share_of_ideal"),
            0.95,
            ">=",
            "%",
        )
    for sysname, label in ((wpp, "PG"), (wps, "SQLite")):
        r = ratio(
            _m(summary, sysname, "retries", "rate"), _m(summary, "pgqueuer", "retries", "rate")
        )
        add(f"retries {label}: workpool / pgqueuer", r, 5.0, ">=", "x")
    for sysname, label in ((wps, "SQLite"), (wpp, "PG")):
        add(
            f"on_complete drain {label} (of plain drain)",
            _m(summary, sysname, "on_complete", "oc_share"),
            0.75,
            ">=",
            "%",
        )
    for sysname, label in ((wps, "SQLite"), (wpp, "PG")):
        add(
            f"scale {label}: claim rate large/small",
            _m(summary, sysname, "scale", "claim_ratio"),
            0.8,
            ">=",
            "%",
        )
        add(
            f"scale {label}: status ms large/small",
            _m(summary, sysname, "scale", "status_ratio"),
            1.2,
            "<=",
            "%",
        )
    return out


def _show(t: dict[str, Any]) -> tuple[str, str]:
    v, g, show = t["value"], t["goal"], t["show"]
    if show == "x":
        return ("-" if v is None else f"{v:.2f}x", f"{t['op']} {g:g}x")
    if show == "%":
        return ("-" if v is None else f"{v * 100:.0f}%", f"{t['op']} {g * 100:.0f}%")
    if show == "rate":
        return ("-" if v is None else f"{v:,.0f}", f"{t['op']} {g:,.0f}")
    if show == "ms":
        return ("-" if v is None else f"{v:.2f}", f"{t['op']} {g:g}")
    return ("-" if v is None else f"{v:g}", f"{t['op']} {g:g}")


def print_report(
    summary: dict[str, Any], systems: list[str], workloads: list[str], meta: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    order = sorted(systems, key=lambda s: (system_class(s).store != "sqlite", systems.index(s)))
    present = set(workloads) | (
        {"scale"} if any(w.startswith("scale") for w in workloads) else set()
    )
    lines: list[str] = []
    p = meta["params"]
    lines.append("")
    lines.append(
        f"== workpool benchmark ({meta['mode']}, medians of {meta['repeat']} run(s); "
        f"scale and idle: {meta['repeat_scale']} run(s); {meta['cpus']} CPUs) =="
    )
    lines.append("parameters: " + "; ".join(f"{w} {v}" for w, v in p.items()))
    lines.append(
        "versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f"; workpool at {meta.get('workpool_git', '?')}"
    )
    load = (meta.get("load_start"), meta.get("load_trials_max"), meta.get("load_end"))
    lines.append(
        f"machine load (1-min average): {load[0]} at start, {load[1]} max at a trial start"
        f" (includes this run's own trials), {load[2]} at end, on {meta['cpus']} CPUs"
    )
    settle = meta.get("settle")
    if settle:
        lines.append(
            "before each trial: a PostgreSQL CHECKPOINT, then a wait for CPUs under"
            f" {settle['quiet_busy']:.0%} busy (median {settle['wait_median_s']:.1f} s,"
            f" max {settle['wait_max_s']:.1f} s; {settle['not_quiet']} trial(s) started"
            " on a machine that did not quiet down)"
        )
    if (load[0] or 0) > 0.5 * (meta["cpus"] or 1):
        lines.append(
            "WARNING: other processes used the CPUs when this run started: absolute numbers"
            " are depressed and latency tails inflated; compare ratios, and rerun on an idle"
            " machine for absolute values"
        )
    lines.append(
        "cells: value, then wpN.NNx = workpool's value / this system's value on the same"
        " store (rates: >1 = workpool faster; ms: <1 = workpool faster; CPU %: <1 ="
        " workpool cheaper)"
    )
    lines.append("")
    w0 = 34
    cw = max(17, max(len(s) for s in order) + 2)
    header = f"{'workload / metric':<{w0}}" + "".join(f"{s:>{cw}}" for s in order)
    lines.append(header)
    lines.append("-" * len(header))
    last = None
    notes: list[str] = []
    for workload, key, label, kind in ROWS:
        if workload not in present:
            continue
        group = "scale" if workload.startswith("scale") else workload
        if group != last:
            lines.append(f"[{group}]")
            last = group
        cells = []
        for s in order:
            entry = summary.get(s, {}).get(workload)
            if entry is None:
                cells.append("-")
                continue
            if "na" in entry:
                cells.append(f"n/a {entry['na']}")
                continue
            if entry.get("errors") and key in (
                "drain_rate",
                "rate",
                "p50_ms",
                "claim_rate",
                "share_of_ideal",
                "claim_ratio",
            ):
                notes.append(f"{s} {workload}: {entry['errors'][0][:200]}")
            v = entry["metrics"].get(key)
            if v is None and entry.get("errors"):
                cells.append("ERR")
                continue
            text = fmt(v, kind)
            store = system_class(s).store
            wp = WORKPOOL[store]
            if s != wp:
                text += _ratio_text(v, _m(summary, wp, workload, key), kind)
            cells.append(text)
        lines.append(f"  {label:<{w0 - 2}}" + "".join(f"{c[: cw - 1]:>{cw}}" for c in cells))
    if notes:
        lines.append("")
        lines.append("errors:")
        for n in dict.fromkeys(notes):
            lines.append(f"  {n}")
    targets = _targets(summary)
    lines.append("")
    lines.append(f"{'workpool target':<48}{'measured':>12}{'goal':>14}  result")
    lines.append("-" * 82)
    for t in targets:
        value, goal = _show(t)
        lines.append(f"{t['target']:<48}{value:>12}{goal:>14}  {t['verdict']}")
    passed = sum(t["verdict"] == "PASS" for t in targets)
    missed = sum(t["verdict"] == "MISS" for t in targets)
    lines.append(f"{passed} PASS, {missed} MISS, {len(targets) - passed - missed} n/a")
    return "\n".join(lines), targets


def plot(summary: dict[str, Any], systems: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(systems, key=lambda s: (system_class(s).store != "sqlite", systems.index(s)))
    colors = [
        "#1f77b4" if s.startswith("workpool") else "#999999" if s.startswith("bare") else "#ff7f0e"
        for s in order
    ]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for ax, (w, key, title) in zip(
        axes[:2],
        [
            ("drain", "drain_rate", "drain: no-op jobs/s (2 cores)"),
            ("retries", "rate", "retries: jobs/s (2 fails + 1 success)"),
        ],
        strict=True,
    ):
        vals = [_m(summary, s, w, key) or 0 for s in order]
        ax.bar(order, vals, color=colors)
        ax.set_title(title)
        if any(vals):
            ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=40)
        for i, v in enumerate(vals):
            if v:
                ax.text(i, v, fmt(v, "rate"), ha="center", va="bottom", fontsize=8)
    ax = axes[2]
    width = 0.4
    p50 = [_m(summary, s, "latency", "p50_ms") or 0 for s in order]
    p99 = [_m(summary, s, "latency", "p99_ms") or 0 for s in order]
    xs = list(range(len(order)))
    ax.bar([x - width / 2 for x in xs], p50, width, label="p50", color="#2ca02c")
    ax.bar([x + width / 2 for x in xs], p99, width, label="p99", color="#d62728")
    ax.set_xticks(xs)
    ax.set_xticklabels(order, rotation=40)
    if any(p50 + p99):
        ax.set_yscale("log")
    ax.set_title("latency: enqueue -> start, ms (~100/s)")
    ax.legend()
    for ax in axes:
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
