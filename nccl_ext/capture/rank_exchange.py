"""A captured rank's side of the shared-memory exchange (:mod:`nccl_ext.exchange.arena`): staging its
contributions and sends (on its GPU where it can, :mod:`nccl_ext.exchange.ipc`; else in its host
arena), computing its results from its peers' staged pieces (on its GPU, :mod:`nccl_ext.exchange.device_reduce`,
or on the host), reading results the coordinator staged, and telling the coordinator what it has read."""

from __future__ import annotations

import time

import torch

from nccl_ext.capture.deferred_waits import DeferredWaits
from nccl_ext.capture.pending_ops import PendingOps
from nccl_ext.capture.progress import RankProgress
from nccl_ext.exchange.arena import PIN_COUNTS, Arena, PeerViews, detached
from nccl_ext.exchange.device_reduce import DeviceFold, gpu_results
from nccl_ext.exchange.ipc import GpuExchange, is_device_location, start_gpu_exchange
from nccl_ext.core.protocol import XColl, XRead
from nccl_ext.core.replica_sums import fold_into, shard_indices, weighted_sum
from nccl_ext.core.groups import GroupInfo
from nccl_ext.core.ops import Collective, compute
from nccl_ext.core.pending import Pending
from nccl_ext.core.call import CollectiveCall
from nccl_ext.core.results import raw
from nccl_ext.core.wire import untracked_empty


