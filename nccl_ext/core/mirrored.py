"""Collectives whose every member contributes this rank's data: a folded capture's group whose
only captured member is this rank (a data-parallel gradient reduction: every other replica is
mirrored by it). The coordinator would compute the result from the same contributions; here the
rank computes it on its own device with the coordinator's arithmetic, so the tensors never leave
the device and the rank never waits for an answer.

Same bits as the coordinator (:func:`nccl_ext.core.ops.compute` over ``n`` copies of the
contribution; reductions of more than :data:`EXACT_FOLD_MAX` members add the contribution and
the contribution times ``n - 1``, as ``prism_launch/capture/folded_reduction.py`` does): every
step is one elementwise IEEE operation, whose result does not depend on the device. An in-place
reduction folds one slice of the tensor at a time through ``scratch`` (a buffer the transport
holds outside the program's memory figures), so nothing is allocated beside the program's
memory, as with a real backend.
"""

from __future__ import annotations

import torch

from nccl_ext.core.ops import Collective, ReduceKind, fold
from nccl_ext.core.call import CollectiveCall

EXACT_FOLD_MAX = 64
"""Folded groups up to this size reduce member by member, exactly as a full capture would; larger
SUM/AVG reductions add each stand-in's contribution once, scaled by how many members it stands
in for."""

SUPPORTED = frozenset({Collective.ALL_REDUCE, Collective.REDUCE, Collective.BROADCAST, Collective.ALL_GATHER,
                       Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL, Collective.BARRIER})
"""Kinds computed here (gather and scatter still go through the coordinator)."""


def weighted(reduce: ReduceKind | None, n: int) -> bool:
    """Whether a folded reduction of ``n`` members scales stand-ins instead of folding each."""
    return n > EXACT_FOLD_MAX and reduce in (ReduceKind.SUM, ReduceKind.AVG)


def _div(acc: torch.Tensor, n: int) -> None:
    if acc.is_floating_point() or acc.is_complex():
        acc.div_(n)
    else:
        acc.div_(n, rounding_mode="floor")


def _reduce_into(out: torch.Tensor, src: torch.Tensor, reduce: ReduceKind, n: int, scratch: torch.Tensor) -> None:
    """``out`` = the fold of ``n`` copies of ``src`` (``out`` may be ``src``), one slice at a time."""
    if not out.is_contiguous():
        target = out.contiguous()
        _reduce_into(target, target if src is out else src, reduce, n, scratch)
        out.copy_(target)
        return
    flat_out, flat_src = out.view(-1), src.reshape(-1)
    step = max(1, scratch.numel() // src.element_size())
    for s in range(0, flat_out.numel(), step):
        e = min(flat_out.numel(), s + step)
        part = flat_out[s:e]
        orig = scratch[: (e - s) * src.element_size()].view(src.dtype)
        if weighted(reduce, n):
            torch.mul(flat_src[s:e], n - 1, out=orig)  # the stand-in's n - 1 copies, scaled
            if part.data_ptr() != flat_src[s:e].data_ptr():
                part.copy_(flat_src[s:e])
            part.add_(orig)
            if reduce is ReduceKind.AVG:
                _div(part, n)
        else:
            orig.copy_(flat_src[s:e])
            fold(reduce, [orig] * n, out=part)


def results(call: CollectiveCall, n: int, me: int, scratch: torch.Tensor) -> list[torch.Tensor]:
    """Member ``me``'s result tensors of ``call`` on a group of ``n`` members that all contribute
    what this rank contributes; reductions are written into the caller's tensors."""
    kind = call.kind
    with torch.no_grad():
        if kind is Collective.BARRIER:
            return []
        if kind in (Collective.ALL_REDUCE, Collective.REDUCE):
            if kind is Collective.REDUCE and me != call.root:
                return []
            for t in call.tensors:
                _reduce_into(t, t, call.reduce, n, scratch)
            return list(call.tensors)
        if kind is Collective.BROADCAST:  # the root (or the stand-in for it) is this rank's own buffer
            return list(call.tensors if call.tensors is not None else call.standin or [])
        if kind is Collective.ALL_GATHER:
            return [t for t in call.tensors for _ in range(n)]
        if kind is Collective.REDUCE_SCATTER:
            k = len(call.tensors) // n
            outs = call.outputs
            if outs is None or len(outs) != k:
                raise ValueError(f"{call.api}: a mirrored reduce-scatter needs its {k} output tensor(s)")
            for i, o in enumerate(outs):
                _reduce_into(o, call.tensors[i * n + me], call.reduce, n, scratch)
            return list(outs)
        if kind is Collective.ALL_TO_ALL:
            return [call.tensors[me]] * n
    raise ValueError(f"{call.api}: {kind} is not computed on the rank (see SUPPORTED)")
