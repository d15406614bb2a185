"""Compensation on device: member ``me``'s result of a collective from its live pieces and the
virtual members' staged ones, folded with :func:`nccl_ext.core.ops.fold` in group-rank order into
pool scratch — the capture's arithmetic step for step, so results are bit-identical to it
(IEEE adds, multiplies, min/max are exact per step on any device) — and which of a virtual
member's pieces that result is made of (what the stager stages)."""

from __future__ import annotations

import torch

from nccl_ext.core.ops import Collective, ReduceKind, fold


def needed_pieces(kind: Collective, n: int, me: int, root: int | None, member: int, pieces: int) -> list[int]:
    """Indices of virtual ``member``'s contribution pieces that member ``me``'s result is made of."""
    match kind:
        case Collective.ALL_REDUCE | Collective.ALL_GATHER:
            return list(range(pieces))
        case Collective.REDUCE:
            return list(range(pieces)) if me == root else []
        case Collective.REDUCE_SCATTER:
            return [i * n + me for i in range(pieces // n)]
        case Collective.GATHER:
            return [0] if me == root else []
        case Collective.ALL_TO_ALL:
            return [me]
        case Collective.BROADCAST:
            return list(range(pieces)) if member == root else []
        case Collective.SCATTER:
            return [me] if member == root else []
    return []


def result_of(kind: Collective, n: int, me: int, root: int | None, live: list[torch.Tensor] | None,
              terms: dict[int, dict[int, torch.Tensor]], scratch: list[torch.Tensor],
              reduce: ReduceKind | None) -> list[torch.Tensor]:
    """Member ``me``'s result (the semantics of :func:`nccl_ext.core.ops.compute`), from its live
    pieces and the virtual members' needed pieces ``terms[m][i]``; reductions fold into
    ``scratch``."""

    def piece(m: int, i: int) -> torch.Tensor:
        return live[i] if m == me else terms[m][i]

    match kind:
        case Collective.BARRIER:
            return []
        case Collective.ALL_REDUCE | Collective.REDUCE:
            if kind is Collective.REDUCE and me != root:
                return []
            return [fold(reduce, [piece(m, i) for m in range(n)], out=scratch[i]) for i in range(len(scratch))]
        case Collective.REDUCE_SCATTER:
            return [fold(reduce, [piece(m, i * n + me) for m in range(n)], out=scratch[i]) for i in range(len(scratch))]
        case Collective.ALL_GATHER:
            k = len(live)
            return [piece(m, i) for i in range(k) for m in range(n)]
        case Collective.GATHER:
            return [piece(m, 0) for m in range(n)] if me == root else []
        case Collective.ALL_TO_ALL:
            return [piece(m, me) for m in range(n)]
        case Collective.BROADCAST:
            return list(live) if me == root else [terms[root][i] for i in sorted(terms[root])]
        case Collective.SCATTER:
            return [piece(root, me)]
    raise ValueError(f"unknown collective {kind!r}")

