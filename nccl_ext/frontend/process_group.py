"""The prism process group: a ``torch.distributed.ProcessGroup`` subclass that torch uses
as the default group (and every subgroup) of the logical world.

Each torch-level op is turned into a :class:`CollectiveCall` — the caller's contribution
split into the pieces the semantics of :mod:`nccl_ext.core.ops` address — and handed to the
process's :class:`Transport` (capture: the coordinator computes it from all ranks'
contributions; emulation: the replay combines live sandbox and recorded virtual
contributions). Results are written back into the caller's output tensors.

Checked against torch 2.13 (CPU): torch dispatches the methods below to a Python
subclass, including the ``*_single`` spellings that replaced ``_allgather_base`` /
``_reduce_scatter_base`` and the coalesced variants megatron's DDP uses through
``_coalescing_manager``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from nccl_ext.core.call import CollectiveCall
from nccl_ext.core.groups import GroupInfo, GroupRegistry
from nccl_ext.core.ops import Collective, reduce_inputs
from nccl_ext.core.errors import CommDeadlineError, CommError, PeerClosedError, first_line
from nccl_ext.core.pending import LIMIT_KEY, Pending, short_ranks, timeout_seconds
from nccl_ext.core.results import copy_pieces, no_grad_copy, own_copies

MONITORED_BARRIER_TAG = 0x3FFF_FFF7
"""The point-to-point tag of :meth:`PrismProcessGroup.monitored_barrier`'s messages (kept apart
from the program's tags, so its sequence numbers are untouched)."""


