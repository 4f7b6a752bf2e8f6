"""The embedded SQLite store: one file, WAL, ``BEGIN IMMEDIATE`` for every write."""

from __future__ import annotations

from workpool.store.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
