"""A result a rank is waiting for, with the deadline that bounds the wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class CommDeadlineError(RuntimeError):
    """A communication op did not complete before its deadline."""


class Pending:
    """One outstanding op: completed by a transport, observed by the process group."""

    __slots__ = ("what", "deadline", "op_id", "_event", "_value", "_error", "_callbacks", "_lock")

    def __init__(self, what: str, timeout_s: float, op_id: int = -1):
        self.what = what
        self.op_id = op_id
        """The transport's id of this op (-1: none)."""
        self.deadline = time.monotonic() + timeout_s
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Pending], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def done(cls, what: str, value: Any = None) -> Pending:
        p = cls(what, 0.0)
        p.complete(value)
        return p

    @property
    def is_done(self) -> bool:
        return self._event.is_set()

    @property
    def succeeded(self) -> bool:
        """Completed with a value (not failed, not outstanding)."""
        return self._event.is_set() and self._error is None

    def complete(self, value: Any) -> None:
        self._finish(value, None)

    def fail(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._value, self._error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Pending], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def release(self) -> None:
        """Drop the result once it has been consumed, so its tensors are freed as soon as a
        real backend's would be (the handle may outlive them in the program)."""
        self._value = None

    def result(self) -> Any:
        """Wait until done or the deadline passes; raise the op's error if it failed."""
        remaining = self.deadline - time.monotonic()
        if not self._event.wait(max(remaining, 0.0)):
            self.fail(CommDeadlineError(f"deadline exceeded: {self.what}"))
        if self._error is not None:
            raise self._error
        return self._value

    def check_deadline(self, now: float) -> None:
        if not self._event.is_set() and now > self.deadline:
            self.fail(CommDeadlineError(f"deadline exceeded: {self.what}"))
