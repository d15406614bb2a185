"""Shared-memory exchange of capture contributions: each captured rank stages what it puts into a
collective in its own arena (files under one directory, ``/dev/shm`` where there is one), every
member maps its peers' arenas and computes its own result from their pieces — the same
:func:`nccl_ext.core.ops.compute` in group-rank order, so the bits are the coordinator's — and the
coordinator handles metadata and reads only what the trace records, where it lies.

An arena is one file per generation: when a contribution does not fit, a file twice as large is
started and the old one is removed once its last region is freed. A region is freed when the
coordinator says every member has read it (``xfree``); peers map a generation once and keep it.
"""

from __future__ import annotations

import fcntl
import glob
import mmap
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field

import torch

from nccl_ext.core import sliced, wire

_ALIGN = 256
_MIN_BYTES = 4 << 20


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


OWNER_FILE = ".owner"
"""In an exchange directory: the file its launcher holds an exclusive ``flock`` on while it lives."""

_owned: dict[str, int] = {}


def claim_directory(base: str | os.PathLike, prefix: str = "prism-exchange-") -> str:
    """A new directory ``<prefix>*`` under ``base`` (an exchange's; the coordinator's socket's),
    held by this process (:data:`OWNER_FILE`), after removing those whose launcher died without
    removing them (:func:`sweep_stale`)."""
    sweep_stale(base, prefix)
    d = tempfile.mkdtemp(prefix=prefix, dir=base)
    fd = os.open(os.path.join(d, OWNER_FILE), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without flock: a sweep cannot take the lock either, so it stays
        pass
    _owned[d] = fd
    return d


def release_directory(d: str) -> None:
    """Remove an exchange directory this process claimed."""
    shutil.rmtree(d, ignore_errors=True)
    fd = _owned.pop(d, None)
    if fd is not None:
        os.close(fd)


def sweep_stale(base: str | os.PathLike, prefix: str = "prism-exchange-") -> list[str]:
    """Remove the directories ``<prefix>*`` under ``base`` whose owner lock nobody holds: their
    launcher was killed (``SIGKILL`` runs no cleanup) and its ranks died with it (the lock is held
    by every process that inherited it). Arenas are memory under ``/dev/shm``; each run would
    leak them."""
    gone = []
    for d in glob.glob(os.path.join(os.fspath(base), f"{prefix}*")):
        try:
            fd = os.open(os.path.join(d, OWNER_FILE), os.O_RDWR)
        except OSError:  # not ours to judge: being created, or from before the owner file
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # alive
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def arena_path(directory: str, rank: int, gen: int) -> str:
    return os.path.join(directory, f"r{rank}-g{gen}")


@dataclass
class _Segment:
    gen: int
    path: str
    size: int
    mm: mmap.mmap
    free: list[tuple[int, int]] = field(default_factory=list)
    """Free (start, length) runs, sorted by start."""
    live: int = 0
    pinned: int | None = None
    """The mapping's address while it is page-locked for the GPU (:func:`pin`)."""

    def take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i] = (start + n, length - n)
                if self.free[i][1] == 0:
                    del self.free[i]
                self.live += 1
                return start
        return None

    def give(self, start: int, n: int) -> None:
        self.free.append((start, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, ln in self.free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((s, ln))
        self.free = merged
        self.live -= 1


def _view(mm: mmap.mmap, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = wire.numel(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=offset).view(dtype).reshape(tuple(shape))


def _map(path: str, size: int | None = None) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0), 0o600)
    try:
        if size is not None:
            try:  # reserve the pages now: a full tmpfs then fails here, not with SIGBUS at a write
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(path)
                free = os.statvfs(os.path.dirname(path))
                raise OSError(e.errno, f"capture's shared-memory exchange: no room for a {size / 2**20:.0f} MiB "
                                       f"arena in {os.path.dirname(path)} ({free.f_bavail * free.f_frsize / 2**20:.0f} "
                                       "MiB free); capture with capture.exchange=false") from None
        else:
            size = os.fstat(fd).st_size
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


PIN_COUNTS = {"pinned": 0, "refused": 0}
"""Mappings this process page-locked, and those the driver refused (a rank's capture stats)."""


def pin(mm: mmap.mmap) -> int | None:
    """Page-lock a mapping for the GPU (``cudaHostRegister``, as torch does for shared memory):
    copies between it and the device then run at the link's speed instead of through the
    driver's bounce buffer. Returns its address to :func:`unpin` later, or None where the
    driver refuses (the mapping works as before, at the pageable speed)."""
    t = torch.frombuffer(mm, dtype=torch.uint8)
    ptr, n = t.data_ptr(), t.numel()
    del t  # the buffer export would keep the mapping from closing
    if int(torch.cuda.cudart().cudaHostRegister(ptr, n, 1)) != 0:  # 1: cudaHostRegisterPortable
        _clear_cuda_error()
        PIN_COUNTS["refused"] += 1
        return None
    PIN_COUNTS["pinned"] += 1
    return ptr


def unpin(ptr: int | None) -> None:
    if ptr is not None and int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """A refused registration leaves the runtime's last error set; the next kernel launch's
    check would report it as its own. Take it (best effort: the runtime torch loaded)."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class Arena:
    """One rank's staging area: :meth:`put` copies a contribution in (from any device) and says
    where it lies; :meth:`free` gives the region back. With ``pin``, its files are page-locked
    for the GPU (:func:`pin`); ``pin_ok()``: whether the calling thread may lock pages now (see
    :class:`PeerViews`) — else a new generation stays pageable (``left_pageable``);
    ``unpin_ok()``: whether pages may be unlocked now — else a drained generation stays locked
    until a later :meth:`put` that may, or :meth:`close`. :meth:`reserve` grows it ahead."""

    def __init__(self, directory: str, rank: int, initial_bytes: int = _MIN_BYTES, *, pin: bool = False,
                 pin_ok=None, unpin_ok=None) -> None:
        self.directory = directory
        self.rank = rank
        self.pin = pin
        self._pin_ok = pin_ok
        self._unpin_ok = unpin_ok
        self._drained: list[_Segment] = []
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._current: _Segment | None = None
        self._initial = initial_bytes
        self.bytes_staged = 0
        self.live_bytes = 0
        self.high_water = 0
        """The most bytes staged and not yet freed at once."""
        self.left_pageable = 0
        """Generations made while ``pin_ok()`` said no (their copies from the GPU synchronize)."""

    def _may_pin(self) -> bool:
        return self._pin_ok is None or self._pin_ok()

    def _may_unpin(self) -> bool:
        return self._unpin_ok is None or self._unpin_ok()

    def _grow(self, need: int, exact: bool = False) -> _Segment:
        size = need if exact else max(self._initial, need, 2 * self._current.size if self._current is not None else 0)
        size = -(-size // (1 << 20)) * (1 << 20)
        gen = self._current.gen + 1 if self._current is not None else 0
        path = arena_path(self.directory, self.rank, gen)
        seg = _Segment(gen, path, size, _map(path, size), free=[(0, size)])
        if self.pin and self._may_pin():
            seg.pinned = pin(seg.mm)
        elif self.pin:
            self.left_pageable += 1
        old, self._current = self._current, seg
        self._segments[gen] = seg
        if old is not None and old.live == 0:
            self._retire(old)
        return seg

    def reserve(self, size: int) -> None:
        """Make the current generation at least ``size`` bytes now (a new, empty one if it is
        smaller), so that staging later neither registers pages mid-step nor leaves a generation
        pageable where pages may not be locked."""
        with self._lock:
            if self._current is None or self._current.size < size:
                self._grow(max(size, self._initial), exact=True)

    def _retire(self, seg: _Segment) -> None:
        """Drop drained generation ``seg`` — or keep it locked for later, where pages may not be
        unlocked now."""
        if seg.pinned is None or self._may_unpin():
            self._drop(seg)
        elif seg not in self._drained:
            self._drained.append(seg)

    def put(self, tensors: list[torch.Tensor], *, non_blocking: bool = False) -> tuple[int, list[tuple[int, str, list[int]]], tuple]:
        """Copy ``tensors`` into one region; returns (generation, [(offset, dtype, shape)], token).
        ``non_blocking``: a GPU tensor's copy is queued on the current stream (the region is read
        only after it, in stream order)."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        total = max(_ALIGN, sum(sizes))
        with self._lock:
            while self._drained and self._may_unpin():
                self._drop(self._drained.pop())
            seg = self._current
            start = seg.take(total) if seg is not None else None
            if start is None:
                seg = self._grow(total)
                start = seg.take(total)
            self.live_bytes += total
            self.high_water = max(self.high_water, self.live_bytes)
        descs, at = [], start
        for t, n in zip(tensors, sizes):
            if n:
                dst = _view(seg.mm, at, t.dtype, t.shape)
                if t.device.type == "cpu":
                    sliced.copy(dst, t.detach())  # a gradient bucket on several threads
                else:
                    dst.copy_(t.detach(), non_blocking=non_blocking)
            descs.append((at, wire.dtype_name(t.dtype), list(t.shape)))
            at += n
        self.bytes_staged += total
        return seg.gen, descs, (seg.gen, start, total)

    def free(self, token: tuple) -> None:
        gen, start, total = token
        with self._lock:
            seg = self._segments.get(gen)
            if seg is None:
                return
            seg.give(start, total)
            self.live_bytes -= total
            if seg is not self._current and seg.live == 0:
                self._retire(seg)

    def _drop(self, seg: _Segment) -> None:
        self._segments.pop(seg.gen, None)
        unpin(seg.pinned)
        seg.pinned = None
        try:
            os.unlink(seg.path)
        except OSError:
            pass
        try:
            seg.mm.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the process
            pass

    def close(self) -> None:
        with self._lock:
            for seg in list(self._segments.values()):
                self._drop(seg)
            self._drained.clear()
            self._current = None