class Transport(Protocol):
    """Moves one rank's ops to wherever their results are computed."""

    timeout_s: float

    def register_group(self, group: GroupInfo) -> None: ...

    def collective(self, group: GroupInfo, seq: int, call: CollectiveCall) -> Pending: ...

    def send(self, group: GroupInfo, dst: int, tag: int, seq: int, tensor: torch.Tensor) -> Pending: ...

    def recv(self, group: GroupInfo, src: int, tag: int, seq: int, like: torch.Tensor) -> Pending: ...

    def marker(self, name: str) -> None: ...

    def waited(self, ref: tuple, t0: float | None, t1: float | None) -> None:
        """The rank waited on op ``ref`` from ``t0`` to ``t1`` (None: it was already done)."""
        ...

    def returned(self) -> None:
        """An op call is about to return to the program: its handling (from the event recorded at
        its entry to here) is the op's time, not the program's compute (optional)."""
        ...

    def park(self, pending: Pending) -> Callable[[], None] | None:
        """The rank is about to block on ``pending``; returns what to call once it is done
        (before the program continues), or None. Capture's context switching hands the
        rank's execution slot back here and waits for a new one on resume."""
        ...

    def report_memory(self, summary: dict) -> None:
        """The rank's memory accounting at the end of its program."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class PrismWorld:
    """Per-process state shared by every prism group of one logical rank."""

    rank: int
    world_size: int
    transport: Transport
    backend_name: str = "gloo"
    """What ``dist.get_backend()`` reports: the physical backend the script asked for."""
    delegates_new_group: bool = True
    """Groups take ``dist.new_group`` calls handed to the default group (torch >= 2.13:
    :class:`DelegatingPrismProcessGroup`); False: plain :class:`PrismProcessGroup`, torch creates
    subgroups through ``_new_process_group_helper`` (which ``install`` intercepts then)."""
    registry: GroupRegistry = field(init=False)
    ops_issued: int = 0
    """Communication ops this rank has issued (all groups)."""

    def step_boundary(self) -> bool:
        """Mark a scheduling-unit boundary (once per iteration: :func:`nccl_ext.frontend.install.install_step_marker`).
        Returns whether a boundary was marked."""
        self.transport.marker("step")
        return True

    def __post_init__(self) -> None:
        self.registry = GroupRegistry(self.rank, self.world_size)

    def make_group(self, ranks, desc: str = "", name: str = "") -> PrismProcessGroup | None:
        """The caller's group of ``ranks`` (global ranks in group-rank order, any sequence of
        ints), ``None`` when the caller is not a member."""
        observe = getattr(self.transport, "observe_group", None)
        if observe is not None:  # group discovery sees every new_group call, members or not
            observe(ranks, desc)
        info = self.registry.make(ranks, desc)
        if info is None:
            return None
        self.transport.register_group(info)
        cls = DelegatingPrismProcessGroup if self.delegates_new_group else PrismProcessGroup
        return cls(self, info, name=name)


class PrismProcessGroup(dist.ProcessGroup):
    """One communicator of the logical world as seen by one member."""

    def __init__(self, world: PrismWorld, info: GroupInfo, name: str = ""):
        super().__init__(info.group_rank(world.rank), info.size)
        self.world = world
        self.info = info
        self._name = name or info.key
        self._seq = 0
        self._p2p_seq: dict[tuple[str, int, int], int] = {}
        self._monitored = 0
        """monitored_barrier calls so far (their own sequence)."""
        self._lock = threading.Lock()

    # -- identity ---------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self.world.backend_name

    supports_coalescing = False  # a batch of point-to-point ops is issued op by op

    def _get_backend(self, device):  # torch 2.14's batch_isend_irecv asks any ProcessGroup (C++ knows none here)
        return self

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"PrismProcessGroup(rank={self.rank()}, size={self.size()}, key={self.info.key})"

    # -- plumbing -----------------------------------------------------------------------
    def _next_seq(self) -> int:
        with self._lock:
            seq = self._seq
            self._seq += 1
            return seq

    def _submit(self, call: CollectiveCall, apply, opts=None) -> dist.Work:
        seq = self._next_seq()
        self.world.ops_issued += 1
        pending = self._issue(f"{call.api} on group {self.info.desc or self.info.key} seq {seq}", call.api, seq,
                              self.world.transport.collective, self.info, seq, call)
        return PrismWork(pending, apply, self.world.transport, ("c", self.info.key, seq))

    def _issue(self, what: str, api: str, seq: int, op, *args) -> Pending:
        """``op(*args)``; an error of the backend below (gloo's, when a physical peer's connection is
        closed) is raised as a :class:`PeerClosedError`; the layer's own errors name the op already."""
        where = {"rank": self.world.rank, "group": self.info.desc or self.info.key, "op": api, "seq": seq}
        try:
            pending = op(*args)
        except RuntimeError as e:
            if isinstance(e, CommError) or type(e).__module__.partition(".")[0] == "nccl_ext":
                raise  # this layer's own error types name the op already
            raise PeerClosedError(f"rank {self.world.rank}: {what}: {first_line(e)} (a physical peer's process ended "
                                  "or closed its connection: see its log)", **where) from e
        pending.where = where  # its deadline and timeout errors carry them as fields
        return pending

    def _group_size(self) -> int:
        return self.info.size

    # -- collectives --------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        return self._all_reduce("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._all_reduce("allreduce_coalesced", tensors, opts)

    def _all_reduce(self, api, tensors, opts):
        red, inputs = reduce_inputs(opts, tensors)  # (PREMUL_SUM: SUM of premultiplied copies)

        def apply(res):
            for t, r in zip(tensors, res, strict=True):
                no_grad_copy(t, r, api)

        return self._submit(CollectiveCall(api, Collective.ALL_REDUCE, inputs, reduce=red), apply, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        mine = list(tensors) if self.rank() == root else None

        def apply(res):
            if self.rank() != root:
                for t, r in zip(tensors, res, strict=True):
                    no_grad_copy(t, r, "broadcast")

        call = CollectiveCall("broadcast", Collective.BROADCAST, mine, root=root,
                              standin=None if mine is not None else list(tensors))
        return self._submit(call, apply, opts)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank
        red, inputs = reduce_inputs(opts, tensors)

        def apply(res):
            if self.rank() == root:
                for t, r in zip(tensors, res, strict=True):
                    no_grad_copy(t, r, "reduce")

        return self._submit(CollectiveCall("reduce", Collective.REDUCE, inputs, reduce=red, root=root), apply, opts)

    def allgather(self, output_lists, input_list, opts=None):
        return self._all_gather_lists("allgather", output_lists, input_list, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._all_gather_lists("allgather_coalesced", output_lists, input_list, opts)

    def _all_gather_lists(self, api, output_lists, input_list, opts):
        n = self._group_size()

        def apply(res):
            for i, outs in enumerate(output_lists):
                for m, out in enumerate(outs):
                    no_grad_copy(out, res[i * n + m], api)

        return self._submit(CollectiveCall(api, Collective.ALL_GATHER, list(input_list)), apply, opts)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_tensors("all_gather_single", [output], [input], opts)

    def _allgather_base(self, output, input, opts=None):
        return self._all_gather_tensors("_allgather_base", [output], [input], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_tensors("all_gather_single_coalesced", outputs, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_tensors("allgather_into_tensor_coalesced", outputs, inputs, opts)

    def _all_gather_tensors(self, api, outputs, inputs, opts):
        n = self._group_size()

        def apply(res):
            for i, out in enumerate(outputs):
                copy_pieces(out, res[i * n : (i + 1) * n], api)

        return self._submit(CollectiveCall(api, Collective.ALL_GATHER, list(inputs)), apply, opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        n = self._group_size()
        pieces = []
        for lst in input_lists:
            if len(lst) != n:
                raise ValueError(f"reduce_scatter: expected {n} input tensors per output, got {len(lst)}")
            pieces.extend(lst)
        red, pieces = reduce_inputs(opts, pieces)

        def apply(res):
            for t, r in zip(outputs, res, strict=True):
                no_grad_copy(t, r, "reduce_scatter")

        return self._submit(CollectiveCall("reduce_scatter", Collective.REDUCE_SCATTER, pieces, reduce=red,
                                           outputs=list(outputs)), apply, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_tensors("reduce_scatter_single", [output], [input], opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._reduce_scatter_tensors("_reduce_scatter_base", [output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_tensors("reduce_scatter_single_coalesced", outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_tensors("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    def _reduce_scatter_tensors(self, api, outputs, inputs, opts):
        red, inputs = reduce_inputs(opts, inputs)
        n = self._group_size()
        pieces = []
        for out, inp in zip(outputs, inputs, strict=True):
            if inp.numel() != n * out.numel():
                raise ValueError(f"{api}: input has {inp.numel()} elements, expected {n} x {out.numel()}")
            pieces.extend(inp.reshape(-1).split(out.numel()))

        def apply(res):
            for t, r in zip(outputs, res, strict=True):
                no_grad_copy(t, r, api)

        return self._submit(CollectiveCall(api, Collective.REDUCE_SCATTER, pieces, reduce=red, outputs=list(outputs)),
                            apply, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._all_to_all_single("all_to_all_single", output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._all_to_all_single("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts)

    def _all_to_all_single(self, api, output, input, out_splits, in_splits, opts):
        n = self._group_size()
        in_splits = [int(s) for s in in_splits] if len(in_splits) else [input.shape[0] // n] * n
        pieces = list(input.split(in_splits, dim=0)) if input.dim() else [input]
        out_splits = [int(s) for s in out_splits] if len(out_splits) else [output.shape[0] // n] * n
        outs = list(output.split(out_splits, dim=0)) if output.dim() and output.is_contiguous() else None

        def apply(res):
            copy_pieces(output, res, api)

        return self._submit(CollectiveCall(api, Collective.ALL_TO_ALL, pieces, outputs=outs), apply, opts)

    def alltoall(self, outputs, inputs, opts=None):
        def apply(res):
            for t, r in zip(outputs, res, strict=True):
                no_grad_copy(t, r, "alltoall")

        return self._submit(CollectiveCall("alltoall", Collective.ALL_TO_ALL, list(inputs), outputs=list(outputs)),
                            apply, opts)

    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank

        def apply(res):
            if self.rank() == root:
                for out, r in zip(output_lists[0], res, strict=True):
                    no_grad_copy(out, r, "gather")

        return self._submit(CollectiveCall("gather", Collective.GATHER, [inputs[0]], root=root), apply, opts)

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank
        mine = list(input_lists[0]) if self.rank() == root else None

        def apply(res):
            no_grad_copy(outputs[0], res[0], "scatter")

        return self._submit(CollectiveCall("scatter", Collective.SCATTER, mine, root=root, outputs=[outputs[0]]),
                            apply, opts)

    def barrier(self, opts=None):
        return self._submit(CollectiveCall("barrier", Collective.BARRIER, None), None, None)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's semantics (``distributed_c10d.monitored_barrier``, checked against torch
        2.13, as gloo implements it): every other member sends to group rank 0 and waits for
        its answer; group rank 0 waits for each member within ``timeout`` (None: the op
        deadline, ``comm.timeout_s``) and raises naming the ranks that did not arrive (the
        first one, or all with ``wait_all_ranks``), else releases them. Built on this group's
        point-to-point ops under a tag of its own, so capture records it and replay serves the
        virtual members' messages with their recorded lateness like any other transfer."""
        limit = timeout_seconds(timeout) or self.world.transport.timeout_s
        deadline = time.monotonic() + limit
        me, n = self.rank(), self.size()
        with self._lock:
            seq, self._monitored = self._monitored, self._monitored + 1
        label = (f"rank {self.world.rank}: monitored_barrier seq {seq} on group {self.info.desc or self.info.key} "
                 f"(ranks {short_ranks(self.info.ranks)})")
        where = dict(rank=self.world.rank, group=self.info.desc or self.info.key, op="monitored_barrier", seq=seq)

        def left() -> float:
            return max(deadline - time.monotonic(), 1e-3)

        if me != 0:
            self.send([torch.zeros(1)], 0, MONITORED_BARRIER_TAG).wait(left())
            try:
                self.recv([torch.zeros(1)], 0, MONITORED_BARRIER_TAG).wait(left())
            except CommDeadlineError as e:
                raise CommDeadlineError(
                    f"{label}: this rank arrived, but group rank 0 (rank {self.info.ranks[0]}) did not release it "
                    f"within {limit:g} s; rank 0's error names the ranks that failed to arrive", **where) from e
            return
        works = [(m, self.recv([torch.zeros(1)], m, MONITORED_BARRIER_TAG)) for m in range(1, n)]
        failed = []
        for m, work in works:
            try:
                work.wait(left())
            except CommDeadlineError:
                failed.append(self.info.ranks[m])
                if not wait_all_ranks:
                    break
        if failed:
            raise CommDeadlineError(
                f"{label}: ranks {short_ranks(failed)} failed to pass monitored_barrier within {limit:g} s"
                f"{'' if wait_all_ranks else ' (the first found; wait_all_ranks=True lists all)'} "
                f"(its timeout=, or {LIMIT_KEY} when none is given)", **where)
        for m in range(1, n):
            self.send([torch.zeros(1)], m, MONITORED_BARRIER_TAG).wait(left())

    # -- point to point -----------------------------------------------------------------
    def _p2p_seq_next(self, direction: str, peer: int, tag: int) -> int:
        with self._lock:
            key = (direction, peer, tag)
            seq = self._p2p_seq.get(key, 0)
            self._p2p_seq[key] = seq + 1
            return seq

    def send(self, tensors, dst, tag=0):
        (tensor,) = tensors
        seq = self._p2p_seq_next("send", dst, tag)
        self.world.ops_issued += 1
        pending = self._issue(f"send seq {seq} to rank {self.info.ranks[dst]} tag {tag} on group "
                              f"{self.info.desc or self.info.key}", "send", seq, self.world.transport.send, self.info,
                              self.info.ranks[dst], tag, seq, tensor)
        return PrismWork(pending, None, self.world.transport, ("s", self.info.key, self.info.ranks[dst], tag, seq))

    def recv(self, tensors, src, tag=0):
        (tensor,) = tensors
        seq = self._p2p_seq_next("recv", src, tag)
        self.world.ops_issued += 1
        pending = self._issue(f"recv seq {seq} from rank {self.info.ranks[src]} tag {tag} on group "
                              f"{self.info.desc or self.info.key}", "recv", seq, self.world.transport.recv, self.info,
                              self.info.ranks[src], tag, seq, tensor)

        def apply(res):
            no_grad_copy(tensor, res[0], "recv")

        return PrismWork(pending, apply, self.world.transport, ("r", self.info.key, self.info.ranks[src], tag, seq))

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError(
            "recv from any source is not supported by the prism process group: "
            "replay needs to know each message's sender; pass src= to recv"
        )


class DelegatingPrismProcessGroup(PrismProcessGroup):
    """A prism group with the ``new_group`` method torch >= 2.13 hands ``dist.new_group`` to when
    it is the default group (``hasattr(default_pg, "new_group")``): subgroups become prism groups
    without torch's own group creation. Without it (:class:`PrismProcessGroup`) torch takes the
    path older versions take."""

    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None, **_):
        """torch >= 2.13 delegates ``dist.new_group`` here when this is the default group."""
        ranks = range(self.world.world_size) if ranks is None else ranks  # torch's sorted list
        return self.world.make_group(ranks, desc=group_desc or "", name=group_name or "")


class PrismWork(dist.Work):
    """The handle of one op. Results are written into the caller's tensors as soon as they
    arrive (as a real backend's kernels would, whether or not anyone waits); ``wait``
    blocks until then — bounded by the op's deadline — and tells the transport where the
    rank blocked, so the trace knows which waits overlapped with compute.

    Checked against torch 2.13: torch calls a Python ``Work`` subclass's ``wait`` for sync
    and async ops alike.
    """

    def __init__(self, pending: Pending, apply, transport: Transport, ref: tuple):
        super().__init__()
        self._pending = pending
        self._ref = ref
        self._transport = transport
        self._applied = threading.Event()
        self._error: BaseException | None = None
        self._deferred = False
        """The caller's wait returned with its stream waiting for the op on the GPU."""
        self._value = None
        self._fut: torch.futures.Future | None = None
        self._lock = threading.Lock()

        self._apply = apply

        def on_done(p: Pending) -> None:
            try:
                value = p.result()
                apply_fn, self._apply = self._apply, None
                with torch.cuda.stream(p.apply_stream) if p.apply_stream is not None else nullcontext():
                    try:
                        if apply_fn is not None:
                            apply_fn(value)
                        # drop every reference to the caller's tensors before waking the caller, so
                        # they are freed when the program drops them (as with a real backend)
                        del apply_fn
                        with self._lock:
                            if self._fut is not None:  # only a future's consumer still needs the tensors
                                self._value = value if p.after_apply is None else own_copies(value)
                    finally:  # the transport's stream is waited for (its regions released) even when applying failed
                        if p.after_apply is not None:
                            p.after_apply()
                p.release()
                del value
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e
                if self._deferred:  # the caller went on past its wait: its next op raises this
                    self._transport.deferred_failed(p, e)
            self._applied.set()
            with self._lock:
                fut = self._fut
            if fut is not None:
                self._settle(fut)

        pending.add_done_callback(on_done)
        returned = getattr(transport, "returned", None)
        if returned is not None:
            returned()

    def _settle(self, fut: torch.futures.Future) -> None:
        if fut.done():
            return
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._value)

    def wait(self, timeout=None) -> bool:
        """Block until the results are in the caller's tensors: at most ``timeout`` (a
        ``timedelta`` or seconds; None or zero — torch's ``kNoTimeout`` — the op's own deadline,
        ``comm.timeout_s``), then raise :class:`CommDeadlineError` naming rank, group, op and
        sequence number. A caller's timeout leaves the op outstanding, as torch's does.

        What ``timeout`` bounds is the op: its completion and the writing of its results into
        the caller's tensors, both within it on the caller's clock. In capture, a rank parked
        while it waited (its compute slot lent to another rank) then waits for a slot again
        before it returns: that time is the emulation's sharing of GPUs, not the op's — the
        emulated rank has a GPU of its own and would not wait at all — so it does not count
        against ``timeout`` (a ``monitored_barrier(timeout=5)`` does not fail because other
        ranks held the slots); the transport bounds it (``comm.timeout_s``, renewed only while
        the coordinator says the rank is queued)."""
        defer = self._pending.defer
        if not self._applied.is_set() and defer is not None and timeout_seconds(timeout) is None and defer():
            # the caller's stream waits for the op on the GPU (as NCCL's wait); a failure from
            # here on is raised by the transport's next op
            self._deferred = True
            self._transport.waited(self._ref, None, None)
            if self._error is not None:
                raise self._error
            return True
        if not self._applied.is_set():
            limit = timeout_seconds(timeout)
            t0 = time.monotonic()
            resume = self._transport.park(self._pending)
            if not self._pending.wait(limit):
                # capture: the rank runs on without a slot; its error ends the program anyway
                raise self._pending.timeout_error(limit)
            self._pending.result()  # raises past the op's deadline
            self._await_applied(limit, t0)
            if resume is not None:
                resume()
            self._transport.waited(self._ref, t0, time.monotonic())
        else:
            self._transport.waited(self._ref, None, None)
        if self._error is not None:
            raise self._error
        done = self._pending.device_done
        if done is not None:  # as NCCL's wait: the caller's current stream waits for the op on the GPU
            torch.cuda.current_stream().wait_event(done)
        return True

    def _await_applied(self, limit: float | None, t0: float) -> None:
        """The result arrived: wait until it is in the caller's tensors, within what is left of
        the caller's ``limit`` (None: until the op's deadline, and at least a second — the
        result came just before it)."""
        p = self._pending
        if limit is not None:
            if not self._applied.wait(max(0.0, t0 + limit - time.monotonic())):
                raise CommDeadlineError(
                    f"timed out: {p.what}: its result arrived, but writing it into the caller's tensors did not end "
                    f"within the caller's timeout of {limit:g} s (Work.wait(timeout=)); the op's own deadline is "
                    f"{LIMIT_KEY}={p.timeout_s:g}", **p.where)
            return
        bound = max(p.deadline - time.monotonic(), 1.0)
        if not self._applied.wait(bound):
            raise CommDeadlineError(
                f"deadline exceeded: {p.what}: its result arrived, but writing it into the caller's tensors did not "
                f"end by the op's deadline ({bound:.1f} s more) ({LIMIT_KEY}={p.timeout_s:g}; raise it with "
                f"{LIMIT_KEY}= if the copy is only slow)", **p.where)

    def is_completed(self) -> bool:
        return self._applied.is_set()

    def is_success(self) -> bool:
        return self._applied.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        """The output tensors are the caller's own (written in place); nothing else is kept."""
        self.wait()
        return self._value if isinstance(self._value, list) else []

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
            fut = self._fut
        if self._applied.is_set():
            self._settle(fut)
        return fut

    def synchronize(self) -> None:
        self.wait()
