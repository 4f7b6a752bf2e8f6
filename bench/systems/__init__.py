"""One adapter module per benchmarked system, all with the interface of base.System."""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class)
SYSTEMS: dict[str, tuple[str, str]] = {
    "workpool-sqlite": ("systems.workpool_sys", "WorkpoolSqlite"),
    "workpool-pg": ("systems.workpool_sys", "WorkpoolPg"),
    "pgqueuer": ("systems.pgqueuer_sys", "PgQueuerSystem"),
    "procrastinate": ("systems.procrastinate_sys", "ProcrastinateSystem"),
    "dbos": ("systems.dbos_sys", "DbosSystem"),
    "huey": ("systems.huey_sys", "HueySystem"),
    "bare-sqlite": ("systems.bare_sys", "BareSqlite"),
    "bare-pg": ("systems.bare_sys", "BarePg"),
}


def system_class(name: str) -> Any:
    module, cls = SYSTEMS[name]
    return getattr(importlib.import_module(module), cls)
