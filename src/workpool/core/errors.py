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


def is_non_retryable(exc: BaseException) -> bool:
    return bool(getattr(exc, "workpool_non_retryable", False))


def describe_error(exc: BaseException) -> str:
    """The error text a ``Failed`` result carries: the message, else the class name."""
    text = str(exc)
    if isinstance(exc, NonRetryableError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
