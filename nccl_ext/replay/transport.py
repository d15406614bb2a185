"""Emulation side: a sandbox rank's ops are completed from live sandbox contributions
plus the virtual members' recorded ones.

For each collective the sandbox enters, the result is recomputed with
:func:`nccl_ext.core.ops.compute` over all members' contributions in group-rank order —
live tensors for sandbox members (exchanged over a real gloo group between sandbox
processes), recorded tensors for virtual members (**compensation**) — so a
deterministic script's sandbox outputs are bit-identical to the capture's. A live
contribution that differs from the recorded one is a **divergence**: reported with
step, op and group, and an error in strict mode.

Virtual members arrive when the recording says, relative to the sandbox's own
progress: a member recorded as arriving ``d`` seconds after this rank at this op
delays completion by ``d`` (``timing="recorded"``: the capture's wall clock; ``"predicted"``:
the global replay's schedule on the target cluster, given to the recording), or not at all
(``timing="none"``).

What the replay reads is :class:`nccl_ext.replay.recording.Recording`; what it counts and the summary
it writes are :mod:`nccl_ext.replay.summary`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from nccl_ext.core import wire

from nccl_ext.replay import synthesized as synth_replay
from nccl_ext.replay.assistant import awaited, unpack
from nccl_ext.device_path import DevicePath, eligible, result_of
from nccl_ext.replay.divergence import HOST_SCALAR_MAX_ELEMENTS, HOST_SCALAR_SITES, DivergenceLog, Kind
from nccl_ext.core.groups import GroupInfo
from nccl_ext.core.threads import GRACE_S, HelperThreads, wait_works
from nccl_ext.core.ops import Collective, compute, contributors
from nccl_ext.core.errors import CommError, DivergenceError
from nccl_ext.core.pending import Pending
from nccl_ext.core.call import CollectiveCall
from nccl_ext.pruning.rings import RingChannels, SerialWorker, ring_of, ring_processes, run_op, uses_ring
from nccl_ext.replay.recording import RecordedOp, Recording
from nccl_ext.replay.checks import check_contribution, check_send, refs
from nccl_ext.replay.sandbox_peers import barrier_tokens, exchange, tag
from nccl_ext.replay.summary import ReplayStats, own_time, write_summary
from nccl_ext.core.spans import SpanRecorder

__all__ = ["DivergenceError", "RecordedOp", "Recording", "ReplayStats", "ReplayTransport"]


_tag = tag


class ReplayTransport:
    def __init__(
        self,
        *,
        rank: int,
        sandbox: tuple[int, ...],
        recording: Recording,
        timeout_s: float,
        physical: dist.ProcessGroup | None,
        timing: str,
        assistant: int | None = None,
        on_close: Callable[[], None] | None = None,
        time_scale: float = 1.0,
        strict: bool = False,
        check: bool = True,
        summary_path: Path | None = None,
        device_path: DevicePath | None = None,
        pruned: bool = False,
        rings: RingChannels | None = None,
        payload: str = "exact",
        carry_bytes: int = 0,
        divergence_rtol: float | None = None,
        host_scalar_sites: tuple[str, ...] = HOST_SCALAR_SITES,
        host_scalar_max_elements: int = HOST_SCALAR_MAX_ELEMENTS,
    ):
        self.rank = rank
        self.synthesize = payload == "none"
        """The trace holds no payloads: every result is synthesized (``nccl_ext/replay/synthesized.py``)."""
        self.carry_bytes = carry_bytes
        self.sandbox = sandbox
        self.recording = recording
        self.timeout_s = timeout_s
        self.physical = physical
        """gloo group over the sandbox processes in ``sandbox`` order (+ the assistant last), or None."""
        self.assistant = assistant
        """Physical rank of the assistant process serving virtual contributions; None: read them here."""
        self._on_close = on_close
        self.timing = timing
        """How virtual members' recorded lateness delays completion: "recorded", "predicted" or
        "none" (no default: the caller passes the config's ``emulate.timing``)."""
        self.time_scale = time_scale
        self.strict = strict
        self.check = check
        """Compare live contributions with the recorded ones (divergence detection)."""
        self.summary_path = summary_path
        self.device_path = device_path
        """Ops with no other sandbox member run on the sandbox's device (prefetch + compensation
        there); None: every op takes the host path."""
        self.pruned = pruned
        """Collectives shared by several sandbox ranks run over pruned rings (else every sandbox
        member gathers all live contributions and folds on the host)."""
        self.rings = rings
        """The pruned rings' communicators, one per logical group (needed when ``pruned``)."""
        if pruned and rings is None and len(sandbox) > 1:
            raise ValueError("pruned rings need their channels (rings=RingChannels(...))")
        self._ring_workers: dict[int, SerialWorker] = {}
        self._helpers = HelperThreads(f"rank{rank}")
        """The threads completing this rank's ops; joined by ``close()`` (see ``nccl_ext/core/threads.py``)."""
        self._workers_closed = 0
        self.unit = 0
        self.stats = ReplayStats()
        self.divergences = DivergenceLog(rank, self.stats, strict=strict, rtol=divergence_rtol,
                                         sites=host_scalar_sites, max_elements=host_scalar_max_elements)
        self._gids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._unit_start: float | None = None
        self.memory: dict | None = None
        self.spans = SpanRecorder()
        """Compute before each of this rank's events, in order: what slice calibration takes from a
        sandbox run."""

    # -- helpers ------------------------------------------------------------------------------
    def _gid(self, group: GroupInfo) -> int:
        gid = self._gids.get(group.key)
        if gid is None:
            gid = self.recording.group_id(group.key)
            if gid is None:
                raise DivergenceError(
                    f"rank {self.rank}: group {list(group.ranks)[:16]} ({group.desc or group.key}) was never used "
                    "in the capture; the program diverged from the trace — capture again (mode=capture)"
                )
            self._gids[group.key] = gid
        return gid

    def phys_rank(self, rank: int) -> int:
        return self.sandbox.index(rank)

    def delay_for(self, own: RecordedOp, others: list[RecordedOp]) -> float:
        if self.timing == "none" or not others:
            return 0.0
        lag = max(o.t_start for o in others) - own.t_start
        return max(lag, 0.0) * self.time_scale

    def finish_after(self, pending: Pending, value, delay: float) -> None:
        if delay <= 0:
            pending.complete(value)
            return
        with self._lock:
            self.stats.waited_s += delay
        self._helpers.after(delay, pending.complete, value, what=pending.what, pending=pending)

    def _when_all(self, works: list, then, pending: Pending) -> None:
        """Run ``then`` once every c10d work finished; fail ``pending`` if one failed.

        gloo's send/recv works have no future (torch 2.13: "Work::getFuture not
        implemented"), so a short-lived thread waits on them, until the op's deadline
        (:func:`nccl_ext.core.threads.wait_works`). One thread per op, never a shared queue:
        an earlier async recv may only complete after a later op of this rank does.
        """
        if not works:
            then()
            return

        def wait_all() -> None:
            try:
                wait_works(works, pending)  # releases the works' sent tensors before completing
                then()
            except BaseException as e:  # noqa: BLE001 - surfaced through the pending op (named by wait_works)
                pending.fail(e if isinstance(e, (CommError, DivergenceError)) else CommError(f"{pending.what}: {e}"))

        self._helpers.start(wait_all, name="prism-sandbox-exchange", what=pending.what, pending=pending)

    def diverged(self, what: str, group: GroupInfo, seq: int, detail: str, kind: Kind = Kind.value,
                  site: str | None = None, diff: dict | None = None) -> None:
        self.divergences.report(kind, step=self.unit, op=what, group=group, seq=seq, detail=detail, site=site,
                                **(diff or {}))

    # -- Transport ----------------------------------------------------------------------------
    def register_group(self, group: GroupInfo) -> None:
        pass  # group reduction: nothing to set up until an op uses the group

    @own_time
    def collective(self, group: GroupInfo, seq: int, call: CollectiveCall) -> Pending:
        replayed = self._collective(group, seq, call)
        if call.kind is not Collective.BARRIER:
            return replayed
        peers = [m for m, r in enumerate(group.ranks) if r != self.rank and r in self.sandbox]
        if not peers:
            return replayed
        # sandbox members of a barrier wait for each other for real (whatever path replayed it)
        pending = Pending(replayed.what, self.timeout_s)
        works = barrier_tokens(self, group, self._gid(group), seq, group.group_rank(self.rank), peers)
        self._when_all(works, lambda: replayed.add_done_callback(
            lambda p: pending.complete(p.result()) if p.succeeded else pending.fail(p.error)), pending)
        return pending

    def _collective(self, group: GroupInfo, seq: int, call: CollectiveCall) -> Pending:
        self._span("c")
        gid = self._gid(group)
        what = f"rank {self.rank}: {call.api} on group {group.desc or group.key} seq {seq}"
        own = self.recording.collective(self.rank, gid, seq)
        if own is None:
            raise DivergenceError(
                f"{what}: the trace has no such op (it ends earlier or the program diverged); "
                "capture again with the same script arguments (mode=capture)"
            )
        if own.op != call.api:
            raise DivergenceError(f"{what}: the capture recorded {own.op} here; the program diverged")
        if self.synthesize:
            return synth_replay.collective(self, group, gid, seq, call, own, what)
        if self.device_path is not None and eligible(self.sandbox, self.rank, group.ranks):
            return self._device_collective(group, gid, seq, call, own, what)
        if self.recording.folded(gid):
            return self._folded_collective(group, gid, seq, call, own, what)
        if self.pruned and uses_ring(str(call.kind), group.ranks, self.sandbox, False) and \
                (self.assistant is not None or all(r in self.sandbox for r in group.ranks)):
            return self._ring_collective(group, gid, seq, call, own, what)
        n = group.size
        needed = contributors(call.kind, n, call.root)
        contributions: list[list[torch.Tensor] | None] = [None] * n
        others: list[RecordedOp] = []
        live_peers: list[int] = []
        served: list[tuple[int, RecordedOp]] = []
        me = group.group_rank(self.rank)
        for m, r in enumerate(group.ranks):
            if r == self.rank:
                continue
            if r in self.sandbox:
                live_peers.append(m)
                continue
            rec = self.recording.collective(r, gid, seq)
            if rec is None:
                raise DivergenceError(f"{what}: no recorded op of virtual member rank {r}")
            others.append(rec)
            if m in needed:
                if self.assistant is None:
                    contributions[m] = self.recording.contribution(r, gid, seq)
                elif rec.nbytes == 0:  # the assistant sends no message for an empty payload
                    contributions[m] = [torch.empty(tuple(s), dtype=wire.dtype_from_name(d))
                                        for s, d in zip(rec.shapes, rec.dtypes)]
                else:
                    served.append((m, rec))
        if call.tensors is not None:
            live = [_host(t) for t in call.tensors]
            contributions[me] = live
            if me in needed and self.check:
                self._check(call.api, group, seq, gid, live, own)
        self.stats.ops += 1
        self.note_unit_start()
        pending = Pending(what, self.timeout_s)
        delay = self.delay_for(own, others)

        def finish() -> None:
            result = compute(call.kind, contributions, reduce=call.reduce, root=call.root)[me]
            contributions.clear()  # free inputs when a real backend would, not when this closure dies
            call.tensors = None
            self.finish_after(pending, result, delay)

        works: list = []
        if served:
            buf = wire.untracked_empty((sum(rec.nbytes for _, rec in served),), torch.uint8)
            works.append(self.physical.recv([buf], self.assistant, own.idx))
            pending.waiting_for = awaited(self.assistant, [group.ranks[m] for m, _ in served], own.idx)
            inner = finish

            def finish() -> None:
                unpack(buf, served, contributions)
                inner()

        if live_peers:
            works += self._exchange(group, gid, seq, call, me, needed, live_peers, contributions)
        self._when_all(works, finish, pending)
        return pending

    def _ring_collective(self, group, gid, seq, call, own: RecordedOp, what: str) -> Pending:
        """A collective shared with other sandbox ranks, over the pruned ring of the physical
        processes: live members plus the assistant playing one edge per arc of virtual members
        (``nccl_ext/pruning/rings.py``). The group's ops run one after another on its own worker
        thread and communicator, in the program's order — the order the assistant plays the
        group's recorded ops in, so no message has to tell it which op comes next."""
        me = group.group_rank(self.rank)
        ring = ring_of(group.ranks, self.sandbox, self.assistant if self.assistant is not None else -1)
        rings = self.rings
        on_device = rings.device is not None
        if on_device:  # NCCL: the ring reads a copy on the device, ordered after the program's stream
            live = [t.detach().clone() for t in call.tensors]
            ready = torch.cuda.Event()
            ready.record()
        else:
            live = [_host(t) for t in call.tensors]
        if self.check:
            self._check(call.api, group, seq, gid, [_host(t) for t in live] if on_device else live, own)
        self.stats.ops += 1
        self.stats.physical_exchanges += 1
        self.note_unit_start()
        delay = self.delay_for(own, self.virtual_ops(group, gid, seq))
        pending = Pending(what, self.timeout_s)
        phys, kind, reduce, k = self.phys_rank(self.rank), str(call.kind), call.reduce, len(live)
        call.tensors = None

        def run() -> None:
            try:
                pg, local = rings.get(gid, ring_processes(ring))
                # a thread starts on GPU 0: the ring works on the program's GPU
                with torch.cuda.device(rings.device) if on_device else contextlib.nullcontext():
                    if on_device:
                        torch.cuda.current_stream().wait_event(ready)
                    result = run_op(ring, pg, local, phys, gid, seq, kind, reduce, lambda m: live, k,
                                    tags=rings.tags, deadline=pending.deadline, what=what)[me]
                    if on_device:  # complete once the result is in memory (any stream may read it)
                        torch.cuda.current_stream().synchronize()
                self.finish_after(pending, result, delay)
            except BaseException as e:  # noqa: BLE001 - surfaced through the pending op
                pending.fail(RuntimeError(f"{what}: pruned ring failed: {e}"))

        worker = self._ring_workers.get(gid)
        if worker is None:
            worker = self._ring_workers[gid] = SerialWorker(f"prism-ring-{gid}")
        worker.submit(run)
        return pending

    def virtual_ops(self, group: GroupInfo, gid: int, seq: int) -> list[RecordedOp]:
        """The recorded ops of the group's virtual members at this op (for their arrival times);
        on a folded group the captured ones, which every uncaptured member mirrors."""
        ranks = self.recording.captured_members(gid) if self.recording.folded(gid) else group.ranks
        out = []
        for r in ranks:
            if r != self.rank and r not in self.sandbox:
                rec = self.recording.collective(r, gid, seq)
                if rec is not None:
                    out.append(rec)
        return out

    def _device_collective(self, group, gid, seq, call, own: RecordedOp, what: str) -> Pending:
        """A collective whose other members are all virtual, on the sandbox's device: their
        staged data (a folded group's recorded result, or the pieces of their recorded
        contributions folded with the live tensor in group-rank order) without a host copy of
        the live tensor; its checksum is compared at the step boundary."""
        dp = self.device_path
        me = group.group_rank(self.rank)
        folded = self.recording.folded(gid)
        live = [t.detach() for t in call.tensors] if call.tensors is not None else None
        staged = dp.take(own.idx, what)
        if live:
            staged = dp.on(staged, live[0].device)
        if live is not None and me in contributors(call.kind, group.size, call.root):
            shapes = [tuple(t.shape) for t in live]
            if shapes != [tuple(s) for s in own.shapes]:
                raise DivergenceError(f"{what}: shapes {shapes} differ from the recorded "
                                      f"{[tuple(s) for s in own.shapes]}; capture again")
            if self.check:
                dp.verify(live, staged.refs, (call.api, group, seq, self.divergences.site(live),
                                              lambda: refs(own, lambda: self.recording.contribution(self.rank, gid, seq))))
        self.stats.ops += 1
        self.stats.folded_ops += folded
        self.note_unit_start()
        delay = self.delay_for(own, self.virtual_ops(group, gid, seq))
        on_device = dp.on_device
        if on_device:
            dp.delay(delay)  # the lateness goes on the op's stream, ahead of the result
        if folded:
            result = list(staged.result)
        else:
            result = result_of(call.kind, group.size, me, call.root, live, staged.terms, staged.scratch, call.reduce)
        call.tensors = None
        pending = Pending(what, self.timeout_s)
        if on_device:
            pending.complete(result)
        else:
            self.finish_after(pending, dp.finish(result), delay)
        return pending

    def _folded_collective(self, group, gid, seq, call, own: RecordedOp, what: str) -> Pending:
        """A collective whose group spans uncaptured replicas. Recomputing it would fold
        one stand-in contribution per replica (O(data-parallel size) work and traffic per
        op): the capture's result is the precomputed answer — the compensation — and it is
        exact whenever this rank's live contribution equals the recorded one. On a
        divergence the result is recomputed from the live tensor and the recorded peers."""
        me = group.group_rank(self.rank)
        self.stats.ops += 1
        self.stats.folded_ops += 1
        self.note_unit_start()
        others = []
        # uncaptured members mirror captured ones: their arrival is one of these (O(captured), not O(group))
        for r in self.recording.captured_members(gid):
            if r != self.rank and r not in self.sandbox:
                rec = self.recording.collective(r, gid, seq)
                if rec is not None:
                    others.append(rec)
        live = [_host(t) for t in call.tensors] if call.tensors is not None else None
        diverged = False
        if live is not None and me in contributors(call.kind, group.size, call.root) and self.check:
            before = len(self.stats.divergences)
            self._check(call.api, group, seq, gid, live, own)
            diverged = len(self.stats.divergences) > before
        needed = contributors(call.kind, group.size, call.root)
        if diverged and all(group.ranks[m] == self.rank or self.recording.stored(group.ranks[m], gid, seq) for m in needed):
            contributions: list = [None] * group.size
            for m in needed:
                r = group.ranks[m]
                contributions[m] = live if r == self.rank else self.recording.contribution(r, gid, seq)
            result = compute(call.kind, contributions, reduce=call.reduce, root=call.root)[me]
        else:  # (a trace without the peers' contributions: the recorded result, as on the device path)
            result = self.recording.result(self.rank, gid, seq)
        call.tensors = None
        pending = Pending(what, self.timeout_s)
        self.finish_after(pending, result, self.delay_for(own, others))
        return pending

    def _check(self, api, group, seq, gid, live, own: RecordedOp) -> None:
        check_contribution(self, api, group, seq, gid, live, own)

    def _exchange(self, group, gid, seq, call, me, needed, live_peers, contributions) -> list:
        """Swap live contributions with the other sandbox members of ``group`` over gloo."""
        self.stats.physical_exchanges += 1
        return exchange(self, group, gid, seq, call, me, needed, live_peers, contributions)

    @own_time
    def send(self, group: GroupInfo, dst: int, tag: int, seq: int, tensor: torch.Tensor) -> Pending:
        self._span("s")
        gid = self._gid(group)
        self.stats.p2p += 1
        self.note_unit_start()
        if self.synthesize:
            return synth_replay.send(self, group, gid, dst, tag, seq, tensor)
        if self.device_path is not None and dst not in self.sandbox:
            return self._device_send(group, gid, dst, tag, seq, tensor)
        if dst in self.sandbox:
            work = self.physical.send([tensor.detach().contiguous().cpu()], self.phys_rank(dst), _tag(gid, self.rank, dst, tag, seq, 7))
            pending = Pending(f"rank {self.rank}: send to rank {dst} tag {tag} seq {seq}", self.timeout_s)
            self._when_all([work], lambda: pending.complete(None), pending)
            return pending
        rec = self.recording.sent(gid, self.rank, dst, tag, seq)
        if rec is None:
            raise DivergenceError(f"rank {self.rank}: send #{seq} to rank {dst} (tag {tag}) is not in the trace")
        if self.check:
            check_send(self, group, seq, dst, tensor, *rec)
        return Pending.done("send")

    @own_time
    def recv(self, group: GroupInfo, src: int, tag: int, seq: int, like: torch.Tensor) -> Pending:
        self._span("r")
        gid = self._gid(group)
        self.stats.p2p += 1
        what = f"rank {self.rank}: recv #{seq} from rank {src} tag {tag} on group {group.desc or group.key}"
        if self.synthesize:
            return synth_replay.recv(self, group, gid, src, tag, seq, like, what)
        pending = Pending(what, self.timeout_s)
        if src in self.sandbox:
            buf = wire.untracked_empty(like.shape, like.dtype)
            work = self.physical.recv([buf], self.phys_rank(src), _tag(gid, src, self.rank, tag, seq, 7))
            self._when_all([work], lambda: pending.complete([buf]), pending)
            return pending
        sent = self.recording.sent(gid, src, self.rank, tag, seq)
        own = self.recording.received(self.rank, gid, src, tag, seq)
        if sent is None or own is None:
            raise DivergenceError(f"{what}: not in the trace; capture again")
        rec_send, tensor = sent
        delay = 0.0 if self.timing == "none" else max(0.0, rec_send.t_start - own.t_start) * self.time_scale
        if self.device_path is not None:
            dp = self.device_path
            staged = dp.on(dp.take(own.idx, what), like.device)
            if dp.on_device:
                dp.delay(delay)
                pending.complete([staged.result[0]])
            else:
                self.finish_after(pending, dp.finish([staged.result[0]]), delay)
            return pending
        if self.assistant is None:
            self.finish_after(pending, [tensor()], delay)
            return pending
        buf = wire.untracked_empty((rec_send.nbytes,), torch.uint8)
        work = self.physical.recv([buf], self.assistant, own.idx)
        pending.waiting_for = awaited(self.assistant, [src], own.idx)
        out: list = [None]
        self._when_all([work], lambda: self.finish_after(pending, unpack(buf, [(0, rec_send)], out)[0], delay), pending)
        return pending

    def _device_send(self, group, gid, dst, tag, seq, tensor) -> Pending:
        what = f"rank {self.rank}: send #{seq} to rank {dst} tag {tag} on group {group.desc or group.key}"
        rec = self.recording.sent(gid, self.rank, dst, tag, seq)
        if rec is None:
            raise DivergenceError(f"{what}: not in the trace; capture again")
        live = tensor.detach()
        if tuple(live.shape) != tuple(rec[0].shapes[0]):
            raise DivergenceError(f"{what}: shape {tuple(live.shape)} differs from the recorded {tuple(rec[0].shapes[0])}")
        staged = self.device_path.take(rec[0].idx, what)
        if self.check:
            self.device_path.verify([live], staged.refs, ("send", group, seq, self.divergences.site([live]),
                                                          lambda: refs(rec[0], lambda: [self.recording.payload(
                                                              gid, self.rank, dst, tag, seq)])))
        return Pending.done("send")

    def _flush_checks(self) -> None:
        if self.device_path is None:
            return
        for (api, group, seq, site, load), i, dtype, numel, norm in self.device_path.flush():
            self.diverged(api, group, seq, "live contribution's checksum differs from the recorded one (device "
                           "check at the step boundary; the recorded data was used)",
                           *self.divergences.classify_norms(dtype, norm, load()[i], numel, site))

    def report_memory(self, summary: dict) -> None:
        self.memory = summary

    def park(self, pending: Pending):
        self.spans.wait_starts()
        return None  # sandbox ranks own their device: nothing to hand back while blocked

    def returned(self) -> None:
        # the op's handling here (host copies, folds, checks: none of it the real backend's cost,
        # which the replay's network model supplies) is not the program's compute
        self.spans.returned()

    def waited(self, ref: tuple, t0: float | None, t1: float | None) -> None:
        self.spans.waited(t0, t1)

    def _span(self, code: str) -> None:
        self.spans.lap(code)

    def note_unit_start(self) -> None:
        if self._unit_start is None:
            self._unit_start = time.monotonic() - self._t0

    def marker(self, name: str) -> None:
        self._span("m")
        if name == "step":
            self.spans.step()
            self._flush_checks()
            now = time.monotonic() - self._t0
            start = self.stats.steps[-1]["t"] if self.stats.steps else (self._unit_start or 0.0)
            self.stats.steps.append({"unit": self.unit, "t": now, "duration_s": now - start})
            self.unit += 1

    def close(self) -> None:
        left: tuple[int, int | None] = (0, None)
        try:
            if self.device_path is not None:
                try:
                    self._flush_checks()
                finally:
                    left = self.device_path.close()
        finally:
            self._stop_helpers()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
        self._write_summary()
        if left[0] and sys.exc_info()[0] is None:  # not while the program's own error propagates
            raise DivergenceError(
                f"sandbox rank {self.rank} ended with {left[0]} op(s) of the trace never entered (next: op "
                f"#{left[1]}); its program diverged from the trace (capture again with mode=capture)")

    def _stop_helpers(self) -> None:
        """End every thread this rank started before Python finalizes (``nccl_ext/core/threads.py``)."""
        workers, self._ring_workers = list(self._ring_workers.values()), {}
        deadline = time.monotonic() + self.timeout_s
        # a ring worker ends within ms once its last job completed an op; one still running
        # has an op the program never waited for
        stuck = [w.name for w in workers if not w.close(max(0.0, min(GRACE_S, deadline - time.monotonic())))]
        stuck += self._helpers.stop(max(0.0, deadline - time.monotonic()))
        self._workers_closed += len(workers)
        self.stats.helper_threads = self._helpers.started + self._workers_closed
        self.stats.in_flight_at_close += stuck
        if stuck:
            print(f"prism: rank {self.rank}: {len(stuck)} op thread(s) still running when the rank ended (ops never "
                  f"waited for, or failed): {'; '.join(stuck[:4])}", file=sys.stderr, flush=True)

    def _write_summary(self) -> None:
        if self.summary_path is None:
            return
        write_summary(self.summary_path, self.rank, self.stats,
                      ring_groups=self.rings.created if self.rings is not None else 0, spans=self.spans.rows(self.rank),
                      memory=self.memory,
                      prefetch=self.device_path.stats.as_dict() if self.device_path is not None else None)
        self.summary_path = None


def _host(t: torch.Tensor) -> torch.Tensor:
    """A live contribution where the recorded ones live (host memory), for folding with them."""
    t = t.detach()
    return t if t.device.type == "cpu" else t.cpu()
