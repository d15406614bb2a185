"""Synthesized collectives: results computed on the rank's own device as if every other member
contributed what this rank contributes (the lean trace's ``payload=none``).

torch's ``fake`` backend leaves data untouched, which keeps shapes right but hands a program
uninitialised receive buffers (NaN, out-of-range token ids) and answers an all-reduce with
one member's share. Here each member is a copy of this rank, so results have the magnitude
the real job's have and stay finite:

- all-reduce / reduce (to the root) with SUM: ``n * x`` (a data-parallel gradient scaled by
  ``1/n`` before the sum comes back as itself); AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR: ``x``;
- all-gather / gather: ``x`` in every member's place (views: no copy);
- reduce-scatter: this rank's chunk times ``n`` (SUM) or as is;
- all-to-all: the piece this rank addresses to itself, from every member — so split sizes
  exchanged by an earlier all-to-all (MoE token counts) agree with the pieces that follow;
  where a received piece's size still differs, it is filled (below);
- broadcast / scatter from another root, and point-to-point receives: the buffer is filled
  (:func:`fill`: finite, deterministic, valid as a token id).
  Small broadcasts carry the program's control flow (Megatron broadcasts its do-train flags
  and batch tensors from a tensor-parallel source rank): a transport records and serves those
  for real (:data:`CARRY_BYTES`), this module only fills what it does not carry.

Results are written into the caller's own tensors (in place for an all-reduce, into
``CollectiveCall.outputs`` otherwise), so nothing is allocated beside the program's memory.
"""

from __future__ import annotations

import torch

from nccl_ext.core.ops import Collective, ReduceKind
from nccl_ext.core.call import CollectiveCall

CARRY_BYTES = 64 * 1024
"""Broadcasts up to this many bytes keep their real payload under ``payload=none``."""


_SEED = 0x5EED


def fill(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled in place with synthesized values: floating point uniform in [0.5, 1.5) from a
    generator of its own, seeded alike every time (the program's random state is untouched,
    capture and emulation draw the same values; not constant, so a layer norm of a received
    activation does not vanish); integers and booleans 0 (a valid token id, no mask)."""
    with torch.no_grad():
        if t.is_floating_point():
            gen = torch.Generator(device=t.device)
            gen.manual_seed(_SEED)
            t.uniform_(0.5, 1.5, generator=gen)
        elif t.is_complex():
            t.fill_(1)
        else:
            t.zero_()
    return t


def payload_bytes(call: CollectiveCall) -> int:
    """Bytes a broadcast or scatter moves (whoever holds the buffers)."""
    tensors = call.tensors if call.tensors is not None else (call.standin or call.outputs or [])
    return sum(t.numel() * t.element_size() for t in tensors)


def carried(call: CollectiveCall, limit: int = CARRY_BYTES) -> bool:
    """Whether a collective keeps its real payload under ``payload=none`` (broadcasts up to
    ``limit`` bytes; scatters are synthesized)."""
    return call.kind is Collective.BROADCAST and payload_bytes(call) <= limit


def _scaled(x: torch.Tensor, reduce: ReduceKind | None, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    target = x if out is None else out
    with torch.no_grad():
        if reduce is ReduceKind.SUM:
            if out is None:
                target.mul_(n)
            else:
                torch.mul(x.reshape(target.shape), n, out=target)
        elif out is not None:
            target.copy_(x.reshape(target.shape))
    return target


def _piece(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if src.numel() == out.numel():
            out.copy_(src.reshape(out.shape))
        else:
            fill(out)
    return out


def results(call: CollectiveCall, size: int, me: int) -> list[torch.Tensor]:
    """This member's result tensors of ``call`` in a group of ``size``, synthesized as above
    and written into the caller's tensors."""
    n, kind = size, call.kind
    if kind is Collective.BARRIER:
        return []
    if kind is Collective.ALL_REDUCE:
        return [_scaled(t, call.reduce, n) for t in call.tensors]
    if kind is Collective.REDUCE:
        return [_scaled(t, call.reduce, n) for t in call.tensors] if me == call.root else []
    if kind is Collective.BROADCAST:
        return [] if me == call.root else [fill(t) for t in call.standin or []]
    if kind is Collective.ALL_GATHER:
        return [t for t in call.tensors for _ in range(n)]
    if kind is Collective.GATHER:
        return [call.tensors[0]] * n if me == call.root else []
    if kind is Collective.SCATTER:
        if me == call.root:
            return [call.tensors[me]]
        return [fill(t) for t in call.outputs or []]
    if kind is Collective.REDUCE_SCATTER:
        k = len(call.tensors) // n
        outs = call.outputs
        if outs is None or len(outs) != k:
            raise ValueError(f"{call.api}: a synthesized reduce-scatter needs the {k} output tensor(s)")
        return [_scaled(call.tensors[i * n + me], call.reduce, n, out=outs[i]) for i in range(k)]
    if kind is Collective.ALL_TO_ALL:
        mine = call.tensors[me]
        outs = call.outputs
        if outs is None or len(outs) != n:
            raise ValueError(f"{call.api}: a synthesized all-to-all needs its {n} output pieces")
        return [_piece(mine, o) for o in outs]
    raise ValueError(f"unknown collective {kind!r}")
