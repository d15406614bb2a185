"""The coordinator's side of ``payload=none``: metadata rows of ops the ranks synthesized, and the
broadcasts that keep their payload."""

from __future__ import annotations

import time

from nccl_ext.core import protocol, wire
from nccl_ext.core.protocol import Coll, LColl, Meta, Ok, PSend, PRecv
from nccl_ext.core.ops import Collective
from prism_launch.capture.events import EventLog
from prism_launch.capture.notes import TraceNotes, copies
from prism_launch.capture.ops_state import Arrival, PendingCollective
from prism_launch.capture.slots import SlotScheduler
from prism_launch.capture.staged import StagedResults


class SynthesizedOps:
    """Ops the ranks completed themselves, and carried broadcasts. Given the capture's ``log``,
    the coordinator's ``collectives`` in flight (shared: a carried broadcast waits there for its
    payload), its ``views`` of the ranks' arenas, the trace's ``notes``, the ``staged`` data
    (frees), the ``sink`` that stores tensors, the coordinator's ``busy_s`` and ``count(nbytes)``
    (the payload budget), the slot ``scheduler`` and the ``fold`` plan."""

    def __init__(self, log: EventLog, collectives: dict, views, notes: TraceNotes, staged: StagedResults, sink,
                 busy_s: dict, count, scheduler: SlotScheduler, fold) -> None:
        self._log = log
        self._collectives = collectives
        self._views = views
        self._notes = notes
        self._staged = staged
        self.sink = sink
        self.busy_s = busy_s
        self._count = count
        self.scheduler = scheduler
        self.fold = fold

    def on_meta(self, conn, m: Meta | LColl, mirrored: bool = False) -> None:
        """A collective the rank synthesized, or computed itself as a folded group's only captured
        member (``mirrored``: every other member contributes its data, :mod:`nccl_ext.core.mirrored`):
        its event, no tensors, nothing to wait for."""
        key, seq, api, kind, reduce, root, unit, t, wall, cpu, shapes, dtypes, nbytes = m[:13]
        rank = self._log.rank_of[conn]
        group = self._log.group(key)
        extra = {"kind": kind, "reduce": reduce, "root": root, "n": len(shapes), "shapes": shapes,
                 "dtypes": dtypes, "digests": [], "mirrored" if mirrored else "synthesized": True}
        self._log.take_ints(rank, key, seq, extra)
        kept = m.kept if mirrored else None
        row = self._log.row(rank, unit, "collective", api, group, seq, -1, None, t, t, wall, cpu, None,
                            None if kept is not None else extra)
        row["dtype"], row["shape"], row["nbytes"] = (dtypes[0] if dtypes else ""), (shapes[0] if shapes else []), nbytes
        if kept is not None:
            self.kept_mirrored(conn, rank, group, seq, kept, row, extra)
        self._log.ops_completed += 1

    def kept_mirrored(self, conn, rank: int, group, seq: int, kept: tuple, row: dict, extra: dict) -> None:
        """A sandbox rank's mirrored collective: the digest and statistics of its contribution and
        its result (stored, as the coordinator stores a folded result) read where the rank staged
        them, on the notes' worker threads (a data-parallel gradient reduction's are tens of MB:
        the coordinator goes on answering meanwhile); then the rank may reuse the regions."""
        op_id, contribution, result = kept
        mine = self._views.views((rank, *contribution)) if contribution is not None else []
        self._notes.summarize(rank, row, extra, mine, stats=True)
        if result is None:
            out = []
        elif result[0] == "c":
            out = [mine[i] for i in result[1]]
        else:
            out = self._views.views((rank, result[1], result[2]))
        distinct: dict[int, int] = {}  # an all-gather's result is n times the same piece: one copy
        for x in out:
            distinct.setdefault(id(x), len(distinct))
        pieces = list({id(x): x for x in out}.values())

        def store(copies: tuple[list, float]) -> None:
            self.busy_s["copy"] += copies[1]
            t0 = time.perf_counter()
            self.sink.record_tensors(rank, [f"r/{group.id}/{seq}/{i}" for i in range(len(out))],
                                     [copies[0][distinct[id(x)]] for x in out])
            self.busy_s["record"] += time.perf_counter() - t0

        if pieces:
            self._notes.submit(copies, store, pieces)
        self._count(sum(x.numel() * x.element_size() for x in out))
        # the rank may have finished and closed its connection meanwhile (a mirrored op does not
        # wait for the coordinator): its region needs no freeing then
        self._staged.free_contributions([(conn, op_id)])

    def on_p2p_meta(self, conn, m: PSend | PRecv) -> None:
        key, peer, tag, seq, unit, t, wall, cpu, shape, dtype, nbytes = m
        rank = self._log.rank_of[conn]
        group = self._log.group(key)
        op = "send" if isinstance(m, PSend) else "recv"
        extra = {"tag": tag, "kind": op, "n": 1, "shapes": [shape], "dtypes": [dtype], "digests": [],
                 "synthesized": True}
        row = self._log.row(rank, unit, "p2p", op, group, seq, peer, None, t, t, wall, cpu, None, extra)
        row["dtype"], row["shape"], row["nbytes"] = dtype, shape, nbytes
        self._log.ops_completed += 1

    def on_carried_broadcast(self, conn, m: Coll, tensors) -> None:
        """``payload=none``: a broadcast small enough to keep its payload. The root (or, when the
        root is not captured, its stand-in) is answered at once; every other member when the
        payload is here — so ranks that run one after another in rank order never wait for a
        peer that has not started. Each receiver's result is stored for its emulation."""
        op_id, key, seq, api, kind, reduce, root, contributes, unit, t, wall, cpu = m
        rank = self._log.rank_of[conn]
        group = self._log.group(key)
        grank = group.ranks.index(rank)
        pc = self._collectives.get((key, seq))
        if pc is None:
            pc = PendingCollective(group, seq, api, Collective.BROADCAST, None, root, time.monotonic(),
                                    [None] * len(group.ranks))
            self._collectives[(key, seq)] = pc
        contribution = list(tensors) if contributes is True else None
        source = root if group.sources is None else group.ranks.index(group.sources[root])
        if grank == root or (contributes == "standin" and grank == source):
            pc.standins[-1] = list(tensors)  # the payload every receiver takes
        extra = {"kind": kind, "reduce": None, "root": root, "n": len(contribution or ()),
                 "shapes": [list(x.shape) for x in contribution or ()],
                 "dtypes": [wire.dtype_name(x.dtype) for x in contribution or ()],
                 "digests": [wire.digest(x) for x in contribution or ()], "carried": True}
        row = self._log.row(rank, unit, "collective", api, group, seq, -1, contribution, t, t, wall, cpu, None, extra)
        self.scheduler.issued(rank, op_id)
        pc.arrivals[grank] = Arrival(rank, op_id, conn, row)
        payload = pc.standins.get(-1)
        if payload is None:  # the members here wait for the root (or its stand-in): it should run next
            self.scheduler.awaits(group.ranks[source] if group.sources is None else group.sources[root])
            return
        now = time.monotonic() - self._log.t0
        for g, arrival in list(pc.arrivals.items()):
            result = [] if g == root else payload
            if g != root:
                self.sink.record_tensors(arrival.rank, [f"r/{group.id}/{seq}/{i}" for i in range(len(result))],
                                         list(result))
            arrival.row["t_end"] = now
            wire.send(arrival.conn, protocol.encode(Ok(arrival.op_id)), result)
            self.scheduler.answered(arrival.rank, arrival.op_id)
            del pc.arrivals[g]
            pc.contributions[g] = []  # answered
        if all(c is not None for i, c in enumerate(pc.contributions) if self.fold is None or
               self.fold.is_captured(group.ranks[i])):
            del self._collectives[(key, seq)]
            self._log.ops_completed += 1
