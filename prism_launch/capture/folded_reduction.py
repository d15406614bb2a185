"""Reductions over large folded groups (a data-parallel gradient reduction over thousands of
replicas, most of them not captured): each stand-in's contribution added once, scaled by how many
members it stands in for.

A gradient bucket is tens of millions of elements and the coordinator computes it on the host
while the captured ranks wait, so a large sum runs in slices on a few threads (torch's
elementwise kernels release the interpreter; no OpenMP in a process that forks ranks): each
element sees the same operations in the same order as in one pass — the bits do not depend on
the slicing."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from nccl_ext.mirrored import EXACT_FOLD_MAX, weighted
from nccl_ext.ops import Collective, ReduceKind
from nccl_ext.wire import untracked_empty

__all__ = ["EXACT_FOLD_MAX", "PARALLEL_MIN", "weighted_reduction", "weighted_sum"]

PARALLEL_MIN = 1 << 20
"""Elements from which a weighted sum runs in slices on several threads."""
_SLICE = 1 << 18
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                   thread_name_prefix="prism-fold")
    return _pool


def _sum_slice(out: torch.Tensor, terms: list[tuple[torch.Tensor, int]], s: int, e: int) -> None:
    part = out[s:e]
    first, k = terms[0]
    part.copy_(first[s:e]) if k == 1 else torch.mul(first[s:e], k, out=part)
    scratch = None
    for t, k in terms[1:]:
        if k == 1:
            part.add_(t[s:e])
        else:  # the scaled term rounded in its dtype, then added: as ``acc + t * k``
            if scratch is None:
                scratch = torch.empty_like(part)
            torch.mul(t[s:e], k, out=scratch)
            part.add_(scratch)


def weighted_sum(terms: list[tuple[torch.Tensor, int]], reduce: ReduceKind, n: int) -> torch.Tensor:
    """``Σ t·k`` over ``terms`` (left to right, each scaled term rounded before it is added;
    ``k == 1`` unscaled), divided by ``n`` for AVG: in slices on several threads when large."""
    first = terms[0][0]
    out = untracked_empty(first.shape, first.dtype) if first.device.type == "cpu" else torch.empty_like(first)
    flat = out.view(-1)
    flats = [(t.reshape(-1), k) for t, k in terms]
    total = flat.numel()
    if first.device.type == "cpu" and total >= PARALLEL_MIN:
        list(_threads().map(lambda s: _sum_slice(flat, flats, s, min(total, s + _SLICE)), range(0, total, _SLICE)))
    else:
        _sum_slice(flat, flats, 0, total)
    if reduce is ReduceKind.AVG:
        out.div_(n) if out.is_floating_point() or out.is_complex() else out.div_(n, rounding_mode="floor")
    return out


def weighted_reduction(pc, group) -> list | None:
    """SUM/AVG reductions of a large folded group: captured members' contributions in group order,
    then each stand-in's contribution times the number of uncaptured members it stands for."""
    n = len(group.ranks)
    if pc.kind not in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER) or not weighted(pc.reduce, n):
        return None
    index = {r: i for i, r in enumerate(group.ranks)}
    counts: dict[int, int] = {}
    for i, c in enumerate(pc.contributions):
        if c is None:
            s = index[group.sources[i]]
            counts[s] = counts.get(s, 0) + 1
    terms = [(c, 1) for c in pc.contributions if c is not None]
    terms += [(pc.contributions[s], k) for s, k in counts.items()]

    def reduce(i: int) -> torch.Tensor:
        return weighted_sum([(c[i], k) for c, k in terms], pc.reduce, n)

    if pc.kind is Collective.REDUCE_SCATTER:
        k = len(terms[0][0]) // n
        return [[reduce(i * n + j) for i in range(k)] if j in pc.arrivals else None for j in range(n)]
    out = [reduce(i) for i in range(len(terms[0][0]))]
    if pc.kind is Collective.REDUCE:
        return [out if m == pc.root else [] for m in range(n)]
    return [out if m in pc.arrivals else None for m in range(n)]
