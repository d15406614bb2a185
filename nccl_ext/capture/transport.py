"""Rank side of capture: every op goes to the coordinator, which computes it from all
members' real contributions and records it — except collectives of small groups whose members
are all captured, which pass their data through the shared-memory exchange
(:mod:`nccl_ext.exchange.arena`: each member computes its own result; the coordinator gets locations).

One reader thread per rank receives results (they may complete out of issue order:
a pipeline stage's irecv from the next stage can finish before one from the previous)
and enforces each op's deadline, so no wait is unbounded even for async work.

Context switching: a rank runs only while it holds one of the coordinator's execution
slots. It waits for a slot ("go") before its program communicates for the first time,
hands it back when it blocks on an op that is not complete (:meth:`park`), and waits for
a slot again once the op is done — so ``capture.slots`` ranks compute at a time however
many logical ranks exist.

The transport composes collaborators, each with its own state: the coordinator link
(:mod:`nccl_ext.capture.link`: handshake, sending, the reader, heartbeats, the slot), the ops in
flight (:mod:`nccl_ext.capture.pending_ops`), the waits deferred to the GPU
(:mod:`nccl_ext.capture.deferred_waits`) and the shared-memory exchange
(:mod:`nccl_ext.capture.rank_exchange`); they share only where the rank stands
(:class:`~nccl_ext.capture.progress.RankProgress`) and its ``busy_s``.
"""

from __future__ import annotations

import sys
import time

import torch

from nccl_ext.core import mirrored, replica_sums as folded, routing_counts, synth, wire
from nccl_ext.core.protocol import (Bye, Coll, Group, Ints, LColl, Marker, Memory, Meta, Mirror, Ok, OpFailed,
                                    Outs, Park, PRecv, PSend, Recv, SColl, Send, SOk, Stats, Wait, XFree, XOk, XRecv,
                                    XSend)
from nccl_ext.capture.rank_exchange import RankExchange
from nccl_ext.capture.deferred_waits import DEFER_FROM_STEP, DeferredWaits
from nccl_ext.capture.link import CoordinatorLink
from nccl_ext.capture.pending_ops import PendingOps
from nccl_ext.capture.progress import RankProgress
from nccl_ext.core.groups import GroupInfo
from nccl_ext.core.ops import Collective
from nccl_ext.core.ranklist import short_ranks
from nccl_ext.core.pending import CommDeadlineError, Pending
from nccl_ext.core.call import CollectiveCall
from nccl_ext.core.spans import DeviceTimedClock, thread_cpu_seconds


EXCHANGE_MAX_MEMBERS = 8
"""Groups up to this size use the shared-memory exchange: each member folds every contribution
itself (the coordinator's one fold done by each member, in parallel); larger groups — a data-parallel
reduction of an unfolded capture — go through the coordinator, which folds once."""


STAGED_MIN_BYTES = 64 << 10
"""A contribution to a collective the coordinator computes (a group with members that do not run)
of at least this size is staged in the rank's arena, and its result comes back through the
coordinator's (``scoll``/``sok``, :mod:`prism_launch.capture.staged`); smaller ones ride the socket."""


MIRROR_SCRATCH_BYTES = 16 << 20
"""Slice buffer of a mirrored in-place reduction (:mod:`nccl_ext.core.mirrored`)."""


