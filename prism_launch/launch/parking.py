"""Parking a capture rank's GPU state in host memory while it is blocked.

The CUDA driver's checkpoint API (``cuCheckpointProcessLock`` / ``Checkpoint`` /
``Restore`` / ``Unlock``, libcuda ≥ 550, called by pid from another process) moves a
process's whole device state — allocations, contexts — to host memory and back, data
intact. The coordinator calls it on ranks it parks, so N logical ranks whose memory
together exceeds the card's take turns on it. The API refuses processes with live NCCL
communicators, IPC or UVM memory: capture traffic goes through the coordinator, never NCCL.

Policy (:class:`CudaCheckpointParker`): at most ``resident`` ranks keep device state
(running + parked-but-resident). A rank about to resume is restored first; if that would
exceed ``resident``, the parked resident rank parked *most recently* is checkpointed: ranks
blocked on the same collective resume in the order they parked, so under this cyclic pattern
the most recently parked one is needed last (LRU would evict every rank once per round).
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from prism_launch.errors import ParkingError

CU_PROCESS_STATE_RUNNING, CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_CHECKPOINTED, CU_PROCESS_STATE_FAILED = range(4)


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class CudaCheckpoint:
    """ctypes binding of the driver's process checkpoint API."""

    def __init__(self, lock_timeout_ms: int = 60_000):
        try:
            self._cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise ParkingError(f"capture.park=cuda_checkpoint needs the CUDA driver (libcuda.so.1): {e}") from None
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                     "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState"):
            if not hasattr(self._cu, name):
                raise ParkingError(f"this CUDA driver has no {name} (needs driver >= 550); use capture.park=none")
        self._check(self._cu.cuInit(0), "cuInit", -1)
        self.lock_timeout_ms = lock_timeout_ms

    def _check(self, rc: int, what: str, pid: int) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self._cu.cuGetErrorName(rc, ctypes.byref(name))
            raise ParkingError(f"{what}(pid {pid}) failed: CUresult {rc} ({(name.value or b'?').decode()})")

    def state(self, pid: int) -> int:
        st = ctypes.c_int(-1)
        self._check(self._cu.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(st)), "cuCheckpointProcessGetState", pid)
        return st.value

    def checkpoint(self, pid: int) -> None:
        args = _LockArgs(self.lock_timeout_ms, 0)
        self._check(self._cu.cuCheckpointProcessLock(ctypes.c_int(pid), ctypes.byref(args)), "cuCheckpointProcessLock", pid)
        self._check(self._cu.cuCheckpointProcessCheckpoint(ctypes.c_int(pid), None), "cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int) -> None:
        self._check(self._cu.cuCheckpointProcessRestore(ctypes.c_int(pid), None), "cuCheckpointProcessRestore", pid)
        self._check(self._cu.cuCheckpointProcessUnlock(ctypes.c_int(pid), None), "cuCheckpointProcessUnlock", pid)


@dataclass(slots=True)
class ParkStats:
    checkpoints: int = 0
    restores: int = 0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0
    max_resident: int = 0
    events: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"checkpoints": self.checkpoints, "restores": self.restores, "checkpoint_s": self.checkpoint_s,
                "restore_s": self.restore_s, "max_resident": self.max_resident}


class CudaCheckpointParker:
    """Keeps at most ``resident`` capture ranks' GPU state on the device."""

    def __init__(self, resident: int, api: CudaCheckpoint | None = None):
        self.resident = max(1, resident)
        self._api = api
        self._pid: dict[int, int] = {}
        self._on_device: set[int] = set()
        """Ranks whose device state is on the GPU (running or parked-resident)."""
        self._parked_resident: OrderedDict[int, None] = OrderedDict()
        self._checkpointed: set[int] = set()
        self.stats = ParkStats()

    @property
    def api(self) -> CudaCheckpoint:
        if self._api is None:  # created lazily: the launcher touches the driver only after forking ranks
            self._api = CudaCheckpoint()
        return self._api

    def parked(self, rank: int, pid: int) -> None:
        self._pid[rank] = pid
        if rank in self._on_device or rank not in self._checkpointed:
            self._on_device.add(rank)
            self._parked_resident[rank] = None

    def resume(self, rank: int, pid: int, running: set[int]) -> None:
        self._pid[rank] = pid
        self._parked_resident.pop(rank, None)
        if rank in self._checkpointed:
            self._make_room()
            t0 = time.monotonic()
            self.api.restore(pid)
            self.stats.restore_s += time.monotonic() - t0
            self.stats.restores += 1
            self._checkpointed.discard(rank)
        elif rank not in self._on_device:
            self._make_room()  # a new rank: it will allocate
        self._on_device.add(rank)
        self.stats.max_resident = max(self.stats.max_resident, len(self._on_device))

    def _make_room(self) -> None:
        while len(self._on_device) >= self.resident and self._parked_resident:
            victim, _ = self._parked_resident.popitem(last=True)
            try:
                self.api.state(self._pid[victim])
            except ParkingError:  # no CUDA state in that process (yet): nothing to move
                self._on_device.discard(victim)
                continue
            t0 = time.monotonic()
            self.api.checkpoint(self._pid[victim])
            self.stats.checkpoint_s += time.monotonic() - t0
            self.stats.checkpoints += 1
            self._on_device.discard(victim)
            self._checkpointed.add(victim)

    def gone(self, rank: int) -> None:
        self._on_device.discard(rank)
        self._parked_resident.pop(rank, None)
        self._checkpointed.discard(rank)

    def close(self) -> None:
        pass
