"""The short chaos run (PRODUCT.md §1, §3, §4, §5): real worker processes killed with
SIGKILL at random, on each store, then every guarantee checked from the database and
from the records the work wrote (chaos/check.py).

Each test runs ``python -m chaos.run`` for 30 s of chaos plus the drain and the
check (about a minute). On PostgreSQL the run also cuts its own connections with
``pg_terminate_backend`` every few seconds; only ``make chaos`` restarts the
server. The long run, with both stores and the server restarts, is ``make chaos``
(see docs/reliability.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import store_kind

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 30
ITEMS = {"sqlite": 1500, "postgres": 800}

pytestmark = pytest.mark.timeout(240)


def test_chaos_run_keeps_every_guarantee(store_url: str, tmp_path: Path) -> None:
    kind = store_kind(store_url)
    out = tmp_path / "chaos"
    argv = [
        sys.executable,
        "-m",
        "chaos.run",
        "--store",
        kind,
        "--url",
        store_url,
        "--seconds",
        str(SECONDS),
        "--items",
        str(ITEMS[kind]),
        "--workers",
        "4",
        "--enqueuers",
        "3",
        "--kill-every",
        "1.5",
        "--drain-timeout",
        "90",
        "--out",
        str(out),
    ]
    if kind == "postgres":
        argv += ["--cut-every", "4"]  # never --restart-server in the test suite
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=220)
    output = done.stdout[-6000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"chaos run failed (files in {out}):\n{output}"
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    figures = report["figures"]
    assert report["violations"] == []
    # The run did what it claims: work of every kind, kills that hit running work.
    assert figures["items"] >= ITEMS[kind] // 2, figures
    assert set(figures["items_by_fn"]) == {"act", "act_async", "mut", "qry"}, figures
    assert figures["kills"] >= 10, figures
    assert figures["cancels"]["pending"] > 0, figures
    assert figures["followups"] > 0, figures
    if kind == "postgres":
        assert figures["faults"].get("cut", 0) >= 3, figures
