"""The PostgreSQL store: psycopg 3 with a connection pool, SKIP LOCKED claims, LISTEN/NOTIFY."""

from __future__ import annotations

from workpool.store.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
