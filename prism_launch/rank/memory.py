"""Per-rank tensor-memory accounting: current and peak bytes, per scheduling unit.

On CUDA the numbers are the caching allocator's own statistics
(``torch.cuda.memory_allocated`` / ``max_memory_allocated``), exactly what an
out-of-memory check on the target GPU is about.

On CPU torch keeps no allocator statistics, and RSS is polluted by the Python
heap, the glibc arena, libraries and freed-but-cached pages. This module
measures at the allocator instead: a small native hook (C++ against the c10
headers of the running torch, built once with the system C++ compiler and
cached) intercepts every allocation and free of c10's CPU allocator:

* the process-wide default CPU allocator object (what
  ``c10::GetCPUAllocator()`` returns, and what code that asks for
  ``c10::GetDefaultCPUAllocator()`` directly gets: ``torch.UntypedStorage(n)``,
  ``torch.load``, storage resizes of tensors created earlier) has its virtual
  table redirected to a tracking front end that forwards to the original
  implementation;
* if another CPU allocator was registered with ``c10::SetCPUAllocator``, it is
  wrapped through that same public registration.

Every tracked block is kept in a sharded pointer->size table and its DataPtr
gets the tracking deleter, so current bytes go down exactly when the memory is
released, on whatever thread. Counters are atomics; the peak is the maximum
over the linearised sequence of post-allocation totals, so it is exact under
concurrent allocation (gloo and autograd threads). Cost: one table insert or
erase and a few atomic operations per allocation or free; tensor ops are
unaffected (see ``summary()["overhead"]``).

Scope on CPU: bytes requested from c10's CPU allocator, i.e. tensor storages
(views share a storage and count once), autograd saved tensors, kernel
temporaries, oneDNN scratch memory. Not counted, because they are not
allocations of that allocator: ``torch.from_numpy``/``torch.frombuffer``
tensors, mmap-ed loads, shared-memory storages (``share_memory_()``), and
blocks allocated before the hook was installed. The last ones are reported in
``summary()["method"]`` (the bytes of tensors reachable from Python at
``start()`` time that the hook did not allocate).

Without a C++ compiler (or on a platform where the hook cannot be built) the
CPU tracker reports zeros and says why in ``summary()["method"]``.

``set_memory_limit`` caps the allocator: on CUDA through
``torch.cuda.set_per_process_memory_fraction`` (the caching allocator then
raises ``torch.OutOfMemoryError`` where the target GPU would); on CPU the hook
refuses an allocation that would take the tracked bytes above the limit with
``torch.OutOfMemoryError`` (a C++ ``c10::OutOfMemoryError``, raised from the
allocator itself, so it surfaces from whichever op allocated).
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = [
    "MemorySample",
    "MemoryTracker",
    "set_memory_limit",
    "cpu_hook_status",
]

_HOOK_NAME = "c10-cpu-allocator-hook"

_CPP_SOURCE = r"""
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <exception>
#include <mutex>
#include <unordered_map>

namespace {

struct Block {
  std::int64_t n;
  c10::DataPtr inner;  // the block as the underlying allocator handed it out
};

constexpr int kShards = 64;
struct Shard {
  std::mutex m;
  std::unordered_map<void*, Block> map;
};
// Leaked on purpose: tensors may be freed during interpreter or library
// teardown, after static destructors of this library would have run.
Shard* const g_shards = new Shard[kShards];

inline Shard& shard_of(const void* p) {
  auto h = reinterpret_cast<std::uintptr_t>(p) >> 4;
  h *= 0x9E3779B97F4A7C15ull;
  return g_shards[(h >> 58) & (kShards - 1)];
}

std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};
std::atomic<std::int64_t> g_unit_peak{0};
std::atomic<std::int64_t> g_limit{0};  // <= 0: no limit
std::atomic<std::int64_t> g_allocs{0};
std::atomic<std::int64_t> g_frees{0};
std::atomic<std::int64_t> g_foreign_frees{0};
std::atomic<std::int64_t> g_stale{0};
std::atomic<std::int64_t> g_ooms{0};
std::atomic<std::int64_t> g_alloc_bytes_total{0};