class RankExchange:
    """A captured rank's exchange. Given where the rank stands (``progress``), the exchange's
    ``directory``, the trace's ``scope`` (the sandbox ranks, None: every rank), the bytes of its
    GPU exchange (``gpu_bytes``; 0: none), the rank's ops in flight (``pending``), ``send`` to its
    coordinator, its compute clock's ``span()``, its deferred ``waits`` and its ``busy_s``."""

    def __init__(self, progress: RankProgress, directory: str, scope: frozenset[int] | None, gpu_bytes: int,
                 pending: PendingOps, send, span, waits: DeferredWaits, busy_s: dict) -> None:
        self._progress = progress
        self.rank = progress.rank
        self._exchange = directory
        self._scope = scope
        self._gpu_bytes = gpu_bytes
        self._pending = pending
        self._send = send
        self._span = span
        self._waits = waits
        self.busy_s = busy_s
        self._arena: Arena | None = None
        self._peers: PeerViews | None = None
        self._xops: dict[int, tuple] = {}
        """op id -> (kind, reduce, root, group rank) of an exchanged collective in flight."""
        self._xtargets: dict[int, list] = {}
        """op id -> the caller's tensors a folded exchanged reduction writes (:meth:`_compute_folded`)."""
        self._fold_scratch: torch.Tensor | None = None
        self._kept: dict[int, tuple] = {}
        """op id -> (location, arena token) of this rank's kept result of a folded op (:meth:`_keep_result`)."""
        self._regions: dict[int, tuple] = {}
        """op id -> the arena region its contribution occupies until every member has read it."""
        self._device_fold: DeviceFold | None = None
        """Exchanged results computed on this rank's GPU (:mod:`nccl_ext.exchange.device_reduce`)."""
        self._gpu: GpuExchange | None = None
        """Contributions and sends staged on this rank's GPU (:mod:`nccl_ext.exchange.ipc`), or None."""
        self._recv_on: dict[int, torch.device] = {}
        """op id -> the GPU of a pending recv's tensor (its staged send is copied straight there)."""
        self._recv_issue: dict[int, tuple] = {}
        """op id -> (event, program stream) of a pending recv whose result the GPU exchange writes."""
        self._x_sent: dict[int, float] = {}
        self.exchanged_ops = 0
        """Collectives among captured ranks only, computed by their members (:meth:`exchanged`)."""
        self.folded_exchanged_ops = 0

    @property
    def unit(self) -> int:
        return self._progress.unit

    @property
    def arena(self) -> Arena | None:
        """This rank's host arena (None until first used)."""
        return self._arena

    # -- what the transport asks of it ----------------------------------------------------------
    def start_on_device(self, device: torch.device) -> None:
        """The rank's first GPU op: its device fold, and its GPU exchange where it has one (with
        the waits' flags on the fold's stream)."""
        self._device_fold = DeviceFold(device)
        if self._gpu_bytes > 0:
            self._gpu = start_gpu_exchange(self._exchange, self.rank, self._device_fold, self._gpu_bytes,
                                           self._xread, self._scope)
            if self._gpu is not None:
                self._waits.start_flags(self._gpu.device, self._gpu.fold.stream)

    def put(self, tensors: list) -> tuple:
        """Stage ``tensors`` in the host arena: ``(gen, descs, region)``."""
        return self.open()[0].put(tensors)

    def hold(self, op_id: int, region) -> None:
        """Op ``op_id``'s staged ``region`` (or list of them) is freed when the coordinator says (``xfree``)."""
        self._regions[op_id] = region

    def stage_send(self, op_id: int, tensor: torch.Tensor, dst: int) -> tuple:
        """A send staged for its receiver to read (on the GPU where the tensor is on the GPU
        exchange's device); returns its location."""
        self.open()
        t0 = time.perf_counter()
        gpu = self._gpu if self._gpu is not None and tensor.device == self._gpu.device else None
        location = self._stage(op_id, [tensor], gpu, (self.rank, dst))
        self.busy_s["stage"] += time.perf_counter() - t0
        return location

    def expect_recv(self, op_id: int, p: Pending, like: torch.Tensor, src: int) -> None:
        """A receive into ``like``: on a GPU, its staged send is copied straight there (by the GPU
        exchange where ``like`` is on its device)."""
        if like.is_cuda:
            self._recv_on[op_id] = like.device
            if self._gpu is not None and like.device == self._gpu.device:
                self._gpu.peers.meet((src,))
                self._recv_issue[op_id] = (self._gpu.issued(), torch.cuda.current_stream(like.device))
                self._waits.gpu_op(op_id, p, deferrable=False)

    def forget_recv(self, op_id: int) -> None:
        """Op ``op_id`` was answered through the coordinator."""
        self._recv_on.pop(op_id, None)

    def answered(self, op_id: int, locations: list, t: float, parts: list | None, alive: float) -> None:
        """``xok``: every member's contribution is staged (the coordinator saw the last at ``t``;
        this rank's reader heard it at ``alive``)."""
        sent = self._x_sent.pop(op_id, None)
        if sent is not None:
            self.busy_s["x_until_complete"] += max(0.0, t - sent)
            self.busy_s["x_to_reader"] += max(0.0, alive - t)
        self._compute_exchanged(op_id, locations, parts)

    def free(self, op_id: int) -> None:
        """``xfree``: every reader is done with op ``op_id``'s regions."""
        region = self._regions.pop(op_id, None)
        kept = self._kept.pop(op_id, None)
        if kept is not None:
            self._arena.free(kept[1])
        if region is not None and region[0] == "gpu":
            self._gpu.free(region[1], self._arena)
        elif region is not None and self._arena is not None:
            for r in region if isinstance(region, list) else [region]:
                self._arena.free(r)

    def close_gpu(self, timeout_s: float) -> None:
        """The reads of ops whose folds are still running on the GPU."""
        if self._gpu is not None:
            self._gpu.close(timeout_s)

    def stats(self) -> dict:
        """The exchange's counters for the rank's ``stats`` at its close."""
        folds = self._device_fold
        return {"device_folds": folds.device_ops if folds else 0,
                "host_folds": folds.host_ops if folds else 0,
                "pinned_maps": PIN_COUNTS["pinned"], "pin_refused": PIN_COUNTS["refused"],
                "left_pageable": ((self._peers.left_pageable if self._peers else 0)
                                  + (self._arena.left_pageable if self._arena else 0)),
                "exchanged_ops": self.exchanged_ops,
                "folded_exchanged_ops": self.folded_exchanged_ops,
                "gpu_staged": self._gpu.ops if self._gpu else 0,
                "gpu_full": self._gpu.arena.full if self._gpu else 0,
                "peers_opened_late": self._gpu.peers.opened_late if self._gpu else 0,
                "fold_finish": round(folds.finish_s, 3) if folds else 0.0}

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._peers.close()

    # -- the exchange's own work ------------------------------------------------------------------

    def receive_result(self, op_id: int, location) -> None:
        """The coordinator staged this rank's result of op ``op_id``: copied from there into the
        program's tensors, then the coordinator may free it (``xread``)."""
        p = self._pending.pop(op_id)
        t0 = time.perf_counter()
        try:
            if p is not None:
                p.after_apply = _results_are_views
                p.complete(self.open()[1].views(location))
        except BaseException as e:  # noqa: BLE001 - the op fails, the program hears it at its wait
            if p is not None:
                p.fail(RuntimeError(f"{p.what}: reading the staged result failed: {e}"))
        finally:
            self.busy_s["apply"] += time.perf_counter() - t0
            self._send(XRead(op_id, None))

    def exchanged(self, group: GroupInfo, seq: int, call: CollectiveCall, what: str, folded: bool = False) -> Pending:
        """A collective among captured ranks only: the contribution is staged in this rank's arena,
        the coordinator gets where it lies, and once every member has staged its own this rank
        computes its result from their pieces (:meth:`_compute_exchanged`). ``folded``: a folded
        group's weighted reduction (:func:`nccl_ext.core.replica_sums.exchangeable`), computed from its
        captured members' pieces into the caller's tensors (:meth:`_compute_folded`)."""
        op_id, p = self._pending.new(what)
        t, wall, cpu = self._span()
        self.open()
        device = next((x.device for x in (*(call.tensors or ()), *(call.outputs or ()), *(call.standin or ()))
                       if x.is_cuda), None)
        gpu = self._gpu if self._gpu is not None and device == self._gpu.device else None
        if gpu is not None:
            gpu.peers.meet(r for r in group.ranks if r != self.rank)
        location = None
        if call.tensors is not None:
            t0 = time.perf_counter()
            # a folded group's op: the trace reads only a sandbox member's own data of it
            location = self._stage(op_id, list(call.tensors), gpu, (self.rank,) if folded else group.ranks)
            self.busy_s["stage"] += time.perf_counter() - t0
        issue = (gpu.issued(), torch.cuda.current_stream(device)) if gpu is not None else None
        if issue is not None:
            self._waits.gpu_op(op_id, p)
        self._xops[op_id] = (call.kind, call.reduce, call.root, group.group_rank(self.rank), call.tensors, device, issue)
        if folded:
            self.folded_exchanged_ops += 1
            self._xtargets[op_id] = list(call.outputs if call.kind is Collective.REDUCE_SCATTER else call.tensors)
        self._x_sent[op_id] = time.monotonic()
        self.exchanged_ops += 1
        self._send(XColl(op_id, group.key, seq, call.api, str(call.kind),
                         None if call.reduce is None else str(call.reduce), call.root, call.tensors is not None,
                         self.unit, t, wall, cpu, location))
        return p

    def _stage(self, op_id: int, tensors: list[torch.Tensor], gpu: GpuExchange | None, ranks) -> tuple:
        """Stage a contribution or send: on the GPU where it can (with a host copy where the
        trace reads it: an op among ``ranks`` with a sandbox rank), else in the host arena;
        returns its location."""
        if gpu is not None and gpu.fits(tensors):
            staged = gpu.stage(tensors, self._arena if gpu.needs_host(ranks) else None)
            if staged is not None:
                location, token = staged
                self._regions[op_id] = ("gpu", token)
                return location
        gen, descs, self._regions[op_id] = self._arena.put(tensors)
        return gen, descs

    def _compute_exchanged(self, op_id: int, locations: list, parts: list | None = None) -> None:
        """Every member's contribution is staged: fold them (group-rank order, as the coordinator
        would), tell the coordinator this rank has read them, complete the op (``parts``: a
        folded group's, :meth:`_compute_folded`)."""
        if parts is not None:
            self._compute_folded(op_id, locations, parts)
            return
        kind, reduce, root, me, own, device, issue = self._xops.pop(op_id)
        if issue is not None:
            gpu = self._gpu

            def results() -> list:
                views = [list(own) if g == me and own is not None else gpu.views(loc, self._peers.views)
                         for g, loc in enumerate(locations)]
                return gpu_results(gpu.fold, kind, views, me, reduce, root)

            self._waits.await_staging(op_id)
            gpu.when_staged([loc for g, loc in enumerate(locations) if g != me],
                            lambda: self._waits.in_order(op_id, lambda: self._complete_on_gpu(op_id, issue, results)),
                            gated=self._waits.deferring)
            return
        on_device = self._fold_on(device)

        def read() -> list:
            _host_only(locations)
            views = [self._peers.views(loc) for loc in locations]
            if on_device is not None:
                if own is not None:
                    views[me] = list(own)  # already on the device, unchanged until the op completes
                with torch.cuda.stream(on_device.stream):
                    out = on_device.results(kind, views, me, reduce=reduce, root=root)
                if out is not None:
                    return out
                views = [self._peers.views(loc) for loc in locations]
            out = compute(kind, views, reduce=reduce, root=root)[me]
            if kind not in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER):
                out = [detached(x) for x in out]  # pieces of the peers' regions, which are about to be freed
            return out

        self._read_staged(op_id, read, "reading the peers' contributions", on_device)

    def _compute_folded(self, op_id: int, locations: list, parts: list) -> None:
        """A folded group's weighted reduction: this rank's result is the sum of ``parts``
        (``(group rank, factor)``: its captured members' staged contributions, each stand-in's
        scaled by how many members it stands in for) with the coordinator's arithmetic
        (:mod:`nccl_ext.core.replica_sums`), written into the caller's tensors — on the GPU's fold stream
        where the pieces were staged there, else on the host."""
        kind, reduce, _root, me, _own, device, issue = self._xops.pop(op_id)
        targets = self._xtargets.pop(op_id)
        n = len(locations)
        used = sorted({g for g, _ in parts})
        if issue is not None:
            gpu = self._gpu

            def pieces(g: int) -> list:
                loc = locations[g]
                if g != me:
                    return gpu.views(loc, self._peers.views)
                # its own staged copy (the caller's tensors are about to be written)
                return gpu.own_views(loc[2]) if is_device_location(loc) else self._peers.views(loc)

            def results() -> list:
                got = {g: pieces(g) for g in used}
                out = _fold_targets(kind, reduce, n, me, parts, got, targets, gpu.fold.buf)
                self._keep_result(op_id, out)  # on the fold's stream, before its done event
                return out

            self._waits.await_staging(op_id)
            gpu.when_staged([loc for g, loc in enumerate(locations) if g != me and g in used],
                            lambda: self._waits.in_order(op_id, lambda: self._complete_on_gpu(op_id, issue, results)),
                            gated=self._waits.deferring)
            return

        def read() -> list:
            _host_only(locations)
            got = {g: self._peers.views(locations[g]) for g in used}
            if all(t.device.type == "cpu" for t in targets):
                out = _fold_targets(kind, reduce, n, me, parts, got, targets, self._host_fold_scratch())
            else:  # a GPU rank without the GPU exchange: its results go back from the host
                first = got[parts[0][0]]
                out = [weighted_sum([(got[g][i], k) for g, k in parts], reduce, n)
                       for i in shard_indices(kind, len(first), n, me)]
            self._keep_result(op_id, out)
            return out

        self._read_staged(op_id, read, "summing the folded group's staged contributions")

    def _keep_result(self, op_id: int, out: list) -> None:
        """Where the trace keeps this rank's result of a folded group's op (a sandbox rank's; every
        rank's in a full trace) — replay cannot recompute it —, stage it in the host arena: the
        coordinator records these bits, the ones the program got, from where ``xread`` says they
        lie (from the GPU: copied on the fold's stream, complete once ``xread`` is sent)."""
        if self._scope is not None and self.rank not in self._scope:
            return
        gen, descs, token = self.open()[0].put(list(out), non_blocking=True)
        self._kept[op_id] = ((gen, descs), token)

    def _xread(self, op_id: int) -> None:
        """Tell the coordinator this rank has read op ``op_id``'s staged data (with where its kept
        result lies, :meth:`_keep_result`)."""
        kept = self._kept.get(op_id)
        self._send(XRead(op_id, None if kept is None else kept[0]))

    def _host_fold_scratch(self) -> torch.Tensor:
        if self._fold_scratch is None:
            self._fold_scratch = untracked_empty((FOLD_SCRATCH_BYTES,), torch.uint8)
        return self._fold_scratch

    def _complete_on_gpu(self, op_id: int, issue: tuple, results) -> None:
        """Complete op ``op_id`` through the GPU exchange (``issue``: the event and program stream
        of its issue; ``results()``: its views and fold, on the fold's stream)."""
        p = self._pending.pop(op_id)
        t0 = time.perf_counter()
        self._gpu.complete(p, op_id, issue[0], issue[1], results, self._waits.flag_writer(op_id))
        dt = time.perf_counter() - t0
        self.busy_s["exchange_compute"] += dt
        self.busy_s["x_complete_max"] = max(self.busy_s.get("x_complete_max", 0.0), dt)

    def _fold_on(self, device: torch.device | None) -> DeviceFold | None:
        """The device fold for results on ``device`` (None: on the host)."""
        f = self._device_fold
        return f if f is not None and device is not None and device == f.device else None

    def receive_exchanged(self, op_id: int, location) -> None:
        """A send staged in the sender's arena: this rank's copy of it, then the region may go."""
        device = self._recv_on.pop(op_id, None)
        issue = self._recv_issue.pop(op_id, None)
        if issue is not None:
            gpu = self._gpu
            self._waits.await_staging(op_id)
            gpu.when_staged([location], lambda: self._waits.in_order(op_id, lambda: self._complete_on_gpu(
                op_id, issue, lambda: gpu_results(gpu.fold, Collective.BROADCAST,
                                                  [gpu.views(location, self._peers.views)], 0, None, 0))),
                            gated=self._waits.deferring)
            return
        on_device = self._fold_on(device)

        def read() -> list:
            _host_only([location])
            views = self.open()[1].views(location)
            if on_device is not None:
                with torch.cuda.stream(on_device.stream):
                    out = on_device.results(Collective.BROADCAST, [views], 0, root=0)
                if out is not None:
                    return out
            return [detached(x) for x in views]

        self._read_staged(op_id, read, "reading the sender's staged tensor", on_device)

    def _read_staged(self, op_id: int, read, what: str, on_device: DeviceFold | None = None) -> None:
        """Complete op ``op_id`` with ``read()`` (or fail it with why), then tell the coordinator
        this rank is done with the staged regions (``xread``). Results on the device are written
        into the program's tensors on the fold's stream, which is waited for before the program
        is woken (:attr:`Pending.after_apply`)."""
        p = self._pending.pop(op_id)
        t0 = time.perf_counter()
        try:
            out = read()
            self.busy_s["exchange_compute"] += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - the op fails, the program hears it at its wait
            if on_device is not None:
                try:  # copies already issued read the regions until the stream is done
                    on_device.finish()
                except BaseException:  # noqa: BLE001 - the op's own error is the one to report
                    pass
            self._xread(op_id)
            if p is not None:
                p.fail(RuntimeError(f"{p.what}: {what} failed: {e}"))
            return
        t0 = time.perf_counter()
        if on_device is not None and out and out[0].is_cuda:
            # the copies from the staged regions are done once the fold's stream is: then they may go
            try:
                if p is not None:
                    p.after_apply = on_device.finish
                    p.apply_stream = on_device.stream
                    with torch.cuda.stream(on_device.stream):
                        p.complete(out)
                else:
                    on_device.finish()
            finally:
                self._xread(op_id)
        else:
            self._xread(op_id)
            if p is not None:
                p.complete(out)
        self.busy_s["apply"] += time.perf_counter() - t0

    def open(self) -> tuple[Arena, PeerViews]:
        """This rank's arena and its views of the peers' (opened at first use)."""
        if self._arena is None:
            pinned = self._device_fold is not None  # copies to and from the GPU at the link's speed
            self._arena = Arena(self._exchange, self.rank, pin=pinned, pin_ok=self._waits.may_lock_pages,
                                unpin_ok=self._waits.may_unlock_pages)
            self._peers = PeerViews(self._exchange, pin=pinned, pin_ok=self._waits.may_lock_pages)
        return self._arena, self._peers


