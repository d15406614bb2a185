"""The threads a transport runs beside the program, ended before Python finalizes.

A helper thread that is still dropping tensors when the interpreter finalizes aborts the
process: a tensor's C++ destructor takes the GIL, Python ends a non-main thread that asks
for the GIL after finalization began (``pthread_exit``), and that forced unwind through a
``noexcept`` destructor calls ``std::terminate`` ("terminate called without an active
exception", SIGABRT) — after the program itself had finished. A transport therefore starts
its threads through :class:`HelperThreads` and calls :meth:`HelperThreads.stop` from its
``close()``, which runs before finalization (the rank's ``finally`` or an ``atexit``
handler): threads of finished work are joined, timers not yet due are cancelled.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from nccl_ext.core.errors import CommDeadlineError, PeerClosedError, first_line
from nccl_ext.core.pending import LIMIT_KEY, Pending

CLOCK_SLACK_S = 0.25
"""A backend's wait given what remained of an op's deadline that fails this close to it
(or past it) ran out of time: its clock and ours differ by a moment."""

GRACE_S = 2.0
"""How long a thread of an op still outstanding at ``stop`` (one the program never waited
for) may take to end before it is reported as in flight."""


@dataclass(slots=True)
class _Helper:
    thread: threading.Thread
    what: str
    pending: Pending | None
    timer: bool


class HelperThreads:
    """Daemon threads started for ops (one per op where a wait cannot be shared), joined by
    :meth:`stop`. The registry keeps every started thread until it is seen ended; a thread
    drops its own references (its target, its timer's arguments) when its work ends, as a
    real backend frees an op's buffers when the op completes, and :meth:`stop` joins it
    before finalization, so none is dropped by a thread while Python finalizes."""

    def __init__(self, owner: str):
        self.owner = owner
        self.started = 0
        self._lock = threading.Lock()
        self._live: list[_Helper] = []
        self._prune_at = 64
        self._stopped = False

    def start(self, target: Callable[[], None], *, name: str, what: str = "",
              pending: Pending | None = None) -> None:
        """Run ``target`` on a new daemon thread; ``pending``: the op it completes (a thread of
        an op still outstanding at :meth:`stop` gets only a short grace)."""
        what = what or (pending.what if pending is not None else name)
        self._add(threading.Thread(target=target, name=name, daemon=True), what, pending, timer=False)

    def after(self, delay_s: float, fn: Callable, *args, what: str = "", pending: Pending | None = None) -> None:
        """Call ``fn(*args)`` on a daemon timer thread in ``delay_s`` seconds (cancelled by
        :meth:`stop` if not yet due)."""
        box = [args]

        def fire() -> None:  # a Timer keeps its args after it fires: drop them, so the op's results
            fn(*box.pop())   # are freed when the program drops them, not when the timer is pruned

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        timer.name = f"prism-timer-{self.owner}"
        self._add(timer, what or timer.name, pending, timer=True)

    def _add(self, thread: threading.Thread, what: str, pending: Pending | None, *, timer: bool) -> None:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self.owner}: {what}: helper threads already stopped (transport closed)")
            if len(self._live) >= self._prune_at:
                self._live = [h for h in self._live if h.thread.is_alive()]
                self._prune_at = max(64, 2 * len(self._live))
            self._live.append(_Helper(thread, what, pending, timer))
            self.started += 1
        thread.start()

    def stop(self, deadline_s: float, grace_s: float = GRACE_S) -> list[str]:
        """Cancel timers not yet due and join every thread: those of completed ops (or with no
        op) for up to ``deadline_s`` in all, those of ops still outstanding or failed (a wait
        past its deadline may still be blocked in the backend) for up to ``grace_s``. Returns
        what each thread still running after that was for (empty when all ended); idempotent."""
        with self._lock:
            self._stopped = True
            helpers, self._live = self._live, []
        for h in helpers:
            if h.timer:
                h.thread.cancel()  # type: ignore[attr-defined]
        now = time.monotonic()
        end, end_grace = now + deadline_s, now + min(grace_s, deadline_s)
        left: list[str] = []
        for h in helpers:
            outstanding = h.pending is not None and not h.pending.succeeded and not h.timer
            h.thread.join(max(0.0, (end_grace if outstanding else end) - time.monotonic()))
            if h.thread.is_alive():
                left.append(h.what)
        return left

    def running(self) -> int:
        with self._lock:
            return sum(h.thread.is_alive() for h in self._live)


def wait_works(works: list, pending: Pending) -> None:
    """Wait for c10d works (gloo send/recv: no future to chain on) until ``pending``'s deadline,
    every one of them even after one failed (a work is never dropped with its transfer posted);
    the works are cleared (they hold the sent tensors). Raises :class:`CommDeadlineError` past
    the deadline, else the peer's own error, each naming the op and what it waited for
    (``pending.waiting_for``)."""
    t0, error = time.monotonic(), None
    for w in works:
        try:
            w.wait(datetime.timedelta(seconds=max(pending.deadline - time.monotonic(), 1e-3)))
        except Exception as e:  # noqa: BLE001 - gloo raises its own error types
            error = error or e
    works.clear()
    if error is None:
        return
    text = first_line(error)
    of = pending.waiting_for or "the exchange with the other sandbox ranks"
    # gloo waited for what remained of the deadline: its timeout is the deadline's, though its
    # clock may end it a moment before ours (gloo's timeout has no error type of its own: the
    # clock tells it from a closed connection)
    if time.monotonic() >= pending.deadline - CLOCK_SLACK_S:
        raise CommDeadlineError(
            f"deadline exceeded: {pending.what}: waiting {time.monotonic() - t0:.1f} s for {of} failed: {text} "
            f"({LIMIT_KEY}={pending.timeout_s:g}; raise it with {LIMIT_KEY}= if the peer is only slow)") from error
    raise PeerClosedError(f"{pending.what}: waiting for {of} failed after {time.monotonic() - t0:.1f} s: {text} (the "
                          "peer's process ended or closed its connection: see its log)") from error


__all__ = ["HelperThreads", "wait_works"]
