"""The native CPU allocator hook: its configuration, build, load, installation and self-check.

The hook is ``cpu_alloc_hook.cpp`` beside this module: C++ against the c10
headers of the running torch, compiled once with the system C++ compiler into
a cache directory and loaded with ``ctypes``. Installed, it intercepts every
allocation and free of c10's CPU allocator:

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
erase and a few atomic operations per allocation or free. With a limit set,
the hook refuses an allocation that would take the tracked bytes above it
with a C++ ``c10::OutOfMemoryError`` (``torch.OutOfMemoryError`` in Python).

The build is cached by the source file's content, the torch build, the
compiler and the C++ ABI, so an edited ``.cpp`` (or another torch) rebuilds;
ranks starting together compile once (a file lock). The cache root is
``$XDG_CACHE_HOME/prism_launch`` (else ``~/.cache/prism_launch``), or what
:func:`configure_cpu_hook` names, with a per-user temporary directory as the
fallback when it is not writable. Every level of the cache from its root down must be
a folder only this user can write (:mod:`prism_launch.config.private_dirs`: created ``0700``,
refused when another user owns it or could write to it), and a cached library is loaded
only when its sha256 matches the digest written beside it at build time (else it is
rebuilt), since whoever can write the cache decides what every rank runs. The compiler
is ``$CXX`` when set, else the first of ``c++``, ``g++``, ``clang++`` on ``PATH``.

The hook is built and installed on first use (:func:`load_hook`), at most once
per process; a failure is kept and reported (:func:`hook_error`,
:func:`cpu_hook_status`) instead of raised.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from prism_launch.config.private_dirs import UnsafePathError, check_private, ensure_private_dir, open_private_file

__all__ = ["CpuHook", "configure_cpu_hook", "cpu_hook_status", "hook_error", "load_hook"]

SOURCE = Path(__file__).resolve().with_name("cpu_alloc_hook.cpp")

_ENABLED = True
_CACHE_DIR: Path | None = None
_HOOK: CpuHook | None = None
_HOOK_ERROR: str | None = None
_HOOK_LOCK = threading.Lock()


def configure_cpu_hook(*, enabled: bool = True, cache_dir: str | None = None) -> None:
    """Set up the CPU allocator hook before its first use (a rank's bootstrap calls this
    before it starts a tracker).

    ``enabled=False`` keeps the hook out of this process: CPU trackers then report zeros and
    say why, and a CPU memory limit cannot be enforced. ``cache_dir`` is the cache root of
    the compiled hook (None: ``$XDG_CACHE_HOME/prism_launch`` or ``~/.cache/prism_launch``).
    Once the hook has been loaded (or has failed to), the configuration can no longer
    change: a different one raises ``RuntimeError``.
    """
    global _ENABLED, _CACHE_DIR
    root = Path(cache_dir).expanduser() if cache_dir else None
    with _HOOK_LOCK:
        if _HOOK is not None or _HOOK_ERROR is not None:
            if (bool(enabled), root) != (_ENABLED, _CACHE_DIR):
                raise RuntimeError("configure_cpu_hook() after the CPU allocator hook was first used")
            return
        _ENABLED, _CACHE_DIR = bool(enabled), root


# --------------------------------------------------------------------------- build


def _cache_root() -> Path:
    if _CACHE_DIR is not None:
        return _CACHE_DIR
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "prism_launch" if xdg else Path.home() / ".cache" / "prism_launch"


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _build() -> Path:
    """Compile the hook for this torch (cached by source content, torch build and compiler)."""
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
    source_hash = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
    key = hashlib.sha256(
        "\0".join((source_hash, torch.__version__, str(torch_dir), cxx, str(abi))).encode()
    ).hexdigest()[:16]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    for root in _cache_roots():
        try:
            d = ensure_private_dir(root, "cpu_alloc_hook", hint=_CACHE_HINT)
        except UnsafePathError:
            raise  # a folder someone else controls is reported, never silently passed over
        except OSError:
            continue
        target = d / f"prism_cpu_alloc_{key}{suffix}"
        if _intact(target):
            return target
        return _compile_locked(cxx, target, include, libdir, abi)
    raise RuntimeError("no writable cache directory for the CPU allocator hook")


_CACHE_HINT = ("Remove it if it is yours and let prism-launch recreate it, or point memory.cache_dir at a folder "
               "only you can write.")


def _cache_roots() -> list[Path]:
    """The configured (or user) cache root, then a per-user folder under the temporary directory."""
    return [_cache_root(), Path(tempfile.gettempdir()) / f"prism_launch-{os.getuid()}"]


def _digest_file(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _intact(target: Path) -> bool:
    """Whether ``target`` is a library this user built: a private regular file whose sha256 is
    the one written beside it at build time. Anything else is rebuilt (under the lock)."""
    try:
        check_private(target, directory=False, hint=_CACHE_HINT)
        check_private(_digest_file(target), directory=False, hint=_CACHE_HINT)
        recorded = _digest_file(target).read_text().strip()
    except FileNotFoundError:
        return False
    return recorded == _sha256(target)


def _compile_locked(cxx: str, target: Path, include: Path, libdir: Path, abi: int) -> Path:
    import fcntl

    fd = open_private_file(target.with_name(target.name + ".lock"), os.O_WRONLY, hint=_CACHE_HINT)
    with os.fdopen(fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together compile once
        if _intact(target):
            return target
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        cmd = [
            cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(include), str(SOURCE), "-o", str(tmp),
            "-L", str(libdir), "-lc10", f"-Wl,-rpath,{libdir}",
        ]  # fmt: skip
        if sys.platform == "darwin":
            cmd.insert(1, "-undefined")
            cmd.insert(2, "dynamic_lookup")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling the CPU allocator hook failed:\n{proc.stderr[-2000:]}")
        os.chmod(tmp, 0o700)
        digest = _sha256(tmp) + "\n"
        # the library first, then its digest: a reader between the two sees a mismatch and
        # waits here for the lock, never a digest that vouches for a library not yet in place
        os.replace(tmp, target)
        from nccl_ext.core.atomic import atomic_write

        atomic_write(_digest_file(target), digest)
        return target


# --------------------------------------------------------------------------- load


class CpuHook:
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


def _verify(hook: CpuHook) -> None:
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


def load_hook() -> CpuHook | None:
    """The installed hook, building and installing it on first use; None if unavailable."""
    global _HOOK, _HOOK_ERROR
    if _HOOK is not None or _HOOK_ERROR is not None:
        return _HOOK
    with _HOOK_LOCK:
        if _HOOK is not None or _HOOK_ERROR is not None:
            return _HOOK
        try:
            if not _ENABLED:
                raise RuntimeError("disabled by memory.cpu_hook=false (configure_cpu_hook(enabled=False))")
            hook = CpuHook(_build())
            if hook.install() == 0:
                raise RuntimeError("the CPU allocator hook could not be installed")
            _verify(hook)
            _HOOK = hook
        except Exception as exc:  # noqa: BLE001 - reported in summary()
            _HOOK_ERROR = f"{type(exc).__name__}: {exc}"
    return _HOOK


def hook_error() -> str | None:
    """Why the hook is unavailable (None while it works or has not been tried)."""
    return _HOOK_ERROR


def cpu_hook_status() -> dict:
    """Whether the CPU allocator hook is active, and why not if it is not (JSON-able)."""
    hook = load_hook()
    if hook is None:
        return {"active": False, "error": _HOOK_ERROR}
    return {
        "active": True,
        "library": str(hook.path),
        "default_allocator_redirected": bool(hook.state & 1),
        "registered_allocator_wrapped": bool(hook.state & 2),
        **hook.stats(),
    }
