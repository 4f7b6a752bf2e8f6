"""The registry of an App's functions: the only things a worker will ever call."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workpool.core.errors import InvalidArgumentError, InvalidTypeError, NotRegisteredError, show
from workpool.core.validation import check_fn_name
from workpool.store.base import FnKind


@dataclass(frozen=True, slots=True)
class FnSpec:
    name: str
    kind: FnKind
    fn: Callable[..., Any]
    is_async: bool


class Registry:
    def __init__(self) -> None:
        self._by_name: dict[str, FnSpec] = {}
        self._by_fn: dict[Callable[..., Any], FnSpec] = {}

    def register(self, fn: Callable[..., Any], kind: FnKind, name: str | None) -> FnSpec:
        if not callable(fn):
            raise InvalidTypeError(f"@app.{kind} needs a function, got {show(fn)}")
        name = check_fn_name(name if name is not None else fn.__qualname__)
        is_async = inspect.iscoroutinefunction(fn)
        if is_async and kind != "action":
            raise InvalidTypeError(
                f"{kind} {name!r} is async; mutations and queries run inside the store's"
                " transaction and must be plain functions"
            )
        existing = self._by_name.get(name)
        if existing is not None and existing.fn is not fn:
            raise InvalidArgumentError(
                f"a different function is already registered as {name!r}; pass name=..."
            )
        spec = FnSpec(name, kind, fn, is_async)
        self._by_name[name] = spec
        self._by_fn[fn] = spec
        return spec

    def lookup(self, fn: object, expected: FnKind, what: str = "function") -> FnSpec:
        """The spec of ``fn`` (function or registered name), which must be of kind ``expected``."""
        if isinstance(fn, str):
            spec = self._by_name.get(fn)
        elif callable(fn):
            try:
                spec = self._by_fn.get(fn)
            except TypeError:  # an unhashable callable cannot have been registered
                spec = None
        else:
            raise InvalidTypeError(
                f"{what} must be a registered function or its name, got {show(fn)}"
            )
        if spec is None:
            label = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
            raise NotRegisteredError(
                f"{what} {label!r} is not registered in this App; decorate it with @app.{expected}"
            )
        if spec.kind != expected:
            raise InvalidArgumentError(
                f"{what} {spec.name!r} is registered as a {spec.kind}, not a {expected}"
            )
        return spec

    def get(self, name: str) -> FnSpec | None:
        return self._by_name.get(name)
