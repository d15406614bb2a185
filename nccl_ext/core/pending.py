"""A result a rank is waiting for, with the deadline that bounds the wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nccl_ext.core.errors import CommDeadlineError
from nccl_ext.core.ranklist import short_ranks  # noqa: F401 - its callers import it from here too


LIMIT_KEY = "comm.timeout_s"
"""The config key of every communication deadline (the plan's ``timeout_s``)."""


def timeout_seconds(timeout) -> float | None:
    """A caller's timeout in seconds: a ``timedelta`` or a number; None for none (None, or
    zero: torch's ``kNoTimeout``, which C++ callers pass for "the backend's default")."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return s if s > 0 else None


class Pending:
    """One outstanding op: completed by a transport, observed by the process group."""

    __slots__ = ("what", "where", "deadline", "timeout_s", "op_id", "waiting_for", "after_apply", "apply_stream",
                 "device_done", "defer", "_event", "_value",
                 "_error", "_callbacks", "_lock")

    def __init__(self, what: str, timeout_s: float, op_id: int = -1):
        self.what = what
        """Names the logical rank, the op, its group and sequence number (every error says it)."""
        self.where: dict = {}
        """The same as fields (``rank``, ``group``, ``op``, ``seq``), set by the process group
        that issued the op: every :class:`CommError` this op raises carries them."""
        self.op_id = op_id
        """The transport's id of this op (-1: none)."""
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.waiting_for = ""
        """What the op waits for besides the program (e.g. the assistant's message), if the
        transport says: named when the op misses its deadline."""
        self.after_apply: Callable[[], None] | None = None
        """Set by a transport whose results are computed on a stream of its own: waits for that
        stream once the results are in the caller's tensors (the process group calls it before
        it wakes the caller). Its results are valid only until the transport's next op."""
        self.apply_stream = None
        """Set by a transport whose results lie on a CUDA stream of its own: the results are
        written into the caller's tensors on that stream (whichever thread completes the op)."""
        self.device_done = None
        """A CUDA event after which the results are in the caller's tensors, where nothing on the
        CPU waited for them: the stream that waits for the op waits for this event on the GPU."""
        self.defer = None
        """Set by a transport that can make the caller's stream wait for the op on the GPU:
        ``defer()`` does so and says whether it did (the wait then returns at once)."""
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

    @property
    def error(self) -> BaseException | None:
        """Why the op failed (None: it has not, or not yet)."""
        return self._error

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

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done, the op's deadline or ``timeout_s`` (the caller's own limit) passes,
        whichever comes first; whether it is done. Past the deadline the op fails."""
        remaining = self.deadline - time.monotonic()
        if timeout_s is not None and timeout_s < remaining:
            return self._event.wait(max(timeout_s, 0.0))
        if not self._event.wait(max(remaining, 0.0)):
            self.fail(self.deadline_error())
        return True

    def result(self) -> Any:
        """Wait until done or the deadline passes; raise the op's error if it failed."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def check_deadline(self, now: float) -> None:
        if not self._event.is_set() and now > self.deadline:
            self.fail(self.deadline_error())

    def _waiting(self) -> str:
        return f"; still waiting for {self.waiting_for}" if self.waiting_for else ""

    def deadline_error(self) -> CommDeadlineError:
        return CommDeadlineError(
            f"deadline exceeded: {self.what}: not complete after {self.timeout_s:g} s{self._waiting()} "
            f"({LIMIT_KEY}; raise it with {LIMIT_KEY}= if the peer is only slow)", **self.where)

    def timeout_error(self, timeout_s: float, by: str = "Work.wait(timeout=)") -> CommDeadlineError:
        """The caller's own limit passed first (the op stays outstanding until its deadline)."""
        return CommDeadlineError(
            f"timed out: {self.what}: not complete within the caller's timeout of {timeout_s:g} s ({by})"
            f"{self._waiting()}; the op's own deadline is {LIMIT_KEY}={self.timeout_s:g}", **self.where)
