"""Context switching of capture ranks: execution slots, and admission by device memory."""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection

from nccl_ext.core import protocol, wire
from nccl_ext.core.protocol import Alive, Free, Go
from nccl_ext.core.ranklist import short_ranks


class SlotScheduler:
    """Context switching of capture ranks: at most ``slots`` ranks run at once.

    A rank gets a slot when it connects; it hands the slot back when it blocks on an op
    that is not complete yet (``park``), and joins the ready queue (FIFO) once the op it
    blocked on is answered. A ``parker`` (e.g. the CUDA checkpoint parker) may move a
    parked rank's device state to host memory and bring it back before the rank resumes.

    A rank that blocks somewhere the prism group cannot see (not in a ``Work.wait``) keeps
    its slot; if nothing at all happens for ``stall_s`` while ranks are ready, one more slot
    is opened (with a warning) rather than letting the capture deadlock.
    """

    def __init__(self, slots: int | None, *, parker=None, stall_s: float = 30.0,
                 admission: MemoryAdmission | None = None, heartbeat_s: float = 5.0, expected: int = 0,
                 gather_s: float = 120.0):
        self.slots = slots if slots and slots > 0 else None
        self.parker = parker
        self.stall_s = stall_s
        self.admission = admission
        """Admits a rank to its first slot only while the device's memory holds it beside the
        ranks already admitted (None: slots alone decide)."""
        self.heartbeat_s = heartbeat_s
        self._last_beat = time.monotonic()
        self._started: set[int] = set()
        self.expected = expected
        """Ranks that will connect (admission waits for them, up to ``gather_s``, before the first starts)."""
        self.gather_s = gather_s
        self._first_hello = float("inf")
        self._awaited: set[int] = set()
        self.extra = 0
        self._exiting: dict[int, int] = {}
        """Ranks that ended whose processes still hold device memory: rank -> pid."""
        self._conn: dict[int, Connection] = {}
        self._pid: dict[int, int] = {}
        self.running: set[int] = set()
        self.ready: deque[int] = deque()
        self._parked_on: dict[int, int] = {}
        self._outstanding: dict[int, set[int]] = {}
        self._last_progress = time.monotonic()
        self.max_running = 0
        self.switches = 0
        """How many times a parked rank was resumed."""
        self.unparked_at: float | None = None
        """When every expected rank had started with a slot to spare for each (:meth:`_unpark`)."""

    @property
    def capacity(self) -> int | None:
        return None if self.slots is None else self.slots + self.extra

    def arrive(self, rank: int, pid: int, conn: Connection) -> None:
        self._conn[rank], self._pid[rank] = conn, pid
        self._first_hello = min(self._first_hello, time.monotonic())
        self._outstanding[rank] = set()
        # ranks that have not run yet start in rank order (a broadcast's root, the lowest rank of
        # its group, then runs before the members that wait for its payload)
        i = len(self.ready)
        while i > 0 and self.ready[i - 1] not in self._started and self.ready[i - 1] > rank:
            i -= 1
        self.ready.insert(i, rank)
        self._progress()

    def issued(self, rank: int, op_id: int) -> None:
        if op_id >= 0:
            self._outstanding.setdefault(rank, set()).add(op_id)
        self._progress()

    def answered(self, rank: int, op_id: int) -> None:
        self._outstanding.get(rank, set()).discard(op_id)
        if self._parked_on.get(rank) == op_id:
            del self._parked_on[rank]
            self.ready.append(rank)
        self._progress()

    def park(self, rank: int, op_id: int) -> None:
        if op_id not in self._outstanding.get(rank, ()):
            # answered while the park message was in flight (a carried broadcast's root is
            # answered at once): the rank is not blocked and keeps its slot. Handing the slot
            # on here made every admitted rank look blocked at each of its broadcasts, so the
            # deadlock guard started one more rank each time, past the device's memory.
            self._grant(rank)
            self._progress()
            return
        self.running.discard(rank)
        self._parked_on[rank] = op_id
        if self.parker is not None:
            self.parker.parked(rank, self._pid[rank])
        self._progress()

    def _grant(self, rank: int) -> None:
        conn = self._conn.get(rank)
        if conn is None:
            return
        try:
            wire.send(conn, protocol.encode(Go()))
        except OSError:
            self.gone(rank)

    def awaits(self, rank: int) -> None:
        """A parked rank waits for ``rank`` (the source of a broadcast's payload)."""
        self._awaited.add(rank)

    def _unblocking(self) -> int | None:
        """The ready rank to start when every admitted rank is blocked: one they wait for; None
        while such a rank has not connected yet (it will: starting another would not help)."""
        for r in self.ready:
            if r in self._awaited and r not in self._started:
                return r
        if any(r not in self._started and r not in self._conn for r in self._awaited):
            return None
        return self.ready[0]

    def gone(self, rank: int) -> None:
        if self.admission is not None:
            # its device memory is free once its process has exited, not when it said goodbye:
            # a Megatron rank tears down for seconds after its last op, holding its whole peak
            # (five finished ranks at 21 GiB each ran a Llama-3-8B-shaped capture out of memory)
            pid = self._pid.get(rank)
            if pid is None or _exited(pid):
                self.admission.release(rank)
            else:
                self._exiting[rank] = pid
        self.running.discard(rank)
        self._parked_on.pop(rank, None)
        self._conn.pop(rank, None)
        if self.parker is not None:
            self.parker.gone(rank)
        self._progress()

    def _progress(self) -> None:
        self._last_progress = time.monotonic()

    def _reap(self) -> None:
        """Release the device memory of ranks whose processes have exited since they ended."""
        for rank, pid in list(self._exiting.items()):
            if _exited(pid):
                del self._exiting[rank]
                self.admission.release(rank)
                self._progress()

    def schedule(self) -> None:
        cap = self.capacity
        if self._exiting:
            self._reap()
        if self.admission is not None and not self._started and len(self._conn) < self.expected \
                and time.monotonic() - self._first_hello < self.gather_s:
            return  # admission starts ranks in rank order: wait until they have all connected
        if self.admission is not None and not self._started:
            self.admission.refresh()  # once: the waiting ranks' own memory (CUDA contexts) is now in use
        while self.ready and (cap is None or len(self.running) < cap):
            # a started rank that can resume goes before ranks that have not started (those need
            # room on the device; it already has its memory)
            rank = next((r for r in self.ready if r in self._started), self.ready[0])
            # the device cannot hold it yet: it starts when an admitted rank ends — unless every
            # admitted rank is blocked on a peer (none runs), when waiting would never end: then
            # the rank they wait for starts first (a broadcast's root), or else the next one
            if rank not in self._started and self.admission is not None and not self.admission.admit(rank):
                if self.running or self._exiting:  # memory comes free when they end or exit
                    break
                rank = self._unblocking()
                if rank is None:
                    break
                self.admission.admit(rank, force=True)
            self.ready.remove(rank)
            conn = self._conn.get(rank)
            if conn is None:
                continue
            self._started.add(rank)
            if self.parker is not None:
                self.parker.resume(rank, self._pid[rank], running=self.running)
            self.running.add(rank)
            self.switches += 1
            self.max_running = max(self.max_running, len(self.running))
            self._grant(rank)
        self._unpark()
        now = time.monotonic()
        if now - self._last_beat > self.heartbeat_s:  # ranks waiting for a slot know the coordinator lives
            self._last_beat = now
            for rank in self.ready:
                conn = self._conn.get(rank)
                if conn is not None:
                    try:
                        wire.send(conn, protocol.encode(Alive()))
                    except OSError:
                        pass
        if self.admission is not None and self.admission.waiting:
            self._progress()  # waiting for memory is progress being made elsewhere, not a stall
        if self.ready and cap is not None and time.monotonic() - self._last_progress > self.stall_s:
            import warnings

            self.extra += 1
            self._progress()
            warnings.warn(
                f"capture: ranks {sorted(self.running)} hold every slot and none communicated for "
                f"{self.stall_s:g}s while ranks {short_ranks(self.ready)} are ready; opening slot #{self.capacity} "
                "(a rank may be blocked outside a prism wait)", stacklevel=2)

    def _unpark(self) -> None:
        """Once every expected rank has started and the slots hold them all, a slot handed back
        would never go to another rank: tell the ranks to stop parking (``("free",)``), which
        saves each blocking wait two messages and the trip for its ``go``."""
        cap = self.capacity
        if self.unparked_at is not None or not self.expected or len(self._started) < self.expected \
                or (cap is not None and cap < self.expected) or self.ready:
            return
        self.unparked_at = time.monotonic()
        for rank, conn in list(self._conn.items()):
            try:
                wire.send(conn, protocol.encode(Free()))
            except OSError:
                self.gone(rank)

    def close(self) -> None:
        if self.parker is not None:
            self.parker.close()


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie has: the driver freed its device memory when
    its files closed). Without /proc (not Linux) every process counts as exited."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no such process (reaped), or no /proc
        return True
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