class CaptureTransport:
    def __init__(self, address: str, authkey: bytes, rank: int, timeout_s: float, *,
                 captured: frozenset[int] | None = None, payload: str = "exact", carry_bytes: int = 0,
                 exchange: str | None = None, gpu_exchange_bytes: int = 0, scope: frozenset[int] | None = None,
                 gpu_waits: bool = False, fold_exchange: bool = False):
        self.rank = rank
        self._progress = RankProgress(rank)
        self._closed = self._progress.closed
        self.busy_s = {"send": 0.0, "stage": 0.0, "exchange_compute": 0.0, "mirror_compute": 0.0, "apply": 0.0,
                       "x_until_complete": 0.0, "x_to_reader": 0.0}
        """Seconds this rank spent on its ops' data by activity (reported to the coordinator at
        close; ``capture.json``'s ``rank_busy_s``): where a capture's time goes on the rank side.
        Of its exchanged collectives: from sending its contribution's location until the
        coordinator saw every member's (``x_until_complete``), and from there until this rank's
        reader had the answer (``x_to_reader``)."""
        self._pending = PendingOps(timeout_s)
        """This rank's ops in flight (:mod:`nccl_ext.capture.pending_ops`)."""
        self._link = CoordinatorLink(address, authkey, timeout_s, self._progress, self._pending, self.busy_s)
        """The connection to the coordinator (:mod:`nccl_ext.capture.link`)."""
        self._waits = DeferredWaits(self._progress, gpu_waits, self._send)
        """Waits on the GPU (:mod:`nccl_ext.capture.deferred_waits`)."""
        self.synthesize = payload == "none"
        """``payload=none``: results are synthesized here (:mod:`nccl_ext.core.synth`); the coordinator
        gets metadata, and the payloads of broadcasts up to ``carry_bytes``."""
        self.carry_bytes = carry_bytes
        self.synthesized = 0
        self.timeout_s = timeout_s
        self._clock = DeviceTimedClock()
        """Host spans (sent with every event) and, on CUDA, the GPU's (sent at close)."""
        self._captured = frozenset(captured) if captured is not None else None
        """Folded capture: the ranks that run (a broadcast from any other root needs a stand-in);
        None: every rank runs."""
        self._exchange = exchange if payload != "none" else None
        """The shared-memory exchange's directory (:mod:`nccl_ext.exchange.arena`), or None."""
        self._fold_exchange = fold_exchange and self._exchange is not None
        """A folded group's weighted reductions are summed by its captured members from each
        other's staged contributions (:func:`nccl_ext.core.replica_sums.exchangeable`), not by the coordinator."""
        self._mirrored: dict[str, bool] = {}
        """Keys of folded groups whose collectives this rank computes itself (the coordinator said
        so: it is their only captured member and stands in for every other; :mod:`nccl_ext.core.mirrored`)
        -> whether the trace keeps its data of them (a sandbox rank's: its contribution's digest,
        its result), which then goes through the exchange."""
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._x = RankExchange(self._progress, self._exchange, scope, gpu_exchange_bytes, self._pending, self._send,
                               self._span, self._waits, self.busy_s)
        """This rank's side of the shared-memory exchange (:mod:`nccl_ext.capture.rank_exchange`)."""
        self.mirrored_ops = 0
        self.staged_ops = 0
        """Collectives computed by the coordinator whose contribution and result went through shared memory."""
        self._link.start(self._reply_table())
        self._link.await_slot(f"rank {rank}: waiting for a first capture slot")

    @property
    def unit(self) -> int:
        """The program's step."""
        return self._progress.unit

    def deferred_failed(self, p: Pending, error: BaseException) -> None:
        """Writing a deferred op's results failed after its wait returned: the next op raises it."""
        self._waits.deferred_failed(p, error)

    @property
    def captured(self) -> frozenset[int] | None:
        """The ranks a folded capture runs (None: every rank runs)."""
        return self._captured

    @property
    def parked_s(self) -> float:
        """Time this rank waited for an execution slot."""
        return self._link.parked_s

    # -- context switching ----------------------------------------------------------------
    def park(self, pending: Pending):
        self._clock.wait_starts()  # the program blocks here: on the GPU the span ends now
        if pending.op_id < 0 or self._progress.unparked:
            return None
        self._send(Park(pending.op_id))
        what = f"{pending.what}: resuming after the op completed"
        return lambda: self._link.await_slot(what)

    # -- sending --------------------------------------------------------------------------
    def _send(self, message: tuple, tensors=()) -> None:
        self._link.send(message, tensors)

    def _span(self, until: float | None = None) -> tuple[float, float, float]:
        return self._clock.lap(until)

    def register_group(self, group: GroupInfo) -> None:
        self._send(Group(group.key, group.ranks, group.occurrence, group.desc))

    def collective(self, group: GroupInfo, seq: int, call: CollectiveCall) -> Pending:
        self._waits.check_deferred()
        what = f"rank {self.rank}: {call.api} on group {group.key} (ranks {short_ranks(group.ranks)}) seq {seq}"
        ints = routing_counts.small_ints(call.kind, call.tensors)
        if ints is not None:  # kept by value in every payload mode (MoE routing statistics)
            self._send(Ints(group.key, seq, ints))
        if call.kind is Collective.ALL_TO_ALL and call.outputs and self._captured is not None \
                and not self._captured.issuperset(group.ranks):  # uncaptured peers' pieces are sized by these
            self._send(Outs(group.key, seq, [list(x.shape) for x in call.outputs]))
        if self.synthesize and not synth.carried(call, self.carry_bytes) and \
                not routing_counts.carried_counts(call.kind, call.tensors, group.desc):
            return self._synthesized(group, seq, call, what)
        if not self._scratch and self._captured is not None and call.tensors and call.tensors[0].is_cuda:
            # before the program's memory grows, so no peak is measured without it
            self._scratch_on(call.tensors[0].device)
            if self._exchange is not None:
                self._x.start_on_device(call.tensors[0].device)
        keep = self._mirrored.get(group.key)
        if keep is not None and call.kind in mirrored.SUPPORTED and (not keep or self._exchange is not None):
            return self._mirrored_op(group, seq, call, what, keep)
        if self._fold_exchange and call.tensors and \
                folded.exchangeable(call.kind, call.reduce, group.ranks, self._captured, EXCHANGE_MAX_MEMBERS):
            return self._x.exchanged(group, seq, call, what, folded=True)
        if self._exchange is not None and call.kind is not Collective.BARRIER and \
                group.size <= EXCHANGE_MAX_MEMBERS and (self._captured is None or self._captured.issuperset(group.ranks)):
            return self._x.exchanged(group, seq, call, what)
        op_id, p = self._pending.new(what)
        t, wall, cpu = self._span()
        tensors, contributes = call.tensors, call.tensors is not None
        if (tensors is None and call.standin is not None and self._captured is not None
                and group.ranks[call.root] not in self._captured):
            tensors, contributes = call.standin, "standin"
        self._waits.from_host(p, call)
        header = Coll(op_id, group.key, seq, call.api, str(call.kind),
                      None if call.reduce is None else str(call.reduce), call.root,
                      contributes, self.unit, t, wall, cpu)
        if self._exchange is not None and contributes is True and tensors and \
                sum(x.numel() * x.element_size() for x in tensors) >= STAGED_MIN_BYTES:
            self._x.open()
            t0 = time.perf_counter()
            gen, descs, region = self._x.put(list(tensors))
            self._x.hold(op_id, region)
            self.busy_s["stage"] += time.perf_counter() - t0
            self.staged_ops += 1
            self._send(SColl(*header, (gen, descs)))
            return p
        self._send(header, tensors or ())
        return p

    def _mirrored_op(self, group: GroupInfo, seq: int, call: CollectiveCall, what: str, keep: bool) -> Pending:
        """A folded group's collective whose every member contributes this rank's data: computed
        here with the coordinator's arithmetic (:mod:`nccl_ext.core.mirrored`); the coordinator gets
        the event's metadata, and where the trace keeps this rank's data (``keep``: a sandbox
        rank) where its contribution (staged before an in-place reduction changes it) and its
        result lie in the arena; the regions are freed when the coordinator has read them."""
        t, wall, cpu = self._span()
        mine = call.tensors or ()
        device = next((x.device for x in (*mine, *(call.outputs or ()), *(call.standin or ()))), torch.device("cpu"))
        kept = None
        if keep:
            self._x.open()
            op_id = self._pending.next_id()
            t0 = time.perf_counter()
            regions, contribution = [], None
            if mine:
                gen, descs, region = self._x.put(list(mine))
                regions.append(region)
                contribution = (gen, descs)
            self.busy_s["stage"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = mirrored.results(call, group.size, group.group_rank(self.rank), self._scratch_on(device))
        self.busy_s["mirror_compute"] += time.perf_counter() - t0
        if keep:
            t0 = time.perf_counter()
            by_id = {id(x): i for i, x in enumerate(mine)}
            if call.kind in (Collective.ALL_GATHER, Collective.ALL_TO_ALL):  # pieces of the contribution
                result = ("c", [by_id[id(x)] for x in out])
            elif out:
                gen, descs, region = self._x.put(out)
                regions.append(region)
                result = ("r", gen, descs)
            else:
                result = None
            self.busy_s["stage"] += time.perf_counter() - t0
            self._x.hold(op_id, regions)
            kept = (op_id, contribution, result)
        self._send(LColl(group.key, seq, call.api, str(call.kind), None if call.reduce is None else str(call.reduce),
                         call.root, self.unit, t, wall, cpu, [list(x.shape) for x in mine],
                         [wire.dtype_name(x.dtype) for x in mine], sum(x.numel() * x.element_size() for x in mine),
                         kept))
        self.mirrored_ops += 1
        return Pending.done(what, out)

    def _scratch_on(self, device: torch.device) -> torch.Tensor:
        """The slice buffer of in-place mirrored reductions on ``device``: outside the program's
        memory figures (host: untracked; device: published like the device path's pool)."""
        buf = self._scratch.get(device)
        if buf is None:
            if device.type == "cpu":
                buf = wire.untracked_empty((MIRROR_SCRATCH_BYTES,), torch.uint8)
            else:
                from nccl_ext.core.device_memory import allocate_outside

                buf = allocate_outside(device, MIRROR_SCRATCH_BYTES)
            self._scratch[device] = buf
        return buf

    def _synthesized(self, group: GroupInfo, seq: int, call: CollectiveCall, what: str) -> Pending:
        t, wall, cpu = self._span()
        mine = call.tensors or ()
        self._send(Meta(group.key, seq, call.api, str(call.kind), None if call.reduce is None else str(call.reduce),
                        call.root, self.unit, t, wall, cpu, [list(x.shape) for x in mine],
                        [wire.dtype_name(x.dtype) for x in mine], sum(x.numel() * x.element_size() for x in mine)))
        self.synthesized += 1
        return Pending.done(what, synth.results(call, group.size, group.group_rank(self.rank)))

    def send(self, group: GroupInfo, dst: int, tag: int, seq: int, tensor: torch.Tensor) -> Pending:
        self._waits.check_deferred()
        t, wall, cpu = self._span()
        if self.synthesize:
            self._send(PSend(group.key, dst, tag, seq, self.unit, t, wall, cpu, list(tensor.shape),
                             wire.dtype_name(tensor.dtype), tensor.numel() * tensor.element_size()))
            return Pending.done("send")
        if self._exchange is not None and (self._captured is None or dst in self._captured):
            # staged in this rank's arena; the receiver reads it there (the coordinator names where)
            # and the region is freed once it has
            op_id = self._pending.next_id()
            location = self._x.stage_send(op_id, tensor, dst)
            self._send(XSend(op_id, group.key, dst, tag, seq, self.unit, t, wall, cpu, location))
            return Pending.done("send")
        self._send(Send(-1, group.key, dst, tag, seq, self.unit, t, wall, cpu), [tensor])
        return Pending.done("send")

    def recv(self, group: GroupInfo, src: int, tag: int, seq: int, like: torch.Tensor) -> Pending:
        self._waits.check_deferred()
        what = f"rank {self.rank}: recv from rank {src} tag {tag} on group {group.key} seq {seq}"
        if self.synthesize:
            t, wall, cpu = self._span()
            self._send(PRecv(group.key, src, tag, seq, self.unit, t, wall, cpu, list(like.shape),
                             wire.dtype_name(like.dtype), like.numel() * like.element_size()))
            self.synthesized += 1
            return Pending.done(what, [synth.fill(like)])
        op_id, p = self._pending.new(what)
        t, wall, cpu = self._span()
        self._x.expect_recv(op_id, p, like, src)
        self._send(Recv(op_id, group.key, src, tag, seq, self.unit, t, wall, cpu))
        return p

    def returned(self) -> None:
        # on CUDA the op's trip to the coordinator is not the program's compute (NCCL enqueues and
        # returns); on CPU its host work stays in the span, as in emulation (nccl_ext/core/spans.py)
        self._clock.returned(torch.cuda.is_initialized())

    def waited(self, ref: tuple, t0: float | None, t1: float | None) -> None:
        """Record where the rank blocked on an op (or found it done) — the dependency the
        global replay needs to tell overlapped communication from exposed waits."""
        t, wall, cpu = self._span(until=t0)
        if t1 is not None:
            self._clock.resume(t1)
        self._send(Wait(ref, self.unit, t, wall, cpu, t0, t1))

    def report_memory(self, summary: dict) -> None:
        self._send(Memory(self.rank, summary))

    def marker(self, name: str) -> None:
        t, wall, cpu = self._span()
        self._send(Marker(name, self.unit, t, wall, cpu))
        if name == "step":
            if self.unit + 1 == DEFER_FROM_STEP:
                self._waits.before_deferring(self._x.arena)
            self._progress.unit += 1

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._x.close_gpu(self.timeout_s)  # the reads of ops whose folds are still running on the GPU
        self._waits.close_deferred(self.timeout_s)  # flags still deferred: written, or failed by name
        if self._waits.deferred_error is not None:  # no op came after it to raise it
            print(f"prism-launch: rank {self.rank}: an op failed after the program went on past its wait: "
                  f"{self._waits.deferred_error}", file=sys.stderr, flush=True)
        try:
            self._send(Stats(self.rank, {"parked_s": round(self.parked_s, 3), "mirrored_ops": self.mirrored_ops,
                                         "deferred_waits": self._waits.deferred_waits,
                                         "staged_ops": self.staged_ops,
                                         **self._x.stats(),
                                         "thread_cpu_s": thread_cpu_seconds(),
                                         "device_spans_s": self._clock.device_seconds(),
                                         **{k: round(v, 3) for k, v in self.busy_s.items()}}))
            self._send(Bye(self.rank))
        except OSError:
            pass
        self._link.join_reader()
        self._x.close()

    # -- receiving: the coordinator's replies, on the link's reader thread ------------------
    def _reply_table(self) -> dict:
        """Each reply the coordinator sends once connected (:data:`nccl_ext.core.protocol.REPLIES`)
        -> its handler ``(message, tensors)``."""
        return {**self._link.own_handlers(), Mirror: self._on_mirror, XOk: self._on_xok, SOk: self._on_sok,
                XRecv: self._on_xrecv, XFree: self._on_xfree, Ok: self._on_done, OpFailed: self._on_done}

    def _on_mirror(self, m: Mirror, tensors) -> None:
        self._mirrored[m.key] = m.keep

    def _on_xok(self, m: XOk, tensors) -> None:
        self._x.answered(m.op_id, m.locations, m.t, m.parts, self._link.alive)

    def _on_sok(self, m: SOk, tensors) -> None:
        self._x.receive_result(m.op_id, m.location)

    def _on_xrecv(self, m: XRecv, tensors) -> None:
        self._x.receive_exchanged(m.op_id, m.location)

    def _on_xfree(self, m: XFree, tensors) -> None:
        self._x.free(m.op_id)

    def _on_done(self, m: Ok | OpFailed, tensors) -> None:
        """Op ``m.op_id`` completed with ``tensors``, or failed."""
        op_id = m.op_id
        self._x.forget_recv(op_id)
        p = self._pending.pop(op_id)
        if p is None:
            return
        if isinstance(m, Ok):
            p.complete(tensors)
        else:
            p.fail(CommDeadlineError(m.message) if m.deadline else RuntimeError(m.message))

