"""Large contributions and results of collectives the coordinator computes (groups with members
that do not run in a folded capture: data-parallel gradient reductions, the distributed
optimizer's gathers) pass through shared memory instead of the coordinator's socket.

A rank stages its contribution in its arena (``scoll``: where it lies); the coordinator folds
the members' contributions where they lie, with the same arithmetic as for socket-borne ones,
stages each distinct result once in an arena of its own and tells each member where its result
lies (``sok``); the member copies it into its tensors and says so (``xread``). A result region is
freed when every member it went to has read it; a contribution's region once the trace's notes
of it (digest, statistics, kept copy) are taken — without the coordinator waiting for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from nccl_ext.core import protocol, wire
from nccl_ext.core.protocol import SOk, XFree
from nccl_ext.exchange.arena import Arena, detached
from nccl_ext.exchange.ipc import described, is_device_location
from nccl_ext.core.ops import Collective
from prism_launch.capture.piece_refs import refs

COORDINATOR_ARENA = -1
"""The arena id (in place of a rank) of the coordinator's staged results."""

FRESH = (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)
"""Kinds whose results are new tensors; other kinds' results are pieces of the contributions."""


@dataclass(slots=True)
class ResultReads:
    left: int
    token: tuple


class StagedResults:
    """The coordinator's staged data: results it stages in an arena of its own (``exchange``: the
    exchange's directory, None: none), members' contributions and sends read where they lie
    (``views``: the coordinator's :class:`~nccl_ext.exchange.arena.PeerViews`), freed once the
    trace's ``notes`` of them are taken."""

    def __init__(self, exchange: str | None, views, notes) -> None:
        self._views = views
        self._notes = notes
        self._result_arena = Arena(exchange, COORDINATOR_ARENA) if exchange is not None else None
        self._result_reads: dict[tuple[int, int], ResultReads] = {}
        self.staged_bytes = 0
        """Bytes of results handed out through the coordinator's arena."""

    def close(self) -> None:
        if self._result_arena is not None:
            self._result_arena.close()

    def reply(self, arrival, tensors: list, shared: dict) -> None:
        """Stage ``tensors`` (one region per distinct result: members of an all-reduce share it)
        and tell the member where they lie."""
        entry = shared.get(id(tensors))
        if entry is None:
            gen, descs, token = self._result_arena.put(list(tensors))
            self.staged_bytes += sum(t.numel() * t.element_size() for t in tensors)
            entry = shared[id(tensors)] = ((COORDINATOR_ARENA, gen, descs), ResultReads(0, token))
        entry[1].left += 1
        self._result_reads[(arrival.rank, arrival.op_id)] = entry[1]
        wire.send(arrival.conn, protocol.encode(SOk(arrival.op_id, entry[0])))

    def read_result(self, rank: int, op_id: int) -> bool:
        """A member has copied its staged result (False: not a staged result)."""
        reads = self._result_reads.pop((rank, op_id), None)
        if reads is None:
            return False
        reads.left -= 1
        if reads.left == 0:
            self._result_arena.free(reads.token)
        return True

    def located(self, location, reads_data: bool, what: str, lazy: bool = False) -> list:
        """A member's contribution or send (``location``: rank first) where it lies: views of its
        host arena's region, or — staged on its GPU alone — meta tensors of its pieces (shapes
        and dtypes). ``reads_data``: the trace reads its data (an error where only the GPU has
        it). The data of a GPU-staged piece is read once every member has read it. ``lazy``:
        :class:`~prism_launch.capture.piece_refs.PieceRef` s instead, for notes that view them
        on their worker threads."""
        if not is_device_location(location):
            return refs(self._views, *location) if lazy else self._views.views(location)
        rank, _tag, descs, _ev, host = location
        if host is not None:
            return refs(self._views, rank, *host) if lazy else self._views.views((rank, *host))
        if reads_data:
            raise RuntimeError(f"capture: {what}: rank {rank} staged it on its GPU without the host copy the "
                               "trace reads (a sandbox rank's data); capture with capture.gpu_exchange_mib=0")
        return refs(None, rank, 0, descs) if lazy else described(descs)

    def free_contributions(self, owners: list) -> None:
        """Free members' staged contributions once the notes taken of them are done."""
        def free() -> None:
            for conn, op_id in owners:
                try:
                    wire.send(conn, protocol.encode(XFree(op_id)))
                except OSError:
                    pass

        self._notes.after_notes(free)


def recordable(kind: Collective, tensors: list, staged: bool) -> list:
    """What the trace may keep of a folded result: pieces of staged contributions are copied
    (their regions are freed after the op)."""
    if not staged or kind in FRESH:
        return tensors
    copies: dict = {}  # an all-gather's pieces repeat (stand-ins): one copy each
    return [copies[id(t)] if id(t) in copies else copies.setdefault(id(t), detached(t)) for t in tensors]