class PeerViews:
    """Views of other ranks' arenas (each generation mapped once; page-locked with ``pin`` where
    ``pin_ok()`` says the calling thread may, else left pageable).

    Page-locking takes the driver's context lock for writing, which a thread blocked in a
    synchronous copy holds while the copy waits for its stream. Where the program's stream waits
    on the GPU for ops whose folds a helper thread queues (:mod:`nccl_ext.capture.deferred_waits`), that
    helper must not lock pages: the program may sit in such a copy behind one of those ops."""

    def __init__(self, directory: str, *, pin: bool = False, pin_ok=None) -> None:
        self.directory = directory
        self.pin = pin
        self._pin_ok = pin_ok
        self.left_pageable = 0
        """Generations mapped without page-locking because ``pin_ok()`` said no."""
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._pinned: dict[tuple[int, int], int | None] = {}
        self._lock = threading.Lock()

    def hold(self, rank: int, gen: int) -> mmap.mmap:
        """Map ``rank``'s arena generation ``gen`` (once): its views stay readable after the
        rank has removed the file (at its exit)."""
        key = (rank, gen)
        with self._lock:
            mm = self._maps.get(key)
            if mm is None:
                mm = self._maps[key] = _map(arena_path(self.directory, rank, gen))
                if self.pin and (self._pin_ok is None or self._pin_ok()):
                    self._pinned[key] = pin(mm)
                elif self.pin:
                    self.left_pageable += 1
        return mm

    def view(self, rank: int, gen: int, offset: int, dtype: str, shape) -> torch.Tensor:
        return _view(self.hold(rank, gen), offset, wire.dtype_from_name(dtype), shape)

    def views(self, location) -> list[torch.Tensor] | None:
        """A member's contribution from its ``(rank, gen, descs)`` location (None: contributes nothing)."""
        if location is None:
            return None
        rank, gen, descs = location
        return [self.view(rank, gen, off, dt, shape) for off, dt, shape in descs]

    def close(self) -> None:
        with self._lock:
            for ptr in self._pinned.values():
                unpin(ptr)
            self._pinned.clear()
            for mm in self._maps.values():
                try:
                    mm.close()
                except BufferError:
                    pass
            self._maps.clear()


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data in a buffer of its own outside the program's allocator (a result that is a
    peer's piece must outlive the peer's region)."""
    out = wire.untracked_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out
