"""Compute spans between one rank's events, the quantity the trace and calibration record."""

from __future__ import annotations

import sys
import threading
import time


class ComputeClock:
    """Wall and CPU seconds a rank computed since its previous event.

    CPU time is the issuing thread's own (one compute thread per rank), so it is free of the
    time-slicing that distorts wall time when many logical ranks share a few cores. Time a
    rank spends blocked in a wait is the wait's, not the next span's (:meth:`resume`).

    An op call's own handling, from its issue to its return to the program (:meth:`returned`),
    is the op's on CUDA (NCCL enqueues and returns): both clocks restart. On CPU a real gloo
    op is host work of the same kind on the same core, which the network model's link time
    does not cover, so the thread CPU time of the call stays in the span, on both clocks — but
    not the call's wall time beyond it: that is waiting for peers (a capture's exchange with
    its group, a sandbox's virtual peers), which the replay prices as communication. The wall
    span on CPU is then the program's compute as it ran (waiting for a core, its process's
    other threads and the machine's load included) plus the op calls' host work.
    """

    def __init__(self) -> None:
        self._last_wall = time.monotonic()
        self._last_cpu: dict[int, float] = {threading.get_ident(): time.thread_time()}
        self._op_cpu = 0.0
        """CPU seconds of op calls since the last lap whose wall time was cut (CPU :meth:`returned`)."""

    def lap(self, until: float | None = None) -> tuple[float, float, float]:
        """``(now, wall_s, cpu_s)`` since the previous lap; ``until`` ends the span early."""
        now = until if until is not None else time.monotonic()
        cpu = time.thread_time()
        tid = threading.get_ident()
        last_cpu = self._last_cpu.get(tid, cpu)
        span = (now, max(now - self._last_wall, 0.0) + self._op_cpu, max(cpu - last_cpu, 0.0))
        self._last_wall = now
        self._last_cpu[tid] = cpu
        self._op_cpu = 0.0
        return span

    def resume(self, t: float) -> None:
        """The rank was blocked until ``t``; the next span starts there."""
        self._last_wall = max(self._last_wall, t)

    def skip(self) -> None:
        """The time since the last lap was the communication layer's (an op's own handling, up to
        its return to the program): the next span starts now, on both clocks."""
        self._last_wall = time.monotonic()
        self._last_cpu[threading.get_ident()] = time.thread_time()
        self._op_cpu = 0.0

    def returned(self, on_device: bool) -> None:
        """An op call returns to the program (the previous lap was its issue). ``on_device``
        (CUDA): :meth:`skip`. On CPU: the call's thread CPU time stays in the span on both
        clocks, its wall time beyond that does not (see the class docstring)."""
        if on_device:
            self.skip()
            return
        now, cpu = time.monotonic(), time.thread_time()
        self._op_cpu += max(cpu - self._last_cpu.get(threading.get_ident(), cpu), 0.0)
        self._last_wall = now