FOLD_SCRATCH_BYTES = 16 << 20
"""Slice buffer of a folded weighted reduction summed on the host (:func:`nccl_ext.core.replica_sums.fold_into`)."""


def _fold_targets(kind, reduce, n: int, me: int, parts: list, got: dict, targets: list, scratch) -> list:
    """Write member ``me``'s weighted sums into ``targets`` (the caller's tensors), one slice of
    ``scratch`` at a time; returns them (the process group sees they are its own: no copy)."""
    first = got[parts[0][0]]
    for target, i in zip(targets, shard_indices(kind, len(first), n, me), strict=True):
        out = raw(target) if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype,
                                                                     device=target.device)
        fold_into(out, [(got[g][i], k) for g, k in parts], reduce, n, scratch)
        if not target.is_contiguous():
            raw(target).copy_(out)
    return targets


def _results_are_views() -> None:
    """:attr:`Pending.after_apply` of a result read where the coordinator staged it: nothing to
    wait for, but a future's consumer gets copies (the region is freed after the op)."""


def _host_only(locations) -> None:
    """A rank without the GPU exchange reads host locations only."""
    for loc in locations:
        if is_device_location(loc):
            raise RuntimeError(f"rank {loc[0]} staged its data on its GPU, which this rank cannot read (its GPU "
                               "exchange did not start); capture with capture.gpu_exchange_mib=0")
