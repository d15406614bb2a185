"""The capture coordinator: computes every collective of the logical world from all
members' real contributions and records what replay needs.

It runs in the launcher process, pumped between polls of the rank processes. Ranks
connect over a Unix socket (:mod:`nccl_ext.capture_transport`); results are computed
with :func:`nccl_ext.ops.compute` — the same function emulation uses — so replayed
results are bit-identical to captured ones. Every tensor it records goes to its ``sink``
at once (the trace writer's :meth:`~prism_launch.trace.TraceWriter.record_tensor`, which
spills them to disk as they come), so the launcher holds no step's tensors past the op.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait

import torch

from nccl_ext import wire
from nccl_ext.divergence import piece_stats
from nccl_ext.ops import Collective, ReduceKind, compute, contributors, fold
from prism_launch.capture.folded_reduction import EXACT_FOLD_MAX, weighted_reduction
from prism_launch.capture.slots import SlotScheduler


class CaptureError(RuntimeError):
    """The captured program did something the coordinator cannot complete."""


class CaptureDeadlineError(CaptureError):
    """A rank waited on a peer that never arrived."""


class PayloadBudgetError(CaptureError):
    """An exact capture's tensors passed the payload budget (``payload=auto`` records again
    with ``none``)."""


@dataclass(slots=True)
class _Group:
    id: int
    key: str
    ranks: tuple[int, ...]
    occurrence: int
    desc: str
    sources: tuple[int, ...] | None = None
    """Folded capture: the captured stand-in of every member (None: all members captured)."""
    present: int = 0
    """Members that run in this capture."""
    consumed: bool = True
    """A sandbox-scoped capture: a sandbox rank is a member (else nothing of the group is stored)."""


@dataclass(slots=True)
class _Arrival:
    rank: int
    op_id: int
    conn: Connection
    row: dict


@dataclass(slots=True)
class _PendingCollective:
    group: _Group
    seq: int
    api: str
    kind: Collective
    reduce: ReduceKind | None
    root: int | None
    first_t: float
    contributions: list[list[torch.Tensor] | None]
    arrivals: dict[int, _Arrival] = field(default_factory=dict)
    standins: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Folded capture: members' own buffers offered for an uncaptured broadcast root."""


def _describe(ranks: tuple[int, ...]) -> str:
    return str(list(ranks)) if len(ranks) <= 16 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


class MemorySink:
    """Keeps recorded tensors in memory (``tensors[rank][key]``): for tests and tools that want
    them at hand; a capture gives the coordinator the trace writer instead."""

    def __init__(self) -> None:
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}

    def record_tensor(self, rank: int, key: str, tensor: torch.Tensor) -> None:
        self.tensors.setdefault(rank, {})[key] = tensor


