"""Group commit for callers on different threads: their small writes share one transaction."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from workpool.core.errors import StoreUnavailableError
from workpool.store.base import Store, Tx

T = TypeVar("T")

# Bodies one transaction takes at most: enough for every thread of a busy web
# server, few enough that the first caller in it does not wait long for the rest.
MAX_BODIES = 64


_QUEUED, _DONE, _LEAD, _ALONE = range(4)


class _Call(Generic[T]):
    """One caller's body and, once a transaction ended, what its caller is to do."""

    __slots__ = ("body", "error", "ready", "state", "value")

    def __init__(self, body: Callable[[Tx], T]) -> None:
        self.body = body
        self.ready = threading.Event()
        self.state = _QUEUED  # then _DONE (value or error), _LEAD or _ALONE
        self.value: Any = None
        self.error: StoreUnavailableError | None = None

    def wake(
        self, state: int, value: Any = None, error: StoreUnavailableError | None = None
    ) -> None:
        self.state, self.value, self.error = state, value, error
        self.ready.set()


class Combiner:
    """Runs the write bodies of concurrent callers in one store transaction.

    A caller that finds nobody writing runs its body at once, in a transaction of
    its own: alone, it waits for no one. Callers that arrive while that transaction
    is open queue; when it ends, the first of them leads the next transaction with
    every body queued behind it, so N threads enqueueing one job each take about one
    turn at the store's write lock and one commit a round, not N (used where the
    store's ``combines_writes`` says so: SQLite, whose file lock admits one writer
    at a time anyway, and whose commit writes each changed page to the log).

    Bodies must be independent: none may read what another writes, and each must be
    safe to run again (``Store.run`` retries a transient failure whole). If the
    shared transaction fails otherwise, each body runs again in a transaction of its
    own on its caller's thread, so an error reaches only the caller it belongs to.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        # Who has the open transaction: a queued call woken to lead, a token of a
        # caller that found nobody writing, or None. A hand-over by anyone else is
        # void, so a caller interrupted at any point hands over at most once.
        self._leader: object | None = None
        self._queue: deque[_Call[Any]] = deque()  # callers waiting for the next one

    def run(self, body: Callable[[Tx], T]) -> T:
        """``body``'s value, after the transaction that ran it committed."""
        call: _Call[T] | None = None
        token: object | None = None
        try:
            with self._lock:
                if self._leader is None:
                    token = object()
                    self._leader = token
                else:
                    call = _Call(body)
                    self._queue.append(call)
            if call is None:  # nobody was writing, so nobody is queued: no batch to gather
                return self._store.run(body)
            call.ready.wait()
            if call.state == _LEAD:
                return self._lead(call)
        except BaseException:
            if call is not None:
                self._abandon(call)
            raise
        finally:
            if token is not None:
                self._handover(token)
        if call.state == _ALONE:
            return self._store.run(body)
        if call.error is not None:
            # One exception object per caller: threads raising the same one would
            # write their tracebacks into it at once.
            raise StoreUnavailableError(str(call.error)) from call.error
        return call.value  # type: ignore[no-any-return]

    def _lead(self, call: _Call[T]) -> T:
        """Run ``call``'s body and those queued behind it in one transaction."""
        batch: list[_Call[Any]] = []
        try:
            with self._lock:
                batch = [
                    self._queue.popleft() for _ in range(min(len(self._queue), MAX_BODIES - 1))
                ]
            values = self._store.run(lambda tx: [call.body(tx)] + [c.body(tx) for c in batch])
            for c, v in zip(batch, values[1:], strict=True):
                c.wake(_DONE, value=v)
            return values[0]  # type: ignore[no-any-return]
        except StoreUnavailableError as exc:
            for c in batch:
                c.wake(_DONE, error=exc)  # the store's fault, not a body's: everyone's
            raise
        except BaseException:
            if not batch:
                raise
            # A body failed the shared transaction, which rolled back whole: each
            # caller runs its own again alone, and meets its own error only.
            for c in batch:
                c.wake(_ALONE)
        finally:
            self._handover(call)
        return self._store.run(call.body)

    def _handover(self, leader: object) -> None:
        """``leader``'s transaction ended: the first caller queued leads the next."""
        with self._lock:
            if self._leader is not leader:
                return
            following = self._queue.popleft() if self._queue else None
            self._leader = following
            if following is not None:
                following.state = _LEAD
        if following is not None:
            following.ready.set()

    def _abandon(self, call: _Call[T]) -> None:
        """A queued caller leaves by an exception (interrupted while it waited, or as a
        leader): still queued, it leaves the queue; taken by a leader, its body runs
        anyway (nobody reads the outcome); leading, it hands that on, unless its
        transaction's end did."""
        with self._lock:
            if call in self._queue:
                self._queue.remove(call)
                return
        self._handover(call)
