"""A captured rank's ops in flight: each op's id (in issue order, shared with the ops that need
an id but nothing to wait for) and its :class:`~nccl_ext.core.pending.Pending`, until the
coordinator answers it, its deadline passes, or the connection goes."""

from __future__ import annotations

import threading

from nccl_ext.core.pending import Pending


class PendingOps:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._next_id = 0

    def new(self, what: str) -> tuple[int, Pending]:
        """A new op's id and the :class:`Pending` its answer completes."""
        with self._lock:
            op_id = self._next_id
            self._next_id += 1
            p = Pending(what, self.timeout_s, op_id)
            self._pending[op_id] = p
        return op_id, p

    def next_id(self) -> int:
        """An id for an op nothing waits on (a mirrored collective, a staged send)."""
        with self._lock:
            op_id = self._next_id
            self._next_id += 1
        return op_id

    def pop(self, op_id: int) -> Pending | None:
        """Op ``op_id``'s :class:`Pending` (None: not waited on, or already answered)."""
        with self._lock:
            return self._pending.pop(op_id, None)

    def add(self, op_id: int, p: Pending) -> None:
        with self._lock:
            self._pending[op_id] = p

    def check_deadlines(self, now: float) -> None:
        with self._lock:
            pend = list(self._pending.values())
        for p in pend:
            p.check_deadline(now)

    def fail_all(self, why: str) -> None:
        """Fail every op in flight (``why``: the connection went)."""
        with self._lock:
            pend, self._pending = list(self._pending.values()), {}
        for p in pend:
            p.fail(RuntimeError(f"{p.what}: {why}"))
