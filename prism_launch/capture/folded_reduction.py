"""Reductions over large folded groups (a data-parallel gradient reduction over thousands of
replicas, most of them not captured): each stand-in's contribution added once, scaled by how many
members it stands in for (:mod:`nccl_ext.folded`: the same arithmetic as the captured members
that compute their own results); a large sum in slices on a few threads (:mod:`nccl_ext.sliced`)."""

from __future__ import annotations

import time

import torch

from nccl_ext.folded import shard_indices, terms, weighted_sum
from nccl_ext.mirrored import EXACT_FOLD_MAX, weighted
from nccl_ext.ops import Collective
from prism_launch.capture.piece_refs import materialized

__all__ = ["EXACT_FOLD_MAX", "exchanged_terms", "kept_results", "weighted_reduction", "weighted_sum"]


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
    members compute their own results (:func:`nccl_ext.folded.exchangeable`) — or None where
    the group is not folded."""
    if group.sources is None:
        return None
    index = {r: i for i, r in enumerate(group.ranks)}
    return terms([g in pc.arrivals for g in range(len(group.ranks))], [index[s] for s in group.sources])


def kept_results(pc, group, parts: list[tuple[int, int]], ranks: list[tuple[int, int]]):
    """Work for a notes thread: the results of the members ``ranks`` (``(group rank, rank)``) of
    an exchanged folded collective — what the trace keeps of them, as replay cannot recompute
    them — from the members' host copies (``pc.contributions``: piece references, read once every
    member has read). Returns ``({rank: tensors}, seconds)``."""
    n = len(group.ranks)
    refs = {g: pc.contributions[g] for g, _ in parts}
    kind, reduce = pc.kind, pc.reduce

    def compute():
        t0 = time.perf_counter()
        pieces = {g: materialized(r) for g, r in refs.items()}
        first = pieces[parts[0][0]]
        out = {}
        for g, rank in ranks:
            out[rank] = [weighted_sum([(pieces[s][i], k) for s, k in parts], reduce, n)
                         for i in shard_indices(kind, len(first), n, g)]
        return out, time.perf_counter() - t0

    return compute


class FoldedResults:
    """Mixed into :class:`~prism_launch.capture.coordinator.Coordinator` (its ``scope``, ``sink``,
    ``busy_s``, ``_count`` and notes' ``_submit``)."""

    def _keep_folded(self, pc, parts: list[tuple[int, int]]) -> None:
        """An exchanged folded collective: the results of its members in the trace's scope are
        computed from their host copies on a notes thread once every member has read (queued with
        the op's held notes) and kept as a coordinator-computed folded result is."""
        ranks = [(g, a.rank) for g, a in pc.arrivals.items() if self.scope is None or a.rank in self.scope]
        if not ranks:
            return
        group_id, seq = pc.group.id, pc.seq

        def keep(done) -> None:
            out, seconds = done
            self.busy_s["compute"] += seconds
            for rank, tensors in out.items():
                self.sink.record_tensors(rank, [f"r/{group_id}/{seq}/{i}" for i in range(len(tensors))], tensors)
                self._count(sum(t.numel() * t.element_size() for t in tensors))

        pc.held.append((self._submit, (kept_results(pc, pc.group, parts, ranks), keep)))
