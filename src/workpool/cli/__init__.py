"""The ``workpool`` command line."""

from __future__ import annotations

from workpool.cli.main import main

__all__ = ["main"]