inline void raise_max(std::atomic<std::int64_t>& a, std::int64_t v) {
  std::int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// Frees a tracked block; a pointer the table does not know (allocated before
// installation and released through raw_deallocate) goes to `fallback`.
inline void release(void* ptr, c10::DeleterFnPtr fallback) {
  if (ptr == nullptr) return;
  Shard& s = shard_of(ptr);
  std::unique_lock<std::mutex> lock(s.m);
  auto it = s.map.find(ptr);
  if (it == s.map.end()) {
    lock.unlock();
    g_foreign_frees.fetch_add(1, std::memory_order_relaxed);
    if (fallback != nullptr) fallback(ptr);
    return;
  }
  auto node = s.map.extract(it);
  lock.unlock();
  g_current.fetch_sub(node.mapped().n);
  g_frees.fetch_add(1, std::memory_order_relaxed);
  // `node` goes out of scope here: the inner DataPtr returns the memory.
}

// Counts `n` bytes about to be allocated; enforces the limit.
inline std::int64_t reserve(std::size_t n) {
  const auto sn = static_cast<std::int64_t>(n);
  const std::int64_t now = g_current.fetch_add(sn) + sn;
  const std::int64_t lim = g_limit.load(std::memory_order_relaxed);
  if (lim > 0 && now > lim) {
    g_current.fetch_sub(sn);
    g_ooms.fetch_add(1, std::memory_order_relaxed);
    // snprintf, not c10::str: no iostreams in this library (a toolchain may
    // link its own libstdc++ copy, whose locale facets are never initialised).
    char msg[256];
    std::snprintf(msg, sizeof(msg),
        "CPU out of memory: tried to allocate %lld bytes with %lld bytes already allocated; "
        "the emulated device's memory limit is %lld bytes (prism memory limit)",
        static_cast<long long>(sn), static_cast<long long>(now - sn), static_cast<long long>(lim));
    C10_THROW_ERROR(OutOfMemoryError, std::string(msg));
  }
  return now;
}

c10::DataPtr track(c10::DataPtr inner, std::int64_t n, std::int64_t now,
                   c10::DeleterFnPtr deleter) {
  void* data = inner.get();
  if (data == nullptr) {
    g_current.fetch_sub(n);
    return inner;
  }
  try {
    Shard& s = shard_of(data);
    std::lock_guard<std::mutex> lock(s.m);
    auto res = s.map.try_emplace(data, Block{n, c10::DataPtr()});
    if (!res.second) {
      // A stale entry: its block was released behind the table's back (a raw
      // deleter fetched before installation). The memory is already gone;
      // forget it without freeing it again.
      Block& old = res.first->second;
      (void)old.inner.release_context();
      g_current.fetch_sub(old.n);
      g_stale.fetch_add(1, std::memory_order_relaxed);
      old.n = n;
    }
    res.first->second.inner = std::move(inner);
  } catch (...) {
    g_current.fetch_sub(n);
    throw;
  }
  raise_max(g_peak, now);
  raise_max(g_unit_peak, now);
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  g_alloc_bytes_total.fetch_add(n, std::memory_order_relaxed);
  return c10::DataPtr(data, data, deleter, c10::Device(c10::DeviceType::CPU));
}

// ---- front end 1: the default CPU allocator object, redirected in place ----
// The default allocator is stateless (its only member is the vtable pointer),
// so a copy of that pointer is a working instance of the original.
struct OriginalDefault {
  void* vptr = nullptr;
};
OriginalDefault g_orig_default;
c10::DeleterFnPtr g_orig_default_raw = nullptr;
void* g_default_patched_vptr = nullptr;

inline c10::Allocator* orig_default() {
  return reinterpret_cast<c10::Allocator*>(&g_orig_default);
}

void default_delete(void* ptr) { release(ptr, g_orig_default_raw); }

struct DefaultFront final : c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    if (n == 0) return orig_default()->allocate(0);
    const std::int64_t now = reserve(n);
    c10::DataPtr inner;
    try {
      inner = orig_default()->allocate(n);
    } catch (...) {
      g_current.fetch_sub(static_cast<std::int64_t>(n));
      throw;
    }
    return track(std::move(inner), static_cast<std::int64_t>(n), now, &default_delete);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &default_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
DefaultFront* const g_default_front = new DefaultFront();

// ---- front end 2: a wrapper registered with SetCPUAllocator ----
std::atomic<c10::Allocator*> g_wrapped{nullptr};
c10::DeleterFnPtr g_wrapped_raw = nullptr;

void wrapper_delete(void* ptr) { release(ptr, g_wrapped_raw); }

struct WrapperFront final : c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    c10::Allocator* inner_alloc = g_wrapped.load();
    if (n == 0) return inner_alloc->allocate(0);
    const std::int64_t now = reserve(n);
    c10::DataPtr inner;
    try {
      inner = inner_alloc->allocate(n);
    } catch (...) {
      g_current.fetch_sub(static_cast<std::int64_t>(n));
      throw;
    }
    return track(std::move(inner), static_cast<std::int64_t>(n), now, &wrapper_delete);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &wrapper_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
WrapperFront* const g_wrapper_front = new WrapperFront();

std::mutex g_install_mutex;

}  // namespace

