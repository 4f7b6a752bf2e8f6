"""The web dashboard: pools live, charts, failures, one item's detail, and the controls.

``create_app(workpool_app, token)`` builds the Starlette app; ``workpool
dashboard APP`` serves it with uvicorn. ``operator`` holds the views shared
with the command line, which imports it without loading the web stack (hence
the lazy ``create_app``). Every asset ships in ``static/``: no CDN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workpool.dashboard.server import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from workpool.dashboard.server import create_app

        return create_app
    raise AttributeError(f"module 'workpool.dashboard' has no attribute {name!r}")