class DeviceClock:
    """The same spans on the GPU's own timeline: a CUDA event on the program's stream at each of
    the rank's events, and at the start of each wait and the end of it.

    Wall time between events is the CPU's: where the CPU runs ahead of the GPU (a step issued
    faster than it runs), the GPU's backlog drains inside whichever op first synchronizes — a
    wait — and leaves the spans short; where the program synchronizes between ops, the spans
    are right. A real job's step lasts as long as its stream's timeline, so on CUDA the span is
    the time between two events as the GPU reached them (kernels, and idle time while the CPU
    had not yet issued work). The interval from a wait's start to the program's resumption is
    the op's, as on the CPU clock. Spans before the process used CUDA have none (None)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._start = None
        self._wait_start = None
        self._pairs: list[tuple[object, object]] = []
        self.seconds: list[float | None] = []
        """One per span so far (resolved at :meth:`resolve`)."""

    def active(self) -> bool:
        """Whether this process uses CUDA (its spans have a device timeline)."""
        return self._torch.cuda.is_initialized()

    def _event(self):
        cuda = self._torch.cuda
        if not cuda.is_initialized():
            return None
        e = cuda.Event(enable_timing=True)
        e.record()
        return e

    def wait_starts(self) -> None:
        """The program is about to block on an op: the span before the wait ends here."""
        self._wait_start = self._event()

    def lap(self, waited: bool = False) -> None:
        end = self._wait_start if waited and self._wait_start is not None else self._event()
        self._wait_start = None
        self._pairs.append((self._start, end))
        self._start = end

    def resume(self) -> None:
        """The program continues after a wait: the next span starts here."""
        self._start = self._event()

    def resolve(self, block: bool = True) -> list[float | None]:
        """Turn the events so far into seconds: all of them, waiting for the GPU to reach the last
        (``block``), or those the GPU has already passed (a step boundary: the program is not
        held back)."""
        done = 0
        for s, e in self._pairs:
            if e is not None:
                if not block and not e.query():
                    break  # events follow the program's order: the rest are not reached either
                e.synchronize()
            self.seconds.append(_elapsed_s(s, e))
            done += 1
        del self._pairs[:done]
        return self.seconds


def _elapsed_s(start, end) -> float | None:
    if start is None or end is None:
        return None
    try:
        start.synchronize()
        return max(0.0, start.elapsed_time(end)) / 1e3
    except RuntimeError:  # events of different devices (the program switched GPUs between them)
        return None


class DeviceTimedClock(ComputeClock):
    """A capture rank's clock: the host's spans (:class:`ComputeClock`, sent with every event)
    and, once the process uses CUDA, the same spans on the GPU's timeline (:class:`DeviceClock`),
    sent at the rank's close (:meth:`device_seconds`) — so a prediction on CUDA never needs the
    host's time. The span before a wait ends where the wait starts (:meth:`wait_starts`)."""

    RESOLVE_EVERY = 512
    """Events resolved (the ones the GPU has passed, without blocking) every this many spans."""

    def __init__(self) -> None:
        super().__init__()
        self.device = DeviceClock()
        self._laps = 0

    def lap(self, until: float | None = None) -> tuple[float, float, float]:
        span = super().lap(until)
        self.device.lap(waited=until is not None)
        self._laps += 1
        if self._laps % self.RESOLVE_EVERY == 0:
            self.device.resolve(block=False)  # bounded pending events; the program is not held back
        return span

    def wait_starts(self) -> None:
        self.device.wait_starts()

    def resume(self, t: float) -> None:
        super().resume(t)
        self.device.resume()

    def skip(self) -> None:
        super().skip()
        self.device.resume()

    def device_seconds(self) -> list[float | None] | None:
        """Seconds of every span on the GPU's timeline (None where a span had none: before the
        process used CUDA), or None where the process never used CUDA or the GPU failed."""
        if not self.device.active():
            return None
        try:
            return [None if s is None else round(s, 7) for s in self.device.resolve()]
        except Exception as e:  # noqa: BLE001 - a failed GPU leaves the host clocks
            print(f"prism: no device-timeline spans ({type(e).__name__}: {e})", file=sys.stderr)
            return None


class SpanRecorder:
    """One rank's compute spans on both clocks: the host's (wall, CPU) and the device's."""

    def __init__(self) -> None:
        self.clock = ComputeClock()
        self.device = DeviceClock()
        self.host: list[tuple[str, float, float]] = []
        """(event code, CPU s, wall s) per span."""

    def lap(self, code: str, until: float | None = None) -> None:
        _now, wall, cpu = self.clock.lap(until)
        self.device.lap(waited=code == "w" and until is not None)
        self.host.append((code, cpu, wall))

    def wait_starts(self) -> None:
        self.device.wait_starts()

    def waited(self, t0: float | None, t1: float | None) -> None:
        """The program waited on an op from ``t0`` to ``t1`` (None: it was done already)."""
        self.lap("w", until=t0)
        if t1 is not None:
            self.clock.resume(t1)
            self.device.resume()

    def returned(self) -> None:
        """An op call returns to the program. On CUDA its handling here was the op's time (the real
        backend, NCCL, enqueues and returns; this layer's host path synchronizes and copies); on CPU
        its thread CPU time stays in the span (a real gloo op is host work of the same kind on the
        same core, which the network model's link time does not cover: two-rank dense CPU job,
        -18.4% mean error with it left out) and its wall time beyond that does not (waiting for
        peers is the replay's communication: :meth:`ComputeClock.returned`)."""
        active = self.device.active()
        self.clock.returned(active)
        if active:
            self.device.resume()

    def step(self) -> None:
        self.device.resolve(block=False)  # the events the GPU has passed: a step's, not the run's

    def rows(self, rank: int) -> list[tuple]:
        """(code, CPU s, wall s, device s or None) per span."""
        try:
            device = self.device.resolve()
        except Exception as e:  # noqa: BLE001 - a failed GPU leaves the host clocks
            print(f"prism: rank {rank}: no device-timeline spans ({type(e).__name__}: {e})", file=sys.stderr)
            device = []
        return [(*sp, device[i] if i < len(device) else None) for i, sp in enumerate(self.host)]


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's threads so far, by name (the Python thread's name where
    one owns the OS thread, else the OS's name, e.g. the CUDA driver's), summed per name; {}
    where ``/proc`` has no task list. Where a rank's CPU time goes, beside its wall time."""
    import os

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid), comm)
        out[name] = round(out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick, 2)
    return out
