"""Every exception workpool raises, under one root, ``WorkpoolError``."""

from __future__ import annotations


class WorkpoolError(Exception):
    """A workpool error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidArgumentError(WorkpoolError, ValueError):
    """An argument has a value workpool cannot accept."""


class InvalidTypeError(WorkpoolError, TypeError):
    """An argument has a type workpool cannot accept."""


class NotRegisteredError(InvalidArgumentError):
    """The function is not registered in this App."""


class PayloadTooLargeError(InvalidArgumentError):
    """Serialised args or context exceed the size limit."""


class StoreError(WorkpoolError, RuntimeError):
    """The store could not complete the operation."""


class StoreUnavailableError(StoreError):
    """The database cannot be reached."""


class NonRetryableError(Exception):
    """Raised by user code to fail the work now, without further retries.

    Any exception with an attribute ``workpool_non_retryable = True`` counts too,
    so the flag survives re-raising across library boundaries.
    """

    workpool_non_retryable = True


def show(value: object, limit: int = 80) -> str:
    """A short repr for error messages that never raises (huge ints, broken __repr__)."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_non_retryable(exc: BaseException) -> bool:
    return bool(getattr(exc, "workpool_non_retryable", False))


def describe_error(exc: BaseException) -> str:
    """The error text a ``Failed`` result carries: the message, else the class name.

    Never raises (a broken ``__str__`` gives a placeholder) and carries no NUL
    character, which PostgreSQL text cannot store.
    """
    try:
        text = str(exc)
    except Exception:
        text = "<the exception's message could not be read>"
    text = text.replace("\x00", "\\x00")
    if isinstance(exc, NonRetryableError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
