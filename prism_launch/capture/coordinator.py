"""The capture coordinator: computes every collective of the logical world from all
members' real contributions and records what replay needs.

It runs in the launcher process, pumped between polls of the rank processes. Ranks
connect over a Unix socket (:mod:`nccl_ext.capture.transport`); results are computed
with :func:`nccl_ext.core.ops.compute` — the same function emulation uses — so replayed
results are bit-identical to captured ones. Every tensor it records goes to its ``sink``
at once (the trace writer's :meth:`~prism_launch.trace.TraceWriter.record_tensor`, which
spills them to disk as they come), so the launcher holds no step's tensors past the op.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection, wait

import torch

from nccl_ext.core import protocol, wire
from nccl_ext.core.protocol import (Bye, Coll, Group, Hello, Ints, LColl, Marker, Memory, Meta, Mirror, Ok, Outs,
                                    Park, PRecv, PSend, Recv, SColl, Send, Stalled, Stats, Wait, XColl, XOk, XRead, XSend)
from nccl_ext.exchange.arena import PeerViews
from nccl_ext.exchange.ipc import is_device_location
from nccl_ext.core.ops import Collective, ReduceKind, compute, contributors
from prism_launch.capture.ep_fold import EpFold
from prism_launch.capture.events import EventLog
from prism_launch.capture.listener import HANDSHAKE_S, RankListener
from prism_launch.capture.folded_reduction import EXACT_FOLD_MAX, exchanged_terms, weighted_reduction
from prism_launch.capture.ops_state import (Arrival, CaptureDeadlineError, CaptureError, Lags, OpGroup,
                                            PayloadBudgetError, PendingCollective, Reads, describe, op_label)
from prism_launch.capture.p2p import PointToPoint
from prism_launch.capture.slots import SlotScheduler
from prism_launch.capture.notes import TraceNotes
from prism_launch.capture.sink import MemorySink
from prism_launch.capture.piece_refs import refs
from prism_launch.capture.staged import StagedResults, recordable
from prism_launch.capture.synthesized import SynthesizedOps


class Coordinator:
    """Serves ``world_size`` capture ranks; collects events and hands tensors to ``sink``
    (anything with ``record_tensors(rank, keys, tensors)``; default a :class:`~prism_launch.capture.sink.MemorySink`).

    It computes collectives and answers ranks itself; its collaborators, each given what it uses:
    the :class:`~prism_launch.capture.events.EventLog` (groups, ranks, rows), the trace's
    :class:`~prism_launch.capture.notes.TraceNotes`, the :class:`~prism_launch.capture.staged.StagedResults`,
    :class:`~prism_launch.capture.p2p.PointToPoint` matching and the
    :class:`~prism_launch.capture.synthesized.SynthesizedOps` of ranks that complete their own ops."""

    def __init__(self, address: str, authkey: bytes, world_size: int, timeout_s: float, *,
                 slots: int | None = None, parker=None, stall_s: float = 30.0, fold=None,
                 payload: str = "full", budget_bytes: int | None = None, admission=None, sink=None,
                 scope: tuple[int, ...] | None = None, exchange: str | None = None, handshake_s: float = HANDSHAKE_S):
        self.world_size = world_size
        self.sink = sink if sink is not None else MemorySink()
        self.payload = payload
        """``full``/``exact``: every contribution arrives here; ``none``: ranks synthesize results
        and send metadata (``meta``/``psend``/``precv``), and carried broadcasts."""
        self.scope = None if scope is None else frozenset(scope)
        """``exact``: the sandbox ranks the trace is for. Stored are only the tensors they consume:
        virtual members' contributions to their non-folded groups, sends to them, folded results of
        theirs; of their own contributions and sends the digest and :func:`piece_stats`. None: every
        tensor (``full``)."""
        self.budget_bytes = budget_bytes
        self._views = PeerViews(exchange) if exchange is not None else None
        """The shared-memory exchange (:mod:`nccl_ext.exchange.arena`): what a trace records is read where
        the member staged it."""
        """Tensor bytes this capture may hold (None: no limit); past it, :class:`PayloadBudgetError`."""
        self._reads: dict[tuple[int, int], Reads] = {}
        self.bytes_recorded = 0
        self.fold = fold
        """A :class:`prism_launch.capture.fold.FoldPlan` when only representative ranks run."""
        self.timeout_s = timeout_s
        self.scheduler = SlotScheduler(slots, parker=parker, stall_s=stall_s, admission=admission,
                                       expected=len(fold.captured) if fold is not None else world_size)
        self._listener = RankListener(address, authkey, self._arrived, handshake_s=handshake_s)
        self.address = address
        self._new_conns: list[tuple[Connection, Hello]] = []
        self._conn_lock = threading.Lock()
        self._conns: list[Connection] = []
        self.log = EventLog(world_size)
        self._rank_of = self.log.rank_of
        self._groups = self.log.groups
        self._collectives: dict[tuple[str, int], PendingCollective] = {}
        self.finished: set[int] = set()
        self.approximated_groups: list[dict] = []
        """Folded capture: model-parallel groups (by description) created after group discovery
        with uncaptured members — their results are approximations, not exact."""
        self.memory: dict[int, dict] = {}
        """Each rank's memory accounting summary (peak bytes, per-unit samples, method)."""
        self.busy_s = {"receive": 0.0, "digest": 0.0, "copy": 0.0, "compute": 0.0, "reply": 0.0, "record": 0.0,
                       "pump": 0.0}
        """Seconds by activity: the coordinator's thread (what a capture waits on when every op
        passes through it), and its worker threads' ``digest`` and ``copy``."""
        self.notes = TraceNotes(self.scope, self.sink, self.busy_s, self._count)
        self.staged = StagedResults(exchange, self._views, self.notes)
        self.p2p = PointToPoint(self.log, self.scope, fold, self.notes, self.staged, self._reads, self.scheduler,
                                self.busy_s)
        self.synthesized = SynthesizedOps(self.log, self._collectives, self._views, self.notes, self.staged,
                                          self.sink, self.busy_s, self._count, self.scheduler, fold)
        self.ep_fold = EpFold(fold)
        """EP-folded capture: uncaptured EP ranks' counts and pieces (:mod:`prism_launch.capture.ep_fold`)."""
        self.rank_busy_s: dict[int, dict] = {}
        self.gpu_waits_stalled: list[tuple[int, str]] = []
        """(rank, what) for each rank whose waits on the GPU stopped."""
        self.lags = Lags()
        self._pump_end = None
        """Each rank's own seconds by activity (``CaptureTransport.busy_s``, sent at its close)."""
        self._handlers = {
            Hello: self._on_hello, Park: self._on_park, Group: self._on_group, Coll: self._on_coll,
            SColl: self._on_scoll, XColl: self._on_xcoll, Meta: self._on_meta, LColl: self._on_lcoll,
            Ints: self._on_ints, Outs: self._on_outs,
            PSend: self._on_p2p_meta, PRecv: self._on_p2p_meta, Send: self._on_send, XSend: self._on_xsend,
            Recv: self._on_recv, XRead: self._on_xread, Marker: self._on_marker,
            Wait: self._on_wait, Memory: self._on_memory, Stats: self._on_stats, Stalled: self._on_stalled,
            Bye: self._on_bye,
        }
        """Each message a rank sends (:data:`nccl_ext.core.protocol.RANK_MESSAGES`) -> its handler
        ``(connection, message, tensors)``."""

    def start(self) -> None:
        """Start accepting ranks (call after the ranks are forked: no thread before fork)."""
        self._listener.start()

    def _arrived(self, conn: Connection, hello: Hello) -> None:
        """A rank passed the handshake (the listener's thread): the pump takes it in."""
        with self._conn_lock:
            self._new_conns.append((conn, hello))

    @property
    def events(self) -> list[dict]:
        return self.log.events

    @property
    def ops_completed(self) -> int:
        return self.log.ops_completed

    @property
    def t0(self) -> float:
        return self.log.t0

    def drain(self, wait: bool = False) -> None:
        """The trace's notes left for after the replies (:meth:`TraceNotes.drain`)."""
        self.notes.drain(wait)

    def close(self) -> None:
        self.notes.close()
        self.scheduler.close()
        self._listener.close()
        with self._conn_lock:
            arrived, self._new_conns = self._new_conns, []
        for c in self._conns + [c for c, _ in arrived]:
            c.close()
        if self._views is not None:
            self._views.close()
        self.staged.close()

    # -- the pump ---------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.05) -> None:
        with self._conn_lock:
            arrived, self._new_conns = self._new_conns, []
        for conn, hello in arrived:
            self._conns.append(conn)
            self._handle(conn, hello, [])
        if self._pump_end is not None:  # messages wait unread meanwhile (the agent's own work)
            self.lags.note("between_pumps", time.perf_counter() - self._pump_end)
        ready = wait(self._conns, timeout=timeout_s) if self._conns else time.sleep(timeout_s)
        t_pump = time.perf_counter()
        for conn in ready or ():
            try:
                while conn.poll(0):
                    t = time.perf_counter()
                    header, tensors = wire.recv(conn, self.timeout_s,
                                                f"a message from rank {self._rank_of.get(conn, '(connecting)')}")
                    message = protocol.decode(header)
                    t1 = time.perf_counter()
                    self.busy_s["receive"] += t1 - t
                    self._handle(conn, message, tensors)
                    self.lags.note(f"handle_{message.TAG}", time.perf_counter() - t1, op_label(message))
            except (EOFError, OSError):
                self._conns.remove(conn)
                rank = self._rank_of.get(conn)
                if rank is not None:
                    self.scheduler.gone(rank)
        self.scheduler.schedule()
        t = time.perf_counter()
        self.drain()
        self.lags.note("drain", time.perf_counter() - t)
        self._check_deadlines()
        self._pump_end = time.perf_counter()
        self.busy_s["pump"] += self._pump_end - t_pump
        self.lags.note("pump", self._pump_end - t_pump)

    def _handle(self, conn: Connection, message: tuple, tensors: list[torch.Tensor]) -> None:
        self._handlers[type(message)](conn, message, tensors)

    def _on_hello(self, conn: Connection, m: Hello, tensors) -> None:
        self._rank_of[conn] = m.rank
        self.scheduler.arrive(m.rank, m.pid, conn)

    def _on_park(self, conn: Connection, m: Park, tensors) -> None:
        self.scheduler.park(self._rank_of[conn], m.op_id)

    def _on_group(self, conn: Connection, m: Group, tensors) -> None:
        key, ranks, occurrence, desc = m
        if key not in self._groups:
            ranks = tuple(ranks)
            g = OpGroup(len(self._groups), key, ranks, occurrence, desc, present=len(ranks),
                       consumed=self.scope is None or not self.scope.isdisjoint(ranks))
            if self.fold is not None and self.fold.folded:
                sources = self.fold.sources(ranks)
                if sources is not None and sources != ranks:
                    g.sources = sources
                    g.present = sum(1 for r in ranks if self.fold.is_captured(r))
                    from prism_launch.capture.fold import is_replicated

                    if not is_replicated(desc, ranks, self.world_size, self.fold.replicated):
                        self.approximated_groups.append({"desc": desc, "size": len(ranks), "ranks": list(ranks[:16])})
            self._groups[key] = g
            rank = self._rank_of[conn]
            if self._mirrored(g) == rank:
                # a sandbox rank's data of the group is kept: it comes through the exchange
                if rank not in self.scope or self._views is not None:
                    wire.send(conn, protocol.encode(Mirror(key, rank in self.scope)))

    def _on_xcoll(self, conn: Connection, m: XColl, tensors) -> None:
        loc = m.location
        rank = self._rank_of[conn]
        location, g = None if loc is None else (rank, *loc), self.log.group(m.key)
        # of a folded group's op (summed by its members) the trace reads only a sandbox rank's data
        reads = g.consumed and (g.sources is None or self.scope is None or rank in self.scope)
        tensors = [] if location is None else self.staged.located(location, reads, f"{m.api} (seq {m.seq}) on "
                                                            f"group {m.key}", lazy=True)
        self._on_collective(conn, m, tensors, location)

    def _on_scoll(self, conn: Connection, m: SColl, tensors) -> None:
        """Computed here from the contribution where the rank staged it."""
        rank = self._rank_of[conn]
        self._on_collective(conn, m, self._views.views((rank, *m.location)), staged=True)

    def _on_xread(self, conn: Connection, m: XRead, tensors) -> None:
        self._on_read(conn, m.op_id, m.kept)

    def _on_coll(self, conn: Connection, m: Coll, tensors) -> None:
        if self.payload == "none" and m.kind == str(Collective.BROADCAST):
            self.synthesized.on_carried_broadcast(conn, m, tensors)
        else:
            self._on_collective(conn, m, tensors)

    def _on_meta(self, conn: Connection, m: Meta, tensors) -> None:
        self.synthesized.on_meta(conn, m)

    def _on_ints(self, conn: Connection, m: Ints, tensors) -> None:
        self.log.note_ints(self._rank_of[conn], m.key, m.seq, m.values)

    def _on_outs(self, conn: Connection, m: Outs, tensors) -> None:
        self.ep_fold.note_outs(self._rank_of[conn], m.key, m.seq, m.shapes)

    def _on_lcoll(self, conn: Connection, m: LColl, tensors) -> None:
        self.synthesized.on_meta(conn, m, mirrored=True)

    def _on_p2p_meta(self, conn: Connection, m: PSend | PRecv, tensors) -> None:
        self.synthesized.on_p2p_meta(conn, m)

    def _on_send(self, conn: Connection, m: Send, tensors) -> None:
        self.p2p.on_send(conn, m, tensors[0])

    def _on_xsend(self, conn: Connection, m: XSend, tensors) -> None:
        self.p2p.on_xsend(conn, m)

    def _on_recv(self, conn: Connection, m: Recv, tensors) -> None:
        self.p2p.on_recv(conn, m)

    def _on_marker(self, conn: Connection, m: Marker, tensors) -> None:
        rank = self._rank_of[conn]
        self.log.row(rank, m.unit, "marker", m.name, None, -1, -1, None, m.t, m.t, m.wall, m.cpu, None, None)

    def _on_wait(self, conn: Connection, m: Wait, tensors) -> None:
        ref, unit, t, wall, cpu, t0, t1 = m
        rank = self._rank_of[conn]
        group = self.log.group(ref[1])
        seq, peer, extra = ref[-1], -1, {"ref": ref[0], "blocked_s": None if t0 is None else t1 - t0}
        if ref[0] in ("s", "r"):
            peer, extra["tag"] = ref[2], ref[3]
        self.log.row(rank, unit, "wait", "wait", group, seq, peer, None, t, t if t1 is None else t1, wall, cpu,
                  None, extra)

    def _on_memory(self, conn: Connection, m: Memory, tensors) -> None:
        self.memory[m.rank] = m.summary
        if self.scheduler.admission is not None:
            self.scheduler.admission.report(m.rank, m.summary)

    def _on_stats(self, conn: Connection, m: Stats, tensors) -> None:
        self.rank_busy_s[m.rank] = m.stats

    def _on_stalled(self, conn: Connection, m: Stalled, tensors) -> None:
        """A rank's waits on the GPU stopped (nccl_ext.capture.deferred_waits)."""
        self.gpu_waits_stalled.append((m.rank, m.what))

    def _on_bye(self, conn: Connection, m: Bye, tensors) -> None:
        self.finished.add(m.rank)
        self.scheduler.gone(m.rank)

    def _mirrored(self, g: OpGroup) -> int | None:
        """The rank that computes ``g``'s collectives itself (:mod:`nccl_ext.core.mirrored`): in a
        sandbox-scoped trace, a folded group's only captured member when it stands in for every
        other member (the trace keeps nothing of a virtual rank's ops on the group; of a sandbox
        rank's, its contribution's digest and its result, read where the rank staged them), else None."""
        if self.scope is None or self.payload == "none" or g.sources is None or len(g.ranks) < 2:
            return None
        first = g.sources[0]
        if any(s != first for s in g.sources):
            return None
        return first

    # -- collectives --------------------------------------------------------------------
    def _on_collective(self, conn, m: Coll | SColl | XColl, tensors, location: tuple | None = None,
                       staged: bool = False) -> None:
        op_id, key, seq, api, kind, reduce, root, contributes, unit, t, wall, cpu = m[:12]
        exchanged = isinstance(m, XColl)
        self.lags.note("arrival", time.monotonic() - t)
        rank = self._rank_of[conn]
        group = self.log.group(key)
        kind = Collective(kind)
        reduce = None if reduce is None else ReduceKind(reduce)
        pc = self._collectives.get((key, seq))
        if pc is None:
            pc = PendingCollective(group, seq, api, kind, reduce, root, time.monotonic(), [None] * len(group.ranks))
            self._collectives[(key, seq)] = pc
            if exchanged:
                pc.locations = {}
        elif (pc.kind, pc.reduce, pc.root) != (kind, reduce, root):
            first = next(iter(pc.arrivals.values()))
            raise CaptureError(
                f"collective mismatch on group {describe(group.ranks)} ({group.desc or key}) seq {seq}: "
                f"rank {first.rank} called {pc.api}(reduce={pc.reduce}, root={pc.root}) but rank {rank} "
                f"called {api}(reduce={reduce}, root={root})"
            )
        grank = group.ranks.index(rank)
        if (pc.locations is not None) != exchanged:
            raise CaptureError(f"{api} (seq {seq}) on group {describe(group.ranks)}: members disagree on "
                               "whether it goes through the shared-memory exchange")
        if location is not None:
            pc.locations[grank] = location
        if contributes == "standin":
            pc.standins[grank] = list(tensors)
            contributes = False
        contribution = list(tensors) if contributes else None
        pc.contributions[grank] = contribution
        tkey = f"c/{group.id}/{seq}"
        extra = {"kind": str(kind), "reduce": None if reduce is None else str(reduce), "root": root,
                 "n": len(contribution) if contribution is not None else 0,
                 "shapes": [list(t.shape) for t in contribution or ()],
                 "dtypes": [wire.dtype_name(t.dtype) for t in contribution or ()],
                 "digests": []}
        self.log.take_ints(rank, key, seq, extra)
        keep = contribution is not None and self._keeps(group, rank, grank, kind, root)
        row = self.log.row(rank, unit, "collective", api, group, seq, -1, contribution, t, t, wall, cpu,
                        f"{tkey}/0" if keep and contribution else None, None)
        # what the trace keeps of the contribution: a staged one is read after the members have
        # their results (they compute them themselves), so no member waits for its digest or copy
        note = (self.notes.note_contribution, (rank, row, extra, contribution, keep, tkey, location is not None or staged))
        if is_device_location(location):
            pc.held.append(note)
        elif location is not None or staged:
            self.notes.defer(*note)
        else:
            note[0](*note[1])
        self.scheduler.issued(rank, op_id)
        pc.arrivals[grank] = Arrival(rank, op_id, conn, row, staged)
        if len(pc.arrivals) == group.present:
            self._complete(pc)

    def _digests(self, rank: int, tensors) -> list[str]:
        """Digests of ``rank``'s contribution or send, on this thread (see :meth:`_summarize`)."""
        if self.scope is not None and rank not in self.scope:
            return []
        t0 = time.perf_counter()
        out = [wire.digest(t) for t in tensors]
        self.busy_s["digest"] += time.perf_counter() - t0
        return out

    def _keeps(self, group: OpGroup, rank: int, grank: int, kind: Collective, root: int | None) -> bool:
        """Whether a member's contribution is stored: always when the trace is ``full``; in a
        sandbox-scoped one only a virtual member's contribution that a sandbox rank folds (on a
        group that is not folded: those replay from the recorded result)."""
        if self.scope is None:
            return True
        if group.sources is not None or not group.consumed or rank in self.scope:
            return False
        return grank in contributors(kind, len(group.ranks), root)

    def _complete(self, pc: PendingCollective) -> None:
        del self._collectives[(pc.group.key, pc.seq)]
        self.lags.note("spread", time.monotonic() - pc.first_t)
        if pc.locations is not None:
            self._complete_exchanged(pc)
            return
        group = pc.group
        if group.sources is not None:  # folded: uncaptured members contribute their stand-ins' data
            index = {r: i for i, r in enumerate(group.ranks)}
            contributions = [c if c is not None else pc.contributions[index[group.sources[i]]]
                             for i, c in enumerate(pc.contributions)]
            if pc.root is not None and contributions[pc.root] is None:
                # an uncaptured root: its stand-in's own buffer is what that rank would hold
                contributions[pc.root] = pc.standins.get(index[group.sources[pc.root]])
                if contributions[pc.root] is None:
                    raise CaptureError(
                        f"folded capture: {pc.api} (seq {pc.seq}) on group {describe(group.ranks)} "
                        f"({group.desc or group.key}) has root rank {group.ranks[pc.root]}, which is not captured, "
                        "and no stand-in data for it; capture with that rank among sandbox.ranks")
            if self.ep_fold.applies(group):
                contributions = self.ep_fold.contributions(pc, contributions)
        else:
            contributions = pc.contributions
        results = None
        t0 = time.perf_counter()
        if group.sources is not None and len(group.ranks) > EXACT_FOLD_MAX:
            results = weighted_reduction(pc, group)
        if results is None:
            results = compute(pc.kind, contributions, reduce=pc.reduce, root=pc.root)
        self.busy_s["compute"] += time.perf_counter() - t0
        now = time.monotonic() - self.t0
        staged = [(a.conn, a.op_id) for a in pc.arrivals.values() if a.staged]
        shared: dict = {}
        for grank, arrival in pc.arrivals.items():
            if (group.sources is not None or self.payload == "none") and results[grank] is not None and \
                    (self.scope is None or arrival.rank in self.scope):
                # replay cannot recompute a folded result without O(replicas) work, nor a `none`
                # trace's carried token counts (routing_counts.carried_counts) at all: keep it
                t0 = time.perf_counter()
                pieces = recordable(pc.kind, results[grank], bool(staged))
                self.sink.record_tensors(arrival.rank, [f"r/{group.id}/{pc.seq}/{i}" for i in range(len(pieces))],
                                         pieces)
                self.busy_s["record"] += time.perf_counter() - t0
                self._count(sum(t.numel() * t.element_size() for t in results[grank]))
            arrival.row["t_end"] = now
            t0 = time.perf_counter()
            if arrival.staged and results[grank]:
                self.staged.reply(arrival, results[grank], shared)
            else:
                wire.send(arrival.conn, protocol.encode(Ok(arrival.op_id)), results[grank])
            self.busy_s["reply"] += time.perf_counter() - t0
            self.scheduler.answered(arrival.rank, arrival.op_id)
        if staged:
            pc.contributions = []
            self.staged.free_contributions(staged)
        self.log.ops_completed += 1

    def _complete_exchanged(self, pc: PendingCollective) -> None:
        """Every member staged its contribution: each computes its own result from the locations
        (of a folded group: from its captured members', summed as ``parts`` says)."""
        locations = [pc.locations.get(g) for g in range(len(pc.group.ranks))]
        parts = exchanged_terms(pc, pc.group)
        pc.contributions = []  # the coordinator's views of the regions: the members free them
        reads = Reads(len(pc.arrivals), [(a.conn, a.op_id) for g, a in pc.arrivals.items() if g in pc.locations],
                      pc.held, None if parts is None else f"r/{pc.group.id}/{pc.seq}")
        now = time.monotonic() - self.t0
        t0 = time.perf_counter()
        for arrival in pc.arrivals.values():
            self._reads[(arrival.rank, arrival.op_id)] = reads
            arrival.row["t_end"] = now
            wire.send(arrival.conn, protocol.encode(XOk(arrival.op_id, locations, time.monotonic(), parts)))
            self.scheduler.answered(arrival.rank, arrival.op_id)
        self.busy_s["reply"] += time.perf_counter() - t0
        self.log.ops_completed += 1

    def _on_read(self, conn, op_id: int, kept: tuple | None = None) -> None:
        """A member has its result (``kept``: where it staged the result the trace keeps of a
        folded op, freed with its contribution): once every member has, each frees its region
        (once the trace's notes of the regions are taken); or a member has copied a result the
        coordinator staged."""
        rank = self._rank_of[conn]
        if self.staged.read_result(rank, op_id):
            return
        reads = self._reads.pop((rank, op_id), None)
        if reads is None:
            return
        if kept is not None and reads.result_key is not None:
            self.notes.record(rank, [f"{reads.result_key}/{i}" for i in range(len(kept[1]))], refs(self._views, rank, *kept),
                         staged=True)
        reads.left -= 1
        if reads.left == 0:
            for fn, args in reads.notes:  # data staged on a GPU: its host copies are complete now
                fn(*args)
            self.staged.free_contributions(reads.owners)

    def _count(self, nbytes: int) -> None:
        self.bytes_recorded += nbytes
        if self.budget_bytes is not None and self.bytes_recorded > self.budget_bytes:
            raise PayloadBudgetError(
                f"the trace's tensors passed {self.budget_bytes / 2**30:.2f} GiB "
                f"({self.bytes_recorded / 2**30:.2f} GiB after {self.ops_completed} ops)")

    # -- deadlines ------------------------------------------------------------------------
    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for pc in self._collectives.values():
            if -1 in pc.standins and not pc.arrivals:
                continue  # a carried broadcast's payload is here: members still to come wait for nobody
            if now - pc.first_t > self.timeout_s:
                arrived = sorted(a.rank for a in pc.arrivals.values())
                missing = [r for r in pc.group.ranks if r not in arrived
                           and (self.fold is None or self.fold.is_captured(r))]
                raise CaptureDeadlineError(
                    f"{pc.api} (seq {pc.seq}) on group {describe(pc.group.ranks)} "
                    f"({pc.group.desc or pc.group.key}): ranks {describe(tuple(arrived))} waited "
                    f"{now - pc.first_t:.1f}s for ranks {describe(tuple(missing))}, which never arrived "
                    f"(deadline {self.timeout_s:g}s; raise it with comm.timeout_s=)"
                )
        self.p2p.check_deadlines(now, self.timeout_s)

    # -- results --------------------------------------------------------------------------
    def groups(self) -> list[dict]:
        return [
            {"id": g.id, "key": g.key, "ranks": list(g.ranks), "occurrence": g.occurrence, "desc": g.desc}
            for g in sorted(self._groups.values(), key=lambda g: g.id)
        ]

    def unfinished(self) -> str | None:
        """Describe ops still waiting (a clean exit should leave none)."""
        if self._collectives:
            pc = next(iter(self._collectives.values()))
            return f"{len(self._collectives)} collective(s) never completed, e.g. {pc.api} seq {pc.seq} on {describe(pc.group.ranks)}"
        if self.p2p.waiting():
            return "a recv never completed"
        return None
