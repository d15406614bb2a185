"""Reductions over large folded groups (a data-parallel gradient reduction over thousands of
replicas, most of them not captured): each stand-in's contribution added once, scaled by how many
members it stands in for (:mod:`nccl_ext.core.replica_sums`: the same arithmetic as the captured members
that compute their own results); a large sum in slices on a few threads (:mod:`nccl_ext.core.sliced`)."""

from __future__ import annotations

import torch

from nccl_ext.core.replica_sums import terms, weighted_sum
from nccl_ext.core.mirrored import EXACT_FOLD_MAX, weighted
from nccl_ext.core.ops import Collective

__all__ = ["EXACT_FOLD_MAX", "exchanged_terms", "weighted_reduction", "weighted_sum"]


def _terms(pc, group) -> list[tuple[int, int]]:
    index = {r: i for i, r in enumerate(group.ranks)}
    return terms([c is not None for c in pc.contributions], [index[s] for s in group.sources])


def weighted_reduction(pc, group) -> list | None:
    """SUM/AVG reductions of a large folded group: captured members' contributions in group order,
    then each stand-in's contribution times the number of uncaptured members it stands for."""
    n = len(group.ranks)
    if pc.kind not in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER) or not weighted(pc.reduce, n):
        return None
    parts = [(pc.contributions[g], k) for g, k in _terms(pc, group)]

    def reduce(i: int) -> torch.Tensor:
        return weighted_sum([(c[i], k) for c, k in parts], pc.reduce, n)

    if pc.kind is Collective.REDUCE_SCATTER:
        k = len(parts[0][0]) // n
        return [[reduce(i * n + j) for i in range(k)] if j in pc.arrivals else None for j in range(n)]
    out = [reduce(i) for i in range(len(parts[0][0]))]
    if pc.kind is Collective.REDUCE:
        return [out if m == pc.root else [] for m in range(n)]
    return [out if m in pc.arrivals else None for m in range(n)]


def exchanged_terms(pc, group) -> list[tuple[int, int]] | None:
    """The terms (group rank, factor) a folded group's exchanged collective is summed from — the
    members compute their own results (:func:`nccl_ext.core.replica_sums.exchangeable`) and stage those the
    trace keeps — or None where the group is not folded."""
    if group.sources is None:
        return None
    index = {r: i for i, r in enumerate(group.ranks)}
    return terms([g in pc.arrivals for g in range(len(group.ranks))], [index[s] for s in group.sources])
