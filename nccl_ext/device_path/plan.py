"""What each op of the device path needs from the trace, planned before the run, and what it is
handed when entered.

An op goes through the device path when its only live member is this sandbox rank
(:func:`eligible`). Its :class:`Plan` lists the recorded tensors to stage (:class:`Item`: shape
and dtype now, data when loaded) — the pieces of the virtual members' contributions the
result is made of, a folded group's recorded result, a virtual sender's payload — laid out
back to back at :data:`ALIGN`-byte offsets, its reduction scratch, and this rank's own
recorded pieces (only their word sums are kept). :class:`StagedOp` is the staged op as the
transport takes it: views of the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nccl_ext.core import wire
from nccl_ext.core.errors import DivergenceError
from nccl_ext.device_path.compensation import needed_pieces
from nccl_ext.core.ops import Collective, contributors

ALIGN = 256
"""Every staged piece and scratch tensor starts at a multiple of this many bytes."""


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def eligible(sandbox: tuple[int, ...], rank: int, group_ranks: tuple[int, ...] | None = None,
             peer: int | None = None) -> bool:
    """Whether an op of sandbox ``rank`` goes through the device path: a collective whose other
    members are all virtual, or a send/receive whose peer is virtual. (Ops shared with another
    sandbox rank exchange live data over the physical group.)"""
    if peer is not None:
        return peer not in sandbox
    return not any(r != rank and r in sandbox for r in group_ranks or ())


@dataclass(slots=True)
class StagedOp:
    """One op's staged data as it is handed to the transport (:meth:`DevicePath.take`)."""

    idx: int
    nbytes: int
    terms: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    result: list[torch.Tensor] = field(default_factory=list)
    """A folded group's recorded result, or a virtual sender's payload."""
    scratch: list[torch.Tensor] = field(default_factory=list)
    refs: list[int] = field(default_factory=list)
    """Word sums of this rank's recorded contribution pieces (divergence checks)."""
    span: tuple[int, int] | None = None
    """The op's staged bytes in the pool's data ring (None: nothing staged)."""
    scratch_span: tuple[int, int] | None = None
    """Its scratch in the pool's scratch ring."""
    ready: object = None
    """The side stream's event after the copies (CUDA), None when already there."""
    plan: object = None
    """The op's plan until its tensors are made (views of the pool, on the program's thread
    when it takes the op: the stager then makes no tensor per piece)."""


@dataclass(slots=True)
class Item:
    """A recorded tensor to stage: its shape and dtype now, its data when loaded."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor] | None
    wsum: int | None = None
    """An own piece the trace keeps only statistics of: its recorded word sum (nothing to load)."""

    @property
    def nbytes(self) -> int:
        return wire.numel(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class Plan:
    """What one op needs from the trace (nothing read yet)."""

    idx: int
    terms: dict[int, dict[int, Item]]
    result: list[Item]
    scratch: list[tuple[tuple[int, ...], torch.dtype]]
    own: list[Item]
    """This rank's recorded pieces: only their word sums are kept."""
    tier_at: int = -1
    """Offset of this op's staged pieces in the pinned host tier (-1: not in it)."""
    refs: list[int] | None = None
    """Word sums of ``own``, once the host tier's loader computed them."""
    offsets: list[int] = field(default_factory=list)
    """Where each of :meth:`items` starts from the op's first staged byte, then each scratch
    tensor from the op's first scratch byte (computed once: staging an op is one copy)."""
    staged_nbytes: int = 0
    scratch_nbytes: int = 0

    def __post_init__(self) -> None:
        at = 0
        for t in self.items():
            self.offsets.append(at)
            at += aligned(t.nbytes)
        self.staged_nbytes = at
        at = 0
        for s, d in self.scratch:
            self.offsets.append(at)
            at += aligned(wire.numel(s) * d.itemsize)
        self.scratch_nbytes = at

    @property
    def nbytes(self) -> int:
        """Pool bytes of the op: staged pieces and scratch."""
        return self.staged_nbytes + self.scratch_nbytes

    def items(self) -> list[Item]:
        """The pieces to stage, in the order they are laid out (pool and host tier alike)."""
        return [t for ts in self.terms.values() for t in ts.values()] + list(self.result)


