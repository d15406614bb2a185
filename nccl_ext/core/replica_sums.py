"""The arithmetic of a SUM/AVG reduction over a large folded group (a data-parallel gradient
reduction over hundreds of replicas, few of them captured): each captured member's contribution
added once, in group-rank order, then each stand-in's contribution times the number of uncaptured
members it stands in for, each scaled term rounded in its dtype before it is added, the sum divided
by the group's size for AVG. Every step is one elementwise IEEE operation, so the bits do not
depend on how the work is sliced, and the capture's coordinator
(``prism_launch/capture/folded_reduction.py``) and the captured members that compute their own
results from each other's staged contributions (:mod:`nccl_ext.capture.rank_exchange`) get the same —
but for an AVG on CUDA, which divides by a host scalar as a product with its reciprocal (the
trace keeps a member's own result, so emulation serves the bits its program got).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nccl_ext.core import sliced
from nccl_ext.core.mirrored import weighted
from nccl_ext.core.ops import Collective, ReduceKind
from nccl_ext.core.wire import untracked_empty

__all__ = ["KINDS", "exchangeable", "fold_into", "shard_indices", "terms", "weighted_sum"]

KINDS = (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)
"""Kinds whose folded weighted reductions the captured members may compute themselves."""


def exchangeable(kind: Collective, reduce: ReduceKind | None, ranks: Sequence[int], captured, most: int) -> bool:
    """Whether a collective on a folded group is computed by its captured members from each
    other's staged contributions: a weighted SUM/AVG all-reduce or reduce-scatter whose group has
    between 2 and ``most`` captured members (one alone mirrors the group: :mod:`nccl_ext.core.mirrored`)."""
    if captured is None or kind not in KINDS or not weighted(reduce, len(ranks)):
        return False
    present = sum(1 for r in ranks if r in captured)
    return 2 <= present <= most and present < len(ranks)


def terms(present: Sequence[bool], sources: Sequence[int]) -> list[tuple[int, int]]:
    """``(group rank, factor)`` of each term of the sum, in order: the present (captured)
    members, then each stand-in (``sources[i]``: the group rank standing in for member ``i``) with
    the number of absent members it stands in for, in order of their first absent member."""
    counts: dict[int, int] = {}
    for i, here in enumerate(present):
        if not here:
            counts[sources[i]] = counts.get(sources[i], 0) + 1
    return [(g, 1) for g, here in enumerate(present) if here] + list(counts.items())


def shard_indices(kind: Collective, pieces: int, n: int, me: int) -> list[int]:
    """The pieces of a contribution that member ``me``'s result reduces (all of an all-reduce's;
    of a reduce-scatter's ``pieces`` — ``k`` per member — those addressed to ``me``)."""
    if kind is Collective.REDUCE_SCATTER:
        return [i * n + me for i in range(pieces // n)]
    return list(range(pieces))


def _sum_slice(out: torch.Tensor, flats: list[tuple[torch.Tensor, int]], s: int, e: int, avg: int | None,
               buf: torch.Tensor | None) -> None:
    """``out[s:e]`` = the weighted sum of ``flats[..][s:e]``. ``buf``: room for ``e - s`` elements
    (a scaled term, or a term from another device, is put there first); None: allocated here."""
    part = out[s:e]
    if buf is None:
        buf = torch.empty_like(part)

    def here(t: torch.Tensor) -> torch.Tensor:
        if t.device == part.device:
            return t
        buf.copy_(t)
        return buf

    first, k = flats[0]
    if k == 1:
        part.copy_(first[s:e])
    else:
        torch.mul(here(first[s:e]), k, out=part)
    for t, k in flats[1:]:
        src = here(t[s:e])
        if k == 1:
            part.add_(src)
        else:  # the scaled term rounded in its dtype, then added: as ``acc + t * k``
            torch.mul(src, k, out=buf)
            part.add_(buf)
    if avg is not None:
        part.div_(avg) if part.is_floating_point() or part.is_complex() else part.div_(avg, rounding_mode="floor")


def weighted_sum(weighted_terms: list[tuple[torch.Tensor, int]], reduce: ReduceKind, n: int) -> torch.Tensor:
    """``Σ t·k`` over the terms, divided by ``n`` for AVG, in a new tensor (on the host: outside
    torch's allocator, in slices on several threads when large)."""
    first = weighted_terms[0][0]
    out = untracked_empty(first.shape, first.dtype) if first.device.type == "cpu" else torch.empty_like(first)
    flat = out.view(-1)
    flats = [(t.reshape(-1), k) for t, k in weighted_terms]
    avg = n if reduce is ReduceKind.AVG else None
    if first.device.type == "cpu":
        sliced.run(flat.numel(), lambda s, e: _sum_slice(flat, flats, s, e, avg, None))
    else:
        _sum_slice(flat, flats, 0, flat.numel(), avg, None)
    return out


def fold_into(out: torch.Tensor, weighted_terms: list[tuple[torch.Tensor, int]], reduce: ReduceKind, n: int,
              scratch: torch.Tensor) -> None:
    """``out`` (contiguous; the program's own tensor) = the weighted sum, one slice of
    ``scratch`` (bytes, on ``out``'s device) at a time: nothing is allocated beside the program's
    memory. Terms may lie on another device (a peer's contribution staged on the host)."""
    flat = out.view(-1)
    flats = [(t.reshape(-1), k) for t, k in weighted_terms]
    avg = n if reduce is ReduceKind.AVG else None
    step = max(1, scratch.numel() // out.element_size())
    for s in range(0, flat.numel(), step):
        e = min(flat.numel(), s + step)
        buf = scratch[: (e - s) * out.element_size()].view(out.dtype)
        _sum_slice(flat, flats, s, e, avg, buf)
