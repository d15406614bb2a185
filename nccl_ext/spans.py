"""Compute spans between one rank's events, the quantity the trace and calibration record."""

from __future__ import annotations

import threading
import time


class ComputeClock:
    """Wall and CPU seconds a rank computed since its previous event.

    CPU time is the issuing thread's own (one compute thread per rank), so it is free of the
    time-slicing that distorts wall time when many logical ranks share a few cores. Time a
    rank spends blocked in a wait is the wait's, not the next span's (:meth:`resume`).
    """

    def __init__(self) -> None:
        self._last_wall = time.monotonic()
        self._last_cpu: dict[int, float] = {threading.get_ident(): time.thread_time()}

    def lap(self, until: float | None = None) -> tuple[float, float, float]:
        """``(now, wall_s, cpu_s)`` since the previous lap; ``until`` ends the span early."""
        now = until if until is not None else time.monotonic()
        cpu = time.thread_time()
        tid = threading.get_ident()
        last_cpu = self._last_cpu.get(tid, cpu)
        span = (now, now - self._last_wall, max(cpu - last_cpu, 0.0))
        self._last_wall = now
        self._last_cpu[tid] = cpu
        return span

    def resume(self, t: float) -> None:
        """The rank was blocked until ``t``; the next span starts there."""
        self._last_wall = max(self._last_wall, t)
