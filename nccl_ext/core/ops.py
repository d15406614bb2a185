"""Semantics of every collective, as a pure function of all members' contributions.

The capture coordinator and the emulation replay both compute results through
:func:`compute`, folding contributions in group-rank order. Because the arithmetic
and its order are the same in both phases, a sandbox rank whose live contribution
equals the recorded one receives a bit-identical result.

A *contribution* is the list of tensors one member puts into a collective, already
split into the pieces the semantics address (e.g. the ``n`` chunks of a
reduce-scatter input, the per-destination pieces of an all-to-all).
"""

from __future__ import annotations

from enum import StrEnum

import torch


class Collective(StrEnum):
    """The semantic kinds every torch.distributed collective maps onto."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"


class ReduceKind(StrEnum):
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


def reduce_kind(op) -> ReduceKind:
    """Map a ``torch.distributed.ReduceOp`` (or its RedOpType) to a :class:`ReduceKind`."""
    import torch.distributed as dist

    table = {
        dist.ReduceOp.SUM: ReduceKind.SUM,
        dist.ReduceOp.AVG: ReduceKind.AVG,
        dist.ReduceOp.PRODUCT: ReduceKind.PRODUCT,
        dist.ReduceOp.MIN: ReduceKind.MIN,
        dist.ReduceOp.MAX: ReduceKind.MAX,
        dist.ReduceOp.BAND: ReduceKind.BAND,
        dist.ReduceOp.BOR: ReduceKind.BOR,
        dist.ReduceOp.BXOR: ReduceKind.BXOR,
    }
    for key, kind in table.items():
        if op == key:
            return kind
    raise NotImplementedError(
        f"reduce op {op!r} is not supported by the prism process group "
        "(supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)"
    )


def _pickled_factor(op):
    """The factor in a ReduceOp's pickled state ``(PREMUL_SUM, factor)``: torch before 2.12 has no
    ``factor`` attribute, and a ReduceOp read back from collective options is a fresh wrapper;
    the factor is a float, a tensor, or a one-tensor list by version."""
    try:
        state = op.__getstate__()
    except (AttributeError, RuntimeError, TypeError):
        return None
    factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
    if isinstance(factor, (list, tuple)):
        factor = factor[0] if len(factor) == 1 else None
    return factor


def premul_factor(op):
    """The factor of a ``ReduceOp.PREMUL_SUM(factor)`` (a float or a one-element tensor); None
    for any other op."""
    import torch.distributed as dist

    if getattr(op, "op", op) != dist.ReduceOp.RedOpType.PREMUL_SUM:
        return None
    factor = getattr(op, "factor", None)
    if factor is None:
        factor = _pickled_factor(op)
    if factor is None:
        raise NotImplementedError(f"reduce op {op!r}: a PREMUL_SUM without its factor (build it with "
                                  "ReduceOp.PREMUL_SUM(factor)) is not supported by the prism process group")
    return factor


def reduce_inputs(opts, tensors: list[torch.Tensor]) -> tuple[ReduceKind, list[torch.Tensor]]:
    """The reduction and the tensors this rank contributes for a reducing collective's
    ``opts``: ``PREMUL_SUM(f)`` (FSDP2's gradient division by a factor other than the group
    size) is a SUM of every input multiplied by ``f`` first, as NCCL computes it; the products
    are fresh tensors (the caller's inputs are left as they are). Other ops contribute the
    tensors themselves."""
    if opts is None:
        return ReduceKind.SUM, list(tensors)
    factor = premul_factor(opts.reduceOp)
    if factor is None:
        return reduce_kind(opts.reduceOp), list(tensors)
    with torch.no_grad():
        return ReduceKind.SUM, [t * (factor.to(t.device, t.dtype) if isinstance(factor, torch.Tensor) else factor)
                                for t in tensors]


def fold(kind: ReduceKind, tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce ``tensors`` left to right in the given (group-rank) order, into ``out`` when given
    (the device data path's pool scratch) or a fresh buffer outside the program's allocator.

    Each step is one elementwise IEEE operation, so the bits do not depend on the device that
    runs the fold: a sandbox folding on its GPU reproduces the capture's host fold exactly."""
    from nccl_ext.core.wire import untracked_empty

    first = tensors[0]
    if out is not None:
        acc = out
    else:
        acc = untracked_empty(first.shape, first.dtype) if first.device.type == "cpu" else torch.empty_like(first)
    acc.copy_(first)
    if len(tensors) > _CHUNKED_MIN_TERMS and acc.numel() > _CHUNK and kind in (ReduceKind.SUM, ReduceKind.AVG) \
            and acc.device.type == "cpu" \
            and all(t.is_contiguous() and t.shape == first.shape for t in tensors):
        _fold_sum_chunked(acc, tensors)
        if kind is ReduceKind.AVG:
            acc.div_(len(tensors)) if acc.is_floating_point() or acc.is_complex() else acc.div_(len(tensors), rounding_mode="floor")
        return acc
    for t in tensors[1:]:
        match kind:
            case ReduceKind.SUM | ReduceKind.AVG:
                acc.add_(t)
            case ReduceKind.PRODUCT:
                acc.mul_(t)
            case ReduceKind.MIN:
                torch.minimum(acc, t, out=acc)
            case ReduceKind.MAX:
                torch.maximum(acc, t, out=acc)
            case ReduceKind.BAND:
                acc.bitwise_and_(t)
            case ReduceKind.BOR:
                acc.bitwise_or_(t)
            case ReduceKind.BXOR:
                acc.bitwise_xor_(t)
    if kind is ReduceKind.AVG:
        if acc.is_floating_point() or acc.is_complex():
            acc.div_(len(tensors))
        else:
            acc.div_(len(tensors), rounding_mode="floor")
    return acc


_CHUNK = 1 << 16
_CHUNKED_MIN_TERMS = 16


def _fold_sum_chunked(acc: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """The same left-to-right sum, one cache-sized slice of the elements at a time. Each
    element's additions happen in the same order as in the plain fold, so the bits are the
    same; a long fold (a data-parallel reduction over thousands of members) then streams each
    slice of the accumulator through cache once instead of once per member."""
    flat = acc.view(-1)
    views = [t.reshape(-1) for t in tensors[1:]]
    n = flat.numel()
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        part = flat[s:e]
        for v in views:
            part.add_(v[s:e])


def contributors(kind: Collective, size: int, root: int | None) -> list[int]:
    """Group ranks whose tensors the result depends on."""
    if kind in (Collective.BROADCAST, Collective.SCATTER):
        return [root]
    if kind is Collective.BARRIER:
        return []
    return list(range(size))


def compute(
    kind: Collective,
    contributions: list[list[torch.Tensor] | None],
    *,
    reduce: ReduceKind | None = None,
    root: int | None = None,
) -> list[list[torch.Tensor]]:
    """Each member's result tensors, given every member's contribution in group-rank order.

    ``contributions[m]`` may be ``None`` for a member that contributes nothing to ``kind``
    (non-roots of broadcast/scatter, everyone in a barrier).
    """
    n = len(contributions)
    match kind:
        case Collective.BARRIER:
            return [[] for _ in range(n)]
        case Collective.ALL_REDUCE:
            k = len(contributions[0])
            out = [fold(reduce, [c[i] for c in contributions]) for i in range(k)]
            return [out for _ in range(n)]
        case Collective.REDUCE:
            k = len(contributions[0])
            out = [fold(reduce, [c[i] for c in contributions]) for i in range(k)]
            return [out if m == root else [] for m in range(n)]
        case Collective.BROADCAST:
            return [list(contributions[root]) for _ in range(n)]
        case Collective.ALL_GATHER:
            k = len(contributions[0])
            out = [contributions[m][i] for i in range(k) for m in range(n)]
            return [out for _ in range(n)]
        case Collective.GATHER:
            return [[c[0] for c in contributions] if m == root else [] for m in range(n)]
        case Collective.SCATTER:
            return [[contributions[root][m]] for m in range(n)]
        case Collective.REDUCE_SCATTER:
            k = len(contributions[0]) // n
            return [
                [fold(reduce, [c[i * n + j] for c in contributions]) for i in range(k)]
                for j in range(n)
            ]
        case Collective.ALL_TO_ALL:
            return [[c[j] for c in contributions] for j in range(n)]
    raise ValueError(f"unknown collective {kind!r}")
