"""The web dashboard: pools live, charts, failures, one item's detail, and the controls.

``create_app(workpool_app, token)`` builds the Starlette app; ``workpool
dashboard APP`` serves it with uvicorn. ``operator`` holds the views shared
with the command line. Every asset ships in ``static/``: no CDN.
"""

from __future__ import annotations

from workpool.dashboard.server import create_app

__all__ = ["create_app"]