class Coordinator:
    """Serves ``world_size`` capture ranks; collects events and hands tensors to ``sink``
    (anything with ``record_tensor(rank, key, tensor)``; default a :class:`MemorySink`)."""

    def __init__(self, address: str, authkey: bytes, world_size: int, timeout_s: float, *,
                 slots: int | None = None, parker=None, stall_s: float = 30.0, fold=None,
                 payload: str = "full", budget_bytes: int | None = None, admission=None, sink=None,
                 scope: tuple[int, ...] | None = None):
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
        """Tensor bytes this capture may hold (None: no limit); past it, :class:`PayloadBudgetError`."""
        self.bytes_recorded = 0
        self.fold = fold
        """A :class:`prism_launch.capture.fold.FoldPlan` when only representative ranks run."""
        self.timeout_s = timeout_s
        self.scheduler = SlotScheduler(slots, parker=parker, stall_s=stall_s, admission=admission,
                                       expected=len(fold.captured) if fold is not None else world_size)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.address = address
        self._new_conns: list[Connection] = []
        self._conn_lock = threading.Lock()
        self._conns: list[Connection] = []
        self._rank_of: dict[Connection, int] = {}
        self._groups: dict[str, _Group] = {}
        self._collectives: dict[tuple[str, int], _PendingCollective] = {}
        self._sends: dict[tuple[str, int, int, int], deque] = {}
        self._recvs: dict[tuple[str, int, int, int], deque] = {}
        self._next_idx = [0] * world_size
        self.events: list[dict] = []
        self.finished: set[int] = set()
        self.approximated_groups: list[dict] = []
        """Folded capture: model-parallel groups (by description) created after group discovery
        with uncaptured members — their results are approximations, not exact."""
        self.memory: dict[int, dict] = {}
        """Each rank's memory accounting summary (peak bytes, per-unit samples, method)."""
        self.t0 = time.monotonic()
        self.ops_completed = 0
        self.busy_s = {"receive": 0.0, "digest": 0.0, "compute": 0.0, "reply": 0.0, "record": 0.0}
        """The coordinator's own seconds by activity (one thread: what a capture waits on when
        every op passes through it)."""
        self._accepting = True
        self._acceptor = threading.Thread(target=self._accept_loop, name="prism-coordinator-accept", daemon=True)

    def start(self) -> None:
        """Start accepting ranks (call after the ranks are forked: no thread before fork)."""
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while self._accepting:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                return
            except Exception:  # noqa: BLE001 - bad authkey or a stray client: ignore it
                continue
            with self._conn_lock:
                self._new_conns.append(conn)

    def close(self) -> None:
        self.scheduler.close()
        self._accepting = False
        sock = getattr(getattr(self._listener, "_listener", None), "_socket", None)
        if sock is not None:  # wake the acceptor blocked in accept(); close() alone does not
            import socket

            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._listener.close()
        except OSError:
            pass
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=2.0)
        for c in self._conns:
            c.close()

    # -- the pump ---------------------------------------------------------------------
    def pump(self, timeout_s: float = 0.05) -> None:
        with self._conn_lock:
            self._conns.extend(self._new_conns)
            self._new_conns.clear()
        ready = wait(self._conns, timeout=timeout_s) if self._conns else time.sleep(timeout_s)
        for conn in ready or ():
            try:
                while conn.poll(0):
                    t = time.perf_counter()
                    header, tensors = wire.recv(conn)
                    self.busy_s["receive"] += time.perf_counter() - t
                    self._handle(conn, header, tensors)
            except (EOFError, OSError):
                self._conns.remove(conn)
                rank = self._rank_of.get(conn)
                if rank is not None:
                    self.scheduler.gone(rank)
        self.scheduler.schedule()
        self._check_deadlines()

    def _handle(self, conn: Connection, header: tuple, tensors: list[torch.Tensor]) -> None:
        kind = header[0]
        if kind == "hello":
            _, rank, pid = header
            self._rank_of[conn] = rank
            self.scheduler.arrive(rank, pid, conn)
        elif kind == "park":
            self.scheduler.park(self._rank_of[conn], header[1])
        elif kind == "group":
            _, key, ranks, occurrence, desc = header
            if key not in self._groups:
                ranks = tuple(ranks)
                g = _Group(len(self._groups), key, ranks, occurrence, desc, present=len(ranks),
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
        elif kind == "coll":
            if self.payload == "none" and header[5] == str(Collective.BROADCAST):
                self._on_carried_broadcast(conn, header, tensors)
            else:
                self._on_collective(conn, header, tensors)
        elif kind == "meta":
            self._on_meta(conn, header)
        elif kind in ("psend", "precv"):
            self._on_p2p_meta(conn, header)
        elif kind == "send":
            self._on_send(conn, header, tensors[0])
        elif kind == "recv":
            self._on_recv(conn, header)
        elif kind == "marker":
            _, name, unit, t, wall, cpu = header
            rank = self._rank_of[conn]
            self._row(rank, unit, "marker", name, None, -1, -1, None, t, t, wall, cpu, None, None)
        elif kind == "wait":
            _, ref, unit, t, wall, cpu, t0, t1 = header
            rank = self._rank_of[conn]
            group = self._group(ref[1])
            seq, peer, extra = ref[-1], -1, {"ref": ref[0], "blocked_s": None if t0 is None else t1 - t0}
            if ref[0] in ("s", "r"):
                peer, extra["tag"] = ref[2], ref[3]
            self._row(rank, unit, "wait", "wait", group, seq, peer, None, t, t if t1 is None else t1, wall, cpu,
                      None, extra)
        elif kind == "memory":
            self.memory[header[1]] = header[2]
            if self.scheduler.admission is not None:
                self.scheduler.admission.report(header[1], header[2])
        elif kind == "bye":
            self.finished.add(header[1])
            self.scheduler.gone(header[1])

    def _row(self, rank, unit, kind, op, group, seq, peer, tensors, t_start, t_end, wall, cpu, key, extra) -> dict:
        idx = self._next_idx[rank]
        self._next_idx[rank] = idx + 1
        first = tensors[0] if tensors else None
        row = {
            "rank": rank, "idx": idx, "unit": unit, "kind": kind, "op": op,
            "group": -1 if group is None else group.id, "seq": seq, "peer": peer,
            "dtype": wire.dtype_name(first.dtype) if first is not None else "",
            "shape": list(first.shape) if first is not None else [],
            "nbytes": sum(t.numel() * t.element_size() for t in tensors or ()),
            "t_start": t_start - self.t0, "t_end": t_end - self.t0,
            "compute_wall_s": wall, "compute_cpu_s": cpu, "tensor_key": key,
            "extra": None if extra is None else json.dumps(extra),
        }
        self.events.append(row)
        return row

    def _group(self, key: str) -> _Group:
        try:
            return self._groups[key]
        except KeyError:
            raise CaptureError(f"op on unregistered group {key}") from None

    # -- collectives --------------------------------------------------------------------
    def _on_collective(self, conn, header, tensors) -> None:
        _, op_id, key, seq, api, kind, reduce, root, contributes, unit, t, wall, cpu = header
        rank = self._rank_of[conn]
        group = self._group(key)
        kind = Collective(kind)
        reduce = None if reduce is None else ReduceKind(reduce)
        pc = self._collectives.get((key, seq))
        if pc is None:
            pc = _PendingCollective(group, seq, api, kind, reduce, root, time.monotonic(), [None] * len(group.ranks))
            self._collectives[(key, seq)] = pc
        elif (pc.kind, pc.reduce, pc.root) != (kind, reduce, root):
            first = next(iter(pc.arrivals.values()))
            raise CaptureError(
                f"collective mismatch on group {_describe(group.ranks)} ({group.desc or key}) seq {seq}: "
                f"rank {first.rank} called {pc.api}(reduce={pc.reduce}, root={pc.root}) but rank {rank} "
                f"called {api}(reduce={reduce}, root={root})"
            )
        grank = group.ranks.index(rank)
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
                 "digests": self._digests(rank, contribution or ())}
        keep = contribution is not None and self._keeps(group, rank, grank, kind, root)
        if contribution is not None and not keep and rank in (self.scope or ()):
            extra["stats"] = [piece_stats(x) for x in contribution]  # what its divergence checks read
        row = self._row(rank, unit, "collective", api, group, seq, -1, contribution, t, t, wall, cpu,
                        f"{tkey}/0" if keep and contribution else None, extra)
        if keep:
            t0 = time.perf_counter()
            for i, tensor in enumerate(contribution):
                self.sink.record_tensor(rank, f"{tkey}/{i}", tensor)
            self.busy_s["record"] += time.perf_counter() - t0
            self._count(row["nbytes"])
        self.scheduler.issued(rank, op_id)
        pc.arrivals[grank] = _Arrival(rank, op_id, conn, row)
        if len(pc.arrivals) == group.present:
            self._complete(pc)

    def _digests(self, rank: int, tensors) -> list[str]:
        """Digests of ``rank``'s contribution or send: the divergence checks of a sandbox rank read
        them, and in a sandbox-scoped trace only sandbox ranks replay (a digest of every other
        rank's data would cost a pass over every byte the capture moves)."""
        if self.scope is not None and rank not in self.scope:
            return []
        t0 = time.perf_counter()
        out = [wire.digest(t) for t in tensors]
        self.busy_s["digest"] += time.perf_counter() - t0
        return out

    def _keeps(self, group: _Group, rank: int, grank: int, kind: Collective, root: int | None) -> bool:
        """Whether a member's contribution is stored: always when the trace is ``full``; in a
        sandbox-scoped one only a virtual member's contribution that a sandbox rank folds (on a
        group that is not folded: those replay from the recorded result)."""
        if self.scope is None:
            return True
        if group.sources is not None or not group.consumed or rank in self.scope:
            return False
        return grank in contributors(kind, len(group.ranks), root)

    def _complete(self, pc: _PendingCollective) -> None:
        del self._collectives[(pc.group.key, pc.seq)]
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
                        f"folded capture: {pc.api} (seq {pc.seq}) on group {_describe(group.ranks)} "
                        f"({group.desc or group.key}) has root rank {group.ranks[pc.root]}, which is not captured, "
                        "and no stand-in data for it; capture with that rank among sandbox.ranks")
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
        for grank, arrival in pc.arrivals.items():
            if group.sources is not None and results[grank] is not None and \
                    (self.scope is None or arrival.rank in self.scope):
                # replay cannot recompute a folded result without O(replicas) work: keep it
                t0 = time.perf_counter()
                for i, t in enumerate(results[grank]):
                    self.sink.record_tensor(arrival.rank, f"r/{group.id}/{pc.seq}/{i}", t)
                self.busy_s["record"] += time.perf_counter() - t0
                self._count(sum(t.numel() * t.element_size() for t in results[grank]))
            arrival.row["t_end"] = now
            t0 = time.perf_counter()
            wire.send(arrival.conn, ("ok", arrival.op_id), results[grank])
            self.busy_s["reply"] += time.perf_counter() - t0
            self.scheduler.answered(arrival.rank, arrival.op_id)
        self.ops_completed += 1

    def _count(self, nbytes: int) -> None:
        self.bytes_recorded += nbytes
        if self.budget_bytes is not None and self.bytes_recorded > self.budget_bytes:
            raise PayloadBudgetError(
                f"the trace's tensors passed {self.budget_bytes / 2**30:.2f} GiB "
                f"({self.bytes_recorded / 2**30:.2f} GiB after {self.ops_completed} ops)")

    # -- payload none: metadata, and the broadcasts that keep their payload ----------------
    def _on_meta(self, conn, header) -> None:
        """A collective the rank synthesized: its event, no tensors, nothing to wait for."""
        _, key, seq, api, kind, reduce, root, unit, t, wall, cpu, shapes, dtypes, nbytes = header
        rank = self._rank_of[conn]
        group = self._group(key)
        extra = {"kind": kind, "reduce": reduce, "root": root, "n": len(shapes), "shapes": shapes,
                 "dtypes": dtypes, "digests": [], "synthesized": True}
        row = self._row(rank, unit, "collective", api, group, seq, -1, None, t, t, wall, cpu, None, extra)
        row["dtype"], row["shape"], row["nbytes"] = (dtypes[0] if dtypes else ""), (shapes[0] if shapes else []), nbytes
        self.ops_completed += 1

    def _on_p2p_meta(self, conn, header) -> None:
        kind, key, peer, tag, seq, unit, t, wall, cpu, shape, dtype, nbytes = header
        rank = self._rank_of[conn]
        group = self._group(key)
        op = "send" if kind == "psend" else "recv"
        extra = {"tag": tag, "kind": op, "n": 1, "shapes": [shape], "dtypes": [dtype], "digests": [],
                 "synthesized": True}
        row = self._row(rank, unit, "p2p", op, group, seq, peer, None, t, t, wall, cpu, None, extra)
        row["dtype"], row["shape"], row["nbytes"] = dtype, shape, nbytes
        self.ops_completed += 1

    def _on_carried_broadcast(self, conn, header, tensors) -> None:
        """``payload=none``: a broadcast small enough to keep its payload. The root (or, when the
        root is not captured, its stand-in) is answered at once; every other member when the
        payload is here — so ranks that run one after another in rank order never wait for a
        peer that has not started. Each receiver's result is stored for its emulation."""
        _, op_id, key, seq, api, kind, reduce, root, contributes, unit, t, wall, cpu = header
        rank = self._rank_of[conn]
        group = self._group(key)
        grank = group.ranks.index(rank)
        pc = self._collectives.get((key, seq))
        if pc is None:
            pc = _PendingCollective(group, seq, api, Collective.BROADCAST, None, root, time.monotonic(),
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
        row = self._row(rank, unit, "collective", api, group, seq, -1, contribution, t, t, wall, cpu, None, extra)
        self.scheduler.issued(rank, op_id)
        pc.arrivals[grank] = _Arrival(rank, op_id, conn, row)
        payload = pc.standins.get(-1)
        if payload is None:  # the members here wait for the root (or its stand-in): it should run next
            self.scheduler.awaits(group.ranks[source] if group.sources is None else group.sources[root])
            return
        now = time.monotonic() - self.t0
        for g, arrival in list(pc.arrivals.items()):
            result = [] if g == root else payload
            if g != root:
                for i, x in enumerate(result):
                    self.sink.record_tensor(arrival.rank, f"r/{group.id}/{seq}/{i}", x)
            arrival.row["t_end"] = now
            wire.send(arrival.conn, ("ok", arrival.op_id), result)
            self.scheduler.answered(arrival.rank, arrival.op_id)
            del pc.arrivals[g]
            pc.contributions[g] = []  # answered
        if all(c is not None for i, c in enumerate(pc.contributions) if self.fold is None or
               self.fold.is_captured(group.ranks[i])):
            del self._collectives[(key, seq)]
            self.ops_completed += 1

    # -- point to point -----------------------------------------------------------------
    def _on_send(self, conn, header, tensor) -> None:
        _, _op_id, key, dst, tag, seq, unit, t, wall, cpu = header
        src = self._rank_of[conn]
        group = self._group(key)
        self._check_p2p_peer(src, dst, group, "send to")
        tkey = f"p/{group.id}/{src}/{dst}/{tag}/{seq}"
        extra = {"tag": tag, "kind": "send", "n": 1, "shapes": [list(tensor.shape)],
                 "dtypes": [wire.dtype_name(tensor.dtype)], "digests": self._digests(src, (tensor,))}
        # a sandbox-scoped trace stores what a sandbox rank receives from a virtual one
        if self.scope is None or (dst in self.scope and src not in self.scope):
            t0 = time.perf_counter()
            self.sink.record_tensor(src, tkey, tensor)
            self.busy_s["record"] += time.perf_counter() - t0
            self._count(tensor.numel() * tensor.element_size())
        else:
            tkey = None
            if src in self.scope:
                extra["stats"] = [piece_stats(tensor)]
        self._row(src, unit, "p2p", "send", group, seq, dst, [tensor], t, t, wall, cpu, tkey, extra)
        chan = (key, src, dst, tag)
        waiting = self._recvs.get(chan)
        if waiting:
            self._deliver(waiting.popleft(), seq, tensor, src)
        else:
            self._sends.setdefault(chan, deque()).append((seq, tensor))

    def _on_recv(self, conn, header) -> None:
        _, op_id, key, src, tag, seq, unit, t, wall, cpu = header
        dst = self._rank_of[conn]
        group = self._group(key)
        self._check_p2p_peer(dst, src, group, "receive from")
        row = self._row(dst, unit, "p2p", "recv", group, seq, src, None, t, t, wall, cpu, None,
                        {"tag": tag, "kind": "recv"})
        self.scheduler.issued(dst, op_id)
        waiter = (op_id, conn, row, seq, dst, time.monotonic())
        chan = (key, src, dst, tag)
        queued = self._sends.get(chan)
        if queued:
            send_seq, tensor = queued.popleft()
            self._deliver(waiter, send_seq, tensor, src)
        else:
            self._recvs.setdefault(chan, deque()).append(waiter)

    def _check_p2p_peer(self, rank: int, peer: int, group: _Group, verb: str) -> None:
        if self.fold is not None and not self.fold.is_captured(peer):
            raise CaptureError(
                f"folded capture: rank {rank} wants to {verb} rank {peer} on group {_describe(group.ranks)} "
                f"({group.desc or group.key}), but rank {peer} is not in the captured set "
                f"{_describe(tuple(self.fold.captured))}: point-to-point traffic crosses data-parallel replicas. "
                "Capture without folding (capture.fold=false) or name the group's pattern differently in "
                "capture.replicated_groups"
            )

    def _deliver(self, waiter, send_seq: int, tensor: torch.Tensor, src: int) -> None:
        op_id, conn, row, seq, dst, _ = waiter
        if seq != send_seq:
            raise CaptureError(f"p2p order mismatch: rank {dst} recv #{seq} from rank {src} matched send #{send_seq}")
        row["t_end"] = time.monotonic() - self.t0
        row["dtype"], row["shape"] = wire.dtype_name(tensor.dtype), list(tensor.shape)
        row["nbytes"] = tensor.numel() * tensor.element_size()
        t0 = time.perf_counter()
        wire.send(conn, ("ok", op_id), [tensor])
        self.busy_s["reply"] += time.perf_counter() - t0
        self.scheduler.answered(dst, op_id)
        self.ops_completed += 1

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
                    f"{pc.api} (seq {pc.seq}) on group {_describe(pc.group.ranks)} "
                    f"({pc.group.desc or pc.group.key}): ranks {_describe(tuple(arrived))} waited "
                    f"{now - pc.first_t:.1f}s for ranks {_describe(tuple(missing))}, which never arrived "
                    f"(deadline {self.timeout_s:g}s; raise it with comm.timeout_s=)"
                )
        for (key, src, dst, tag), waiters in self._recvs.items():
            for _op, _conn, _row, seq, _dst, t in waiters:
                if now - t > self.timeout_s:
                    g = self._groups[key]
                    raise CaptureDeadlineError(
                        f"recv (seq {seq}, tag {tag}) on group {_describe(g.ranks)} ({g.desc or key}): "
                        f"rank {dst} waited {now - t:.1f}s for a send from rank {src} that never came "
                        f"(deadline {self.timeout_s:g}s)"
                    )

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
            return f"{len(self._collectives)} collective(s) never completed, e.g. {pc.api} seq {pc.seq} on {_describe(pc.group.ranks)}"
        if any(self._recvs.values()):
            return "a recv never completed"
        return None
