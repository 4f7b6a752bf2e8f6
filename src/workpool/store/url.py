"""Parse a store URL (SQLAlchemy form) and open the matching store."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from workpool.core.errors import InvalidArgumentError, InvalidTypeError
from workpool.store.base import Store


def whole_number(url: str, name: str, text: str, low: int, *, other: str = "") -> int:
    """The value of URL option ``name``: ASCII digits only (``int()`` would take
    " 5", "+5" or "1_0"), at least ``low``; else a clear error naming it and what
    else it may be (``other``)."""
    if not (text.isascii() and text.isdigit() and int(text) >= low):
        raise InvalidArgumentError(
            f"{name}={text!r} in {url!r} must be a whole number, {low} or more{other}"
        )
    return int(text)


def open_store(url: object, *, schema: str | None = None) -> Store:
    if not isinstance(url, str):
        raise InvalidTypeError(f"the database URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme == "sqlite":
        from workpool.store.sqlite import SqliteStore
        from workpool.store.sqlite.store import MMAP_BYTES

        # sqlite:///relative.db -> "relative.db"; sqlite:////abs/path.db -> "/abs/path.db"
        path = url[len("sqlite://") :].split("?", 1)[0]
        if not path.startswith("/") or path == "/":
            raise InvalidArgumentError(
                f"SQLite URL {url!r} has no file path; use sqlite:///relative.db"
                " or sqlite:////absolute/path.db"
            )
        mmap_size = whole_number(url, "mmap_size", query.get("mmap_size", str(MMAP_BYTES)), 0)
        return SqliteStore(
            path[1:], synchronous=query.get("synchronous", "NORMAL"), mmap_size=mmap_size
        )
    if parts.scheme in ("postgresql", "postgres") or parts.scheme.startswith("postgresql+"):
        from workpool.store.postgres import PostgresStore

        return PostgresStore(url, schema=schema or query.get("schema") or "workpool")
    raise InvalidArgumentError(
        f"unsupported database URL {url!r}: expected sqlite:///path.db or postgresql://…"
    )
