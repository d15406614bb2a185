"""Live contributions between sandbox ranks of one group, over the physical gloo group: each
sandbox member sends its pieces to every other one that needs them and receives theirs, into
buffers shaped as the recording says (outside the program's allocator)."""

from __future__ import annotations

import zlib
from typing import Protocol

import torch

from nccl_ext.core import wire


class PeeringRank(Protocol):
    """What the exchange uses of the replay transport (:class:`~nccl_ext.replay.transport.ReplayTransport`)."""
    physical: object
    """The physical gloo group of the sandbox ranks."""
    recording: object

    def phys_rank(self, rank: int) -> int:
        """The physical rank of logical sandbox rank ``rank``."""


def tag(*parts: int) -> int:
    """A gloo tag for one message of one op (the same on both ends)."""
    return zlib.crc32(repr(parts).encode()) & 0x3FFFFFFF


def exchange(tr: PeeringRank, group, gid: int, seq: int, call, me: int, needed, live_peers, contributions) -> list:
    """Post this rank's sends and receives of op ``(gid, seq)``; fills ``contributions`` with the
    receive buffers; returns the c10d works. ``tr``: the replay transport."""
    works = []
    if me in needed and call.tensors is not None:
        for m in live_peers:
            dst = tr.phys_rank(group.ranks[m])
            for i, t in enumerate(call.tensors):
                works.append(tr.physical.send([t.detach().contiguous().cpu()], dst, tag(gid, seq, me, i)))
    for m in live_peers:
        if m not in needed:
            continue
        rec = tr.recording.collective(group.ranks[m], gid, seq)
        shapes = rec.shapes if rec else ()
        bufs = [wire.untracked_empty(s, wire.dtype_from_name(d)) for s, d in zip(shapes, rec.dtypes)] if rec else []
        contributions[m] = bufs
        src = tr.phys_rank(group.ranks[m])
        for i, b in enumerate(bufs):
            works.append(tr.physical.recv([b], src, tag(gid, seq, m, i)))
    return works


def barrier_tokens(tr: PeeringRank, group, gid: int, seq: int, me: int, peers: list[int]) -> list:
    """A barrier's real part in emulation: a one-byte token to and from every other sandbox member
    of ``group`` (group ranks ``peers``), so sandbox ranks wait for each other as the program
    expects (one writes a file, the others read it after the barrier). The virtual members'
    part stays replayed. ``tr``: the replay transport."""
    works = []
    for m in peers:
        peer = tr.phys_rank(group.ranks[m])
        works.append(tr.physical.send([torch.zeros(1, dtype=torch.uint8)], peer, tag(gid, seq, me, -1)))
        works.append(tr.physical.recv([torch.empty(1, dtype=torch.uint8)], peer, tag(gid, seq, m, -1)))
    return works
