"""Large elementwise host work in slices on a few threads.

A data-parallel gradient bucket is tens of millions of elements; where the capture's
coordinator sums or stages one on the host, the captured ranks wait for it. torch's
elementwise CPU kernels release the interpreter, so slices on a small thread pool run in
parallel without OpenMP (which a process that forks ranks must not start). Each element sees
the same operations in the same order as in one pass: the bits do not depend on the slicing."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

PARALLEL_MIN = 1 << 20
"""Elements from which the work runs in slices on several threads."""
SLICE = 1 << 18
"""Elements per slice."""

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _threads() -> ThreadPoolExecutor:
    """This process's pool: a forked child (a rank forked by the launcher) makes its own — the
    parent's workers do not exist in it, and work handed to their queue would wait forever."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="prism-slices")
        _pool_pid = os.getpid()
    return _pool


def run(total: int, fn: Callable[[int, int], None]) -> None:
    """``fn(start, end)`` over ``[0, total)``: in slices on the pool when ``total`` is large."""
    if total < PARALLEL_MIN:
        fn(0, total)
        return
    for f in [_threads().submit(fn, s, min(total, s + SLICE)) for s in range(0, total, SLICE)]:
        f.result()


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors of the same shape and dtype, contiguous (else one pass)."""
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape
            or not dst.is_contiguous() or not src.is_contiguous() or dst.numel() < PARALLEL_MIN):
        dst.copy_(src)
        return
    d, s = dst.view(-1), src.view(-1)
    run(d.numel(), lambda a, b: d[a:b].copy_(s[a:b]))