def plan_ops(recording, rank: int, sandbox: tuple[int, ...], check: bool, read_lock: threading.Lock) -> list[Plan]:
    """The plans of ``rank``'s device-path ops, in the trace's order (``check``: with its own
    recorded pieces, for the divergence checks)."""
    plans = []
    with read_lock:
        for op, gid, seq, peer, tag in recording.ops_of(rank):
            plan = plan_op(recording, rank, sandbox, check, op, gid, seq, peer, tag)
            if plan is not None:
                plans.append(plan)
    return plans


def plan_op(rec, rank: int, sandbox: tuple[int, ...], check: bool, op, gid: int, seq: int, peer: int,
            tag: int) -> Plan | None:
    """The plan of one recorded op of ``rank``; None when it does not go through the device path."""

    def items(r: int, o) -> list[Item]:
        if o.stats:  # this rank's own data, kept as statistics only (capture.payload=exact)
            return [Item(tuple(s), wire.dtype_from_name(d), None, st[0])
                    for s, d, st in zip(o.shapes, o.dtypes, o.stats)]
        return [Item(tuple(s), wire.dtype_from_name(d), lambda r=r, i=i: rec.piece(r, gid, seq, i))
                for i, (s, d) in enumerate(zip(o.shapes, o.dtypes))]

    if op.kind in ("send", "recv"):
        if not eligible(sandbox, rank, peer=peer):
            return None
        src, dst = (peer, rank) if op.kind == "recv" else (rank, peer)
        sent = rec.sent(gid, src, dst, tag, seq)
        if sent is None:
            return None
        sop = sent[0]
        item = Item(tuple(sop.shapes[0]), wire.dtype_from_name(sop.dtypes[0]),
                    None if sent[1] is None else (lambda: rec.payload(gid, src, dst, tag, seq)),
                    sop.stats[0][0] if sop.stats else None)
        if op.kind == "recv":
            return Plan(op.idx, {}, [item], [], [])
        return Plan(op.idx, {}, [], [], [item] if check else [])
    if not op.kind:
        return None
    ranks = rec.group_ranks(gid)
    if not eligible(sandbox, rank, ranks):
        return None
    kind = Collective(op.kind)
    n, me = len(ranks), ranks.index(rank)
    own = items(rank, op) if check and me in contributors(kind, n, op.root) else []
    if rec.folded(gid):
        result = [Item(s, d, lambda i=i: rec.result_piece(rank, gid, seq, i))
                  for i, (s, d) in enumerate(rec.result_meta(rank, gid, seq))]
        return Plan(op.idx, {}, result, [], own)
    terms: dict[int, dict[int, Item]] = {}
    for m, r in enumerate(ranks):
        if m == me:
            continue
        if not needed_pieces(kind, n, me, op.root, m, n):
            continue  # nothing of this member (e.g. a broadcast's non-root)
        mop = rec.collective(r, gid, seq)
        if mop is None:
            raise DivergenceError(f"rank {rank}: no recorded op of virtual member rank {r} "
                               f"(group {gid} seq {seq}); the trace is incomplete")
        want = needed_pieces(kind, n, me, op.root, m, mop.n_tensors)  # the member's own count
        pieces = items(r, mop)
        terms[m] = {i: pieces[i] for i in want}
    shapes = [tuple(s) for s in op.shapes]
    dtypes = [wire.dtype_from_name(d) for d in op.dtypes]
    match kind:
        case Collective.ALL_REDUCE:
            scratch = list(zip(shapes, dtypes))
        case Collective.REDUCE:
            scratch = list(zip(shapes, dtypes)) if me == op.root else []
        case Collective.REDUCE_SCATTER:
            scratch = [(shapes[i * n + me], dtypes[i * n + me]) for i in range(op.n_tensors // n)]
        case _:
            scratch = []
    return Plan(op.idx, terms, [], scratch, own)
