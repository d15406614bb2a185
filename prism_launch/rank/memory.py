"""Per-rank tensor-memory accounting: current and peak bytes, per scheduling unit.

On CUDA the numbers are the caching allocator's own statistics
(``torch.cuda.memory_allocated`` / ``max_memory_allocated``), exactly what an
out-of-memory check on the target GPU is about.

On CPU torch keeps no allocator statistics, and RSS is polluted by the Python
heap, the glibc arena, libraries and freed-but-cached pages. This module
measures at the allocator instead, through the native hook of
:mod:`prism_launch.rank.cpu_hook` (built once with the system C++ compiler and
cached), which counts every allocation and free of c10's CPU allocator exactly,
on whatever thread; tensor ops are unaffected (see ``summary()["overhead"]``).
:func:`configure_cpu_hook` (re-exported here) sets it up or disables it before
the first tracker starts.

Scope on CPU: bytes requested from c10's CPU allocator, i.e. tensor storages
(views share a storage and count once), autograd saved tensors, kernel
temporaries, oneDNN scratch memory. Not counted, because they are not
allocations of that allocator: ``torch.from_numpy``/``torch.frombuffer``
tensors, mmap-ed loads, shared-memory storages (``share_memory_()``), and
blocks allocated before the hook was installed. The last ones are reported in
``summary()["method"]`` (the bytes of tensors reachable from Python at
``start()`` time that the hook did not allocate).

Without a C++ compiler, on a platform where the hook cannot be built, or with
the hook disabled (``configure_cpu_hook(enabled=False)``), the CPU tracker
reports zeros and says why in ``summary()["method"]``.

``set_memory_limit`` caps the allocator: on CUDA through
``torch.cuda.set_per_process_memory_fraction`` (the caching allocator then
raises ``torch.OutOfMemoryError`` where the target GPU would); on CPU the hook
refuses an allocation that would take the tracked bytes above the limit with
``torch.OutOfMemoryError`` (a C++ ``c10::OutOfMemoryError``, raised from the
allocator itself, so it surfaces from whichever op allocated).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from prism_launch.rank.cpu_hook import CpuHook, configure_cpu_hook, cpu_hook_status, hook_error, load_hook

__all__ = [
    "MemorySample",
    "MemoryTracker",
    "set_memory_limit",
    "configure_cpu_hook",
    "cpu_hook_status",
]

_HOOK_NAME = "c10-cpu-allocator-hook"


def _untracked_tensor_bytes(hook: CpuHook) -> tuple[int, int]:
    """Bytes (and count) of CPU storages reachable from Python that the hook did not allocate."""
    seen: set[int] = set()
    total = 0
    tensor_type = torch.Tensor
    with torch._C.DisableTorchFunction():
        for obj in gc.get_objects():
            if not issubclass(type(obj), tensor_type):  # type(): no __class__ lookups on proxies
                continue
            try:
                if obj.device.type != "cpu" or obj.is_sparse or obj.is_mkldnn:
                    continue
                st = obj.untyped_storage()
                ptr = st.data_ptr()
                if ptr == 0 or ptr in seen:
                    continue
                seen.add(ptr)
                if not hook.is_tracked(ptr):
                    total += st.nbytes()
            except Exception:  # noqa: BLE001 - tensors without a plain storage
                continue
    return total, len(seen)


# --------------------------------------------------------------------------- #
# public API
# --------------------------------------------------------------------------- #


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySample:
    unit: int
    current_bytes: int
    peak_bytes: int  # peak within the unit


def _is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def _cuda_index(device: str) -> int:
    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


_ACTIVE_CPU_TRACKER: MemoryTracker | None = None


class MemoryTracker:
    """Current/peak tensor memory of this process on ``device`` ("cpu" or "cuda[:N]").

    ``mark_unit(u)`` closes scheduling unit ``u`` (e.g. one training
    iteration): it returns the unit's peak and starts the next unit's peak from
    the current bytes. ``peak_bytes()`` is the peak since ``start()``.

    One CPU tracker is active per process at a time (the hook's counters are
    process-wide); "cuda" on a machine without CUDA is measured on CPU, which
    ``summary()["method"]`` states.
    """

    def __init__(self, device: str):
        self.device = str(device)
        self._requested = self.device
        self._cuda = _is_cuda(self.device) and torch.cuda.is_available()
        if _is_cuda(self.device) and not self._cuda:
            self.device = "cpu"
        self._started = False
        self._stopped = False
        self._samples: list[MemorySample] = []
        self._peak = 0
        self._final: tuple[int, int] | None = None
        self._reserved_final: tuple[int, int, int] | None = None
        self._hook: CpuHook | None = None
        self._untracked = (0, 0)
        self._install_s = 0.0
        self._mark_s = 0.0
        self._counts_at_start: dict = {}
        self._index = _cuda_index(self.device) if self._cuda else -1
        self._peak_reserved = 0

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        global _ACTIVE_CPU_TRACKER
        if self._started:
            return
        t0 = time.perf_counter()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._index)
            self._peak = int(torch.cuda.memory_allocated(self._index))
            self._peak_reserved = int(torch.cuda.memory_reserved(self._index))
        else:
            if _ACTIVE_CPU_TRACKER is not None and _ACTIVE_CPU_TRACKER is not self:
                raise RuntimeError("another CPU MemoryTracker is active in this process; stop() it first")
            self._hook = load_hook()
            if self._hook is not None:
                self._hook.reset_peaks()
                self._peak = self._hook.current()
                self._counts_at_start = self._hook.stats()
                self._untracked = _untracked_tensor_bytes(self._hook)
            _ACTIVE_CPU_TRACKER = self
        self._install_s = time.perf_counter() - t0
        self._started = True

    def stop(self) -> None:
        global _ACTIVE_CPU_TRACKER
        if not self._started or self._stopped:
            return
        self._final = (self.current_bytes(), self.peak_bytes())
        if self._cuda:
            self._reserved_final = self._reserved()
        self._stopped = True
        if _ACTIVE_CPU_TRACKER is self:
            _ACTIVE_CPU_TRACKER = None

    # -- measurements ---------------------------------------------------------
    def current_bytes(self) -> int:
        if self._final is not None:
            return self._final[0]
        if self._cuda:
            return int(torch.cuda.memory_allocated(self._index)) - self._comm()
        return int(self._hook.current()) if self._hook is not None else 0

    def peak_bytes(self) -> int:
        if self._final is not None:
            return self._final[1]
        if not self._started:
            return 0
        if self._cuda:
            return max(self._peak, int(torch.cuda.max_memory_allocated(self._index)) - self._comm())
        return int(self._hook.peak()) if self._hook is not None else 0

    def _reserved(self) -> tuple[int, int, int]:
        """(reserved, peak reserved since start, communication pool) bytes on the device."""
        comm = self._comm()
        reserved = int(torch.cuda.memory_reserved(self._index)) - comm
        return reserved, max(self._peak_reserved, int(torch.cuda.max_memory_reserved(self._index)) - comm), comm

    def _comm(self) -> int:
        """Device bytes the communication layer holds (the device path's pool): a real backend's
        buffers are not the program's, so they are left out of its figures."""
        from nccl_ext.core.device_memory import pool_bytes

        return pool_bytes(torch.device("cuda", self._index))

    def mark_unit(self, unit: int) -> MemorySample:
        if not self._started:
            self.start()
        if self._stopped:
            raise RuntimeError("MemoryTracker.mark_unit after stop()")
        t0 = time.perf_counter()
        if self._cuda:
            comm = self._comm()
            unit_peak = int(torch.cuda.max_memory_allocated(self._index)) - comm
            current = int(torch.cuda.memory_allocated(self._index)) - comm
            reserved_peak = int(torch.cuda.max_memory_reserved(self._index)) - comm
            torch.cuda.reset_peak_memory_stats(self._index)
            self._peak = max(self._peak, unit_peak)
            self._peak_reserved = max(self._peak_reserved, reserved_peak)
        elif self._hook is not None:
            current = int(self._hook.current())
            unit_peak = int(self._hook.take_unit_peak())
        else:
            current = unit_peak = 0
        sample = MemorySample(unit=int(unit), current_bytes=current, peak_bytes=max(unit_peak, current))
        self._samples.append(sample)
        self._mark_s += time.perf_counter() - t0
        return sample

    @property
    def samples(self) -> list[MemorySample]:
        return list(self._samples)

    # -- report ---------------------------------------------------------------
    def method(self) -> dict:
        if self._cuda:
            return {
                "name": "cuda-caching-allocator",
                "detail": "torch.cuda.memory_allocated / max_memory_allocated / reset_peak_memory_stats",
                "complete": True,
            }
        notes = []
        if _is_cuda(self._requested):
            notes.append(f"{self._requested!r} requested but CUDA is not available: measured on CPU")
        if self._hook is None:
            return {
                "name": "unavailable",
                "detail": f"CPU allocator hook unavailable: {hook_error()}",
                "complete": False,
                "notes": notes,
            }
        untracked, _ = self._untracked
        late = untracked > 0
        if late:
            notes.append(
                f"installed after the program allocated tensors: {untracked} bytes of CPU tensors "
                "reachable from Python at start() were allocated before the hook and are not counted"
            )
        fronts = []
        if self._hook.state & 1:
            fronts.append("default CPU allocator redirected")
        if self._hook.state & 2:
            fronts.append("registered CPU allocator wrapped")
        return {
            "name": _HOOK_NAME,
            "detail": "exact bytes requested from c10's CPU allocator (" + ", ".join(fronts) + ")",
            "complete": not late,
            "late_install": late,
            "untracked_at_start_bytes": untracked,
            "notes": notes,
        }

    def summary(self) -> dict:
        overhead: dict = {
            "start_s": round(self._install_s, 6),
            "mark_unit_s_total": round(self._mark_s, 6),
        }
        if self._hook is not None and not self._cuda:
            now = self._hook.stats()
            allocs = now["allocs"] - self._counts_at_start.get("allocs", 0)
            frees = now["frees"] - self._counts_at_start.get("frees", 0)
            overhead.update(
                allocations=allocs,
                frees=frees,
                per_event="one table insert/erase and a few atomic operations per allocation/free",
            )
            if now["ooms"]:
                overhead["refused_by_limit"] = now["ooms"]
        out = {
            "device": self.device,
            "method": self.method(),
            "current_bytes": self.current_bytes(),
            "peak_bytes": self.peak_bytes(),
            "samples": [asdict(s) for s in self._samples],
            "overhead": overhead,
        }
        if self._cuda and self._started:
            # what the caching allocator holds from the device (fragmentation included): a
            # capture admits ranks to the device by it, so it is reported after stop() too
            reserved, peak_reserved, comm = self._reserved_final or self._reserved()
            out["reserved_bytes"] = reserved
            out["peak_reserved_bytes"] = peak_reserved
            if comm:
                out["communication_pool_bytes"] = comm
        if _DETAILS:
            out["details"] = dict(_DETAILS)
        limit = _LIMITS.get("cuda" if self._cuda else "cpu")
        if limit is not None:
            out["limit_bytes"] = limit
        return out


_LIMITS: dict[str, int] = {}

_DETAILS: dict[str, dict] = {}


def add_detail(name: str, detail: dict) -> None:
    """A breakdown an integration knows of this rank's memory (e.g. DeepSpeed's ZeRO partitions,
    buckets and optimizer state by device), carried in the rank's summary under ``details`` and
    into the report (``ranks.<r>.memory_details``)."""
    _DETAILS[name] = detail


def set_memory_limit(device: str, limit_bytes: int) -> None:
    """Make allocations beyond ``limit_bytes`` fail with ``torch.OutOfMemoryError``.

    CUDA: ``torch.cuda.set_per_process_memory_fraction(limit / total)`` (the
    caching allocator counts reserved bytes against it, as the target GPU
    would). CPU: the allocator hook refuses any allocation that would take the
    tracked bytes (allocations made since the hook was installed) above the
    limit. ``limit_bytes <= 0`` removes the limit.
    """
    limit = int(limit_bytes)
    if _is_cuda(device) and torch.cuda.is_available():
        idx = _cuda_index(device)
        total = torch.cuda.get_device_properties(idx).total_memory
        fraction = 1.0 if limit <= 0 else min(1.0, limit / total)
        torch.cuda.set_per_process_memory_fraction(fraction, idx)
        if limit > 0:
            _LIMITS["cuda"] = limit
        else:
            _LIMITS.pop("cuda", None)
        return
    hook = load_hook()
    if hook is None:
        raise RuntimeError(f"cannot enforce a CPU memory limit: {hook_error()}")
    hook.set_limit(max(0, limit))
    if limit > 0:
        _LIMITS["cpu"] = limit
    else:
        _LIMITS.pop("cpu", None)
