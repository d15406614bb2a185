"""Reductions over large folded groups (a data-parallel gradient reduction over thousands of
replicas, most of them not captured): each stand-in's contribution added once, scaled by how many
members it stands in for."""

from __future__ import annotations

import torch

from nccl_ext.mirrored import EXACT_FOLD_MAX, weighted
from nccl_ext.ops import Collective, ReduceKind, fold

__all__ = ["EXACT_FOLD_MAX", "weighted_reduction"]


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
    terms = [c for c in pc.contributions if c is not None]
    terms += [[t * k for t in pc.contributions[s]] for s, k in counts.items()]

    def reduce(pieces: list[torch.Tensor]) -> torch.Tensor:
        out = fold(ReduceKind.SUM, pieces)
        if pc.reduce is ReduceKind.AVG:
            out.div_(n) if out.is_floating_point() or out.is_complex() else out.div_(n, rounding_mode="floor")
        return out

    if pc.kind is Collective.REDUCE_SCATTER:
        k = len(terms[0]) // n
        return [[reduce([c[i * n + j] for c in terms]) for i in range(k)] if j in pc.arrivals else None
                for j in range(n)]
    out = [reduce([c[i] for c in terms]) for i in range(len(terms[0]))]
    if pc.kind is Collective.REDUCE:
        return [out if m == pc.root else [] for m in range(n)]
    return [out if m in pc.arrivals else None for m in range(n)]
