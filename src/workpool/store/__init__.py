"""Stores: the only package that knows SQL. ``open_store(url)`` picks the implementation."""

from __future__ import annotations

from workpool.store.base import Store, Tx
from workpool.store.url import open_store

__all__ = ["Store", "Tx", "open_store"]