extern "C" {

// Bit 1: default allocator redirected; bit 2: registered allocator wrapped.
int prism_mem_install(int patch_default) {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  int state = 0;
  c10::Allocator* def = c10::GetDefaultCPUAllocator();
  void** def_obj = reinterpret_cast<void**>(def);
  if (patch_default) {
    if (g_default_patched_vptr == nullptr) {
      g_orig_default.vptr = def_obj[0];
      g_orig_default_raw = orig_default()->raw_deleter();
      g_default_patched_vptr = *reinterpret_cast<void**>(g_default_front);
      __atomic_store_n(&def_obj[0], g_default_patched_vptr, __ATOMIC_SEQ_CST);
    }
    state |= 1;
  }
  c10::Allocator* cur = c10::GetCPUAllocator();
  if (cur != def && cur != g_wrapper_front) {
    g_wrapped_raw = cur->raw_deleter();
    g_wrapped.store(cur);
    c10::SetCPUAllocator(g_wrapper_front, 255);
  }
  if (c10::GetCPUAllocator() == g_wrapper_front) state |= 2;
  return state;
}

int prism_mem_default_patched() { return g_default_patched_vptr != nullptr ? 1 : 0; }
int prism_mem_current_is_default() {
  return c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator() ? 1 : 0;
}
std::int64_t prism_mem_current() { return g_current.load(); }
std::int64_t prism_mem_peak() { return g_peak.load(); }
std::int64_t prism_mem_unit_peak() { return g_unit_peak.load(); }
std::int64_t prism_mem_take_unit_peak() { return g_unit_peak.exchange(g_current.load()); }
void prism_mem_reset_peaks() {
  const std::int64_t c = g_current.load();
  g_peak.store(c);
  g_unit_peak.store(c);
}
void prism_mem_set_limit(std::int64_t limit) { g_limit.store(limit); }
std::int64_t prism_mem_limit() { return g_limit.load(); }
std::int64_t prism_mem_allocs() { return g_allocs.load(); }
std::int64_t prism_mem_frees() { return g_frees.load(); }
std::int64_t prism_mem_foreign_frees() { return g_foreign_frees.load(); }
std::int64_t prism_mem_stale() { return g_stale.load(); }
std::int64_t prism_mem_ooms() { return g_ooms.load(); }
std::int64_t prism_mem_alloc_bytes_total() { return g_alloc_bytes_total.load(); }
int prism_mem_is_tracked(void* p) {
  Shard& s = shard_of(p);
  std::lock_guard<std::mutex> lock(s.m);
  return s.map.count(p) ? 1 : 0;
}

}  // extern "C"
"""


# --------------------------------------------------------------------------- #
# building and loading the native hook
# --------------------------------------------------------------------------- #


def _cache_root() -> Path:
    env = os.environ.get("PRISM_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "prism_launch" if xdg else Path.home() / ".cache" / "prism_launch"


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _build_hook() -> Path:
    """Compile the hook for this torch (cached by source, torch build and compiler)."""
    if sys.platform not in ("linux", "darwin"):
        raise RuntimeError(f"the CPU allocator hook is not supported on {sys.platform}")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++/clang++)")
    torch_dir = Path(torch.__file__).resolve().parent
    include, libdir = torch_dir / "include", torch_dir / "lib"
    if not (include / "c10" / "core" / "CPUAllocator.h").is_file():
        raise RuntimeError(f"torch C++ headers not found under {include}")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    key = hashlib.sha256(
        "\0".join((_CPP_SOURCE, torch.__version__, str(torch_dir), cxx, str(abi))).encode()
    ).hexdigest()[:16]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    for root in (_cache_root(), Path(tempfile.gettempdir()) / f"prism_launch-{os.getuid()}"):
        try:
            d = root / "cpu_alloc_hook"
            d.mkdir(parents=True, exist_ok=True)
            target = d / f"prism_cpu_alloc_{key}{suffix}"
            if target.is_file():
                return target
            return _compile_locked(cxx, d, target, include, libdir, abi)
        except OSError:
            continue
    raise RuntimeError("no writable cache directory for the CPU allocator hook")


def _compile_locked(cxx: str, d: Path, target: Path, include: Path, libdir: Path, abi: int) -> Path:
    import fcntl

    with open(d / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together compile once
        if target.is_file():
            return target
        src = d / (target.stem + ".cpp")
        src.write_text(_CPP_SOURCE)
        tmp = d / f"{target.name}.{os.getpid()}.tmp"
        cmd = [
            cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(include), str(src), "-o", str(tmp),
            "-L", str(libdir), "-lc10", f"-Wl,-rpath,{libdir}",
        ]  # fmt: skip
        if sys.platform == "darwin":
            cmd.insert(1, "-undefined")
            cmd.insert(2, "dynamic_lookup")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling the CPU allocator hook failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
        return target


class _Hook:
    """ctypes view of the native hook (one per process)."""

    _I64 = (
        "current", "peak", "unit_peak", "take_unit_peak", "limit", "allocs", "frees",
        "foreign_frees", "stale", "ooms", "alloc_bytes_total",
    )  # fmt: skip

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name in self._I64:
            getattr(self.lib, f"prism_mem_{name}").restype = ctypes.c_int64
        self.lib.prism_mem_set_limit.argtypes = [ctypes.c_int64]
        self.lib.prism_mem_is_tracked.argtypes = [ctypes.c_void_p]
        self.lib.prism_mem_install.argtypes = [ctypes.c_int]
        self.state = 0

    def __getattr__(self, name: str):
        fn = getattr(self.lib, f"prism_mem_{name}")
        setattr(self, name, fn)
        return fn

    def install(self) -> int:
        self.state = self.lib.prism_mem_install(1)
        return self.state

    def stats(self) -> dict:
        return {name: int(getattr(self, name)()) for name in self._I64 if name != "take_unit_peak"}


_HOOK: _Hook | None = None
_HOOK_ERROR: str | None = None
_HOOK_LOCK = threading.Lock()


def _verify(hook: _Hook) -> None:
    """Checks that a tensor's and a storage's blocks reach the hook, and leave it when freed."""
    with torch._C.DisableTorchFunction():
        for make in (
            lambda: torch.empty(4099, dtype=torch.uint8).untyped_storage(),
            lambda: torch.UntypedStorage(4099),
        ):
            obj = make()
            ptr = obj.data_ptr()
            tracked = bool(hook.is_tracked(ptr))
            frees = hook.frees()
            del obj
            if not tracked or hook.frees() <= frees:
                raise RuntimeError("CPU allocator hook self-check failed: an allocation was not seen")


def _hook() -> _Hook | None:
    """The installed hook, building and installing it on first use; None if unavailable."""
    global _HOOK, _HOOK_ERROR
    if _HOOK is not None or _HOOK_ERROR is not None:
        return _HOOK
    with _HOOK_LOCK:
        if _HOOK is not None or _HOOK_ERROR is not None:
            return _HOOK
        try:
            if os.environ.get("PRISM_CPU_MEMORY_HOOK", "1") == "0":
                raise RuntimeError("disabled by PRISM_CPU_MEMORY_HOOK=0")
            hook = _Hook(_build_hook())
            if hook.install() == 0:
                raise RuntimeError("the CPU allocator hook could not be installed")
            _verify(hook)
            _HOOK = hook
        except Exception as exc:  # noqa: BLE001 - reported in summary()
            _HOOK_ERROR = f"{type(exc).__name__}: {exc}"
    return _HOOK


def cpu_hook_status() -> dict:
    """Whether the CPU allocator hook is active, and why not if it is not (JSON-able)."""
    hook = _hook()
    if hook is None:
        return {"active": False, "error": _HOOK_ERROR}
    return {
        "active": True,
        "library": str(hook.path),
        "default_allocator_redirected": bool(hook.state & 1),
        "registered_allocator_wrapped": bool(hook.state & 2),
        **hook.stats(),
    }


def _untracked_tensor_bytes(hook: _Hook) -> tuple[int, int]:
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
        self._hook: _Hook | None = None
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
            self._hook = _hook()
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

    def _comm(self) -> int:
        """Device bytes the communication layer holds (the device path's pool): a real backend's
        buffers are not the program's, so they are left out of its figures."""
        from nccl_ext.device_path import pool_bytes

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
                "detail": f"CPU allocator hook unavailable: {_HOOK_ERROR}",
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
        if self._cuda and self._final is None and self._started:
            # what the caching allocator holds from the device (fragmentation included)
            comm = self._comm()
            out["reserved_bytes"] = int(torch.cuda.memory_reserved(self._index)) - comm
            out["peak_reserved_bytes"] = max(self._peak_reserved, int(torch.cuda.max_memory_reserved(self._index)) - comm)
            if comm:
                out["communication_pool_bytes"] = comm
        limit = _LIMITS.get("cuda" if self._cuda else "cpu")
        if limit is not None:
            out["limit_bytes"] = limit
        return out


_LIMITS: dict[str, int] = {}


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
    hook = _hook()
    if hook is None:
        raise RuntimeError(f"cannot enforce a CPU memory limit: {_HOOK_ERROR}")
    hook.set_limit(max(0, limit))
    if limit > 0:
        _LIMITS["cpu"] = limit
    else:
        _LIMITS.pop("cpu", None)
