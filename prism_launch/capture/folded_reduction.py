"""Reductions over large folded groups (a data-parallel gradient reduction over thousands of
replicas, most of them not captured): each stand-in's contribution added once, scaled by how many
members it stands in for; a large sum in slices on a few threads (:mod:`nccl_ext.sliced`)."""

from __future__ import annotations

import torch

from nccl_ext import sliced
from nccl_ext.mirrored import EXACT_FOLD_MAX, weighted
from nccl_ext.ops import Collective, ReduceKind
from nccl_ext.wire import untracked_empty

__all__ = ["EXACT_FOLD_MAX", "weighted_reduction", "weighted_sum"]


def _sum_slice(out: torch.Tensor, terms: list[tuple[torch.Tensor, int]], s: int, e: int, avg: int | None) -> None:
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
    if avg is not None:
        part.div_(avg) if part.is_floating_point() or part.is_complex() else part.div_(avg, rounding_mode="floor")


def weighted_sum(terms: list[tuple[torch.Tensor, int]], reduce: ReduceKind, n: int) -> torch.Tensor:
    """``Σ t·k`` over ``terms`` (left to right, each scaled term rounded before it is added;
    ``k == 1`` unscaled), divided by ``n`` for AVG: in slices on several threads when large."""
    first = terms[0][0]
    out = untracked_empty(first.shape, first.dtype) if first.device.type == "cpu" else torch.empty_like(first)
    flat = out.view(-1)
    flats = [(t.reshape(-1), k) for t, k in terms]
    avg = n if reduce is ReduceKind.AVG else None
    if first.device.type == "cpu":
        sliced.run(flat.numel(), lambda s, e: _sum_slice(flat, flats, s, e, avg))
    else:
        _sum_slice(flat, flats, 0, flat.numel(), avg)
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