class MemoryAdmission:
    """Which capture ranks may be on the device together.

    A rank's need is its measured peak (reserved by the caching allocator, reported when it
    ends) plus ``overhead`` (its CUDA context and libraries); a rank not measured yet is
    expected to need the largest peak measured so far. Until a first rank has been measured,
    one rank is admitted at a time (the probe). ``budget`` is the device memory free when the
    capture began, per GPU; a rank goes to GPU ``gpu_of(rank)``."""

    def __init__(self, budget: list[int], gpu_of, overhead: int = 1 << 30, free=None, fraction: float = 1.0):
        self.budget = list(budget)
        self.gpu_of = gpu_of
        self.overhead = overhead
        self.free = free
        """Reads each GPU's free bytes now (None: the budget stays as given); :meth:`refresh`
        uses it once every rank has connected and before the first starts."""
        self.fraction = fraction
        self._refreshed = False
        self.measured: dict[int, int] = {}
        self.admitted: dict[int, int] = {}
        """rank -> bytes set aside for it."""
        self.waiting = False
        self.max_admitted = 0
        self.forced = 0
        """Ranks started beyond the budget because every admitted rank was blocked on a peer."""

    def refresh(self) -> None:
        """Lower the budget to what is free now, once. Ranks that connected before their first
        slot already hold memory of their own (a CUDA context: ~0.5 GiB each on an H200 with torch
        2.11), which the budget read before they started does not count: 32 waiting ranks take
        ~16 GiB of the card."""
        if self._refreshed or self.free is None:
            return
        self._refreshed = True
        now = self.free()
        if now and len(now) == len(self.budget):
            self.budget = [min(b, int(f * self.fraction)) for b, f in zip(self.budget, now)]

    def need(self, rank: int) -> int | None:
        if rank in self.measured:
            return self.measured[rank] + self.overhead
        if not self.measured:
            return None
        return max(self.measured.values()) + self.overhead

    def admit(self, rank: int, force: bool = False) -> bool:
        """Whether ``rank`` may start now (``force``: it must, every admitted rank is blocked)."""
        gpu = self.gpu_of(rank) % len(self.budget)
        on_gpu = [r for r in self.admitted if self.gpu_of(r) % len(self.budget) == gpu]
        need = self.need(rank)
        if need is None:
            ok = not on_gpu  # the probe: one rank until a peak is known
            need = 0
        else:
            ok = not on_gpu or sum(self.admitted[r] for r in on_gpu) + need <= self.budget[gpu]
        if force and not ok:
            ok = True
            self.forced += 1
        self.waiting = not ok
        if ok:
            self.admitted[rank] = need
            self.max_admitted = max(self.max_admitted, len(self.admitted))
        return ok

    def report(self, rank: int, summary: dict) -> None:
        """A rank's memory summary (peak reserved bytes on CUDA)."""
        peak = summary.get("peak_reserved_bytes") or summary.get("peak_bytes")
        if peak:
            self.measured[rank] = int(peak)
            if rank in self.admitted:
                self.admitted[rank] = int(peak) + self.overhead

    def release(self, rank: int) -> None:
        self.admitted.pop(rank, None)

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget, "budget_refreshed": self._refreshed, "overhead_bytes": self.overhead, "max_admitted": self.max_admitted,
                "forced": self.forced,
                "measured_peaks": {str(r): p for r, p in sorted(self.measured.items())}}


def free_gpu_memory() -> list[int] | None:
    """Free bytes of every visible GPU, from ``nvidia-smi`` (the launcher itself never creates a
    CUDA context: its ranks are forked from it); None when it cannot tell."""
    import os
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    free = {int(i): int(f) << 20 for i, f in (line.split(",") for line in out.strip().splitlines() if "," in line)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        try:
            return [free[int(v)] for v in visible.split(",") if v.strip()]
        except (KeyError, ValueError):
            return None
    return [free[i] for i in sorted(free)] or None
