"""Exchanged collectives whose tensors stay on the GPU: CUDA IPC between captured ranks.

A captured rank on a GPU stages its contribution to an exchanged collective (or a send) in a
buffer of its own on that GPU (:class:`DeviceArena`, outside the program's memory figures),
shared with its peers by CUDA IPC — torch's own sharing of CUDA tensors between processes —
and records an interprocess CUDA event after the copy, on the stream the program computed the
contribution on. The location it sends to the coordinator names the region and the event.
A peer's fold stream waits for that event (a wait on the GPU: no CPU thread blocks), reads the
region there, folds and writes the result into the program's tensors; the program's stream
then waits for the fold (:meth:`GpuExchange.complete`). Nothing on the CPU waits for the GPU, so the
program runs ahead of its kernels as it would over NCCL, instead of draining the GPU at every
collective.

A region (and its event) is reused only after every member's fold that read it has finished
on the GPU: a member tells the coordinator it has read (``xread``) once its fold's done event
has completed (:class:`Retirer`), and the owner frees the region when the coordinator says
every member has (``xfree``). Where the trace needs the data on the host (a sandbox rank's
digest, a kept contribution), the same staging also copies it into the rank's page-locked host
arena, asynchronously; the coordinator reads it after every member has read, by which time
the copy — ordered before the event every fold waited for — is done.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
from collections import deque

import torch

from nccl_ext.core import wire
from nccl_ext.core.atomic import atomic_write
from nccl_ext.core.errors import CommDeadlineError
from nccl_ext.core.pending import LIMIT_KEY
from nccl_ext.exchange.arena import _aligned, _Segment

DEVICE_TAG = "cuda"
"""First field of a location staged on the GPU (a host location starts with its generation)."""

EVENTS = 512
"""Interprocess events per rank: one per staged region still in use."""

GATE_TIMEOUT_S = 300.0
"""Deadline of an op's wait at the :class:`EventGate` for its peers' stagings where the rank
passes none (``comm.timeout_s``'s default)."""


def handle_path(directory: str, rank: int) -> str:
    """Where ``rank`` publishes its device buffer's and events' IPC handles."""
    return os.path.join(directory, f"r{rank}-cuda")


def is_device_location(location) -> bool:
    """Whether a location (without or with its rank in front) lies on a GPU."""
    return location is not None and len(location) > 1 and DEVICE_TAG in (location[0], location[1])


def described(descs) -> list[torch.Tensor]:
    """Meta tensors of a device location's pieces: their shapes and dtypes, no data (what the
    coordinator records of a contribution the trace does not keep)."""
    return [torch.empty(shape, dtype=wire.dtype_from_name(dt), device="meta") for _off, dt, shape in descs]


class DeviceArena:
    """One rank's staging buffer on its GPU, shared with its peers (:func:`handle_path`)."""

    def __init__(self, directory: str, rank: int, device: torch.device, nbytes: int, events: int = EVENTS):
        import torch.multiprocessing  # noqa: F401 - registers torch's reducers of CUDA tensors
        from multiprocessing.reduction import ForkingPickler

        from nccl_ext.core.device_memory import allocate_outside, release_outside

        self.device = device
        self.buf = allocate_outside(device, nbytes)
        try:
            with torch.cuda.device(device):
                self.events = [torch.cuda.Event(interprocess=True) for _ in range(events)]
                handles = [e.ipc_handle() for e in self.events]
            shared = bytes(ForkingPickler.dumps((self.buf, handles)))
        except BaseException:
            release_outside(self.buf)
            raise
        self._free_events = deque(range(events))
        self._seg = _Segment(0, "", self.buf.numel(), None, free=[(0, self.buf.numel())])
        self._lock = threading.Lock()
        self.bytes_staged = 0
        self.full = 0
        """Stagings that did not fit (those went through the host arena)."""
        path = handle_path(directory, rank)
        atomic_write(path, shared)  # a peer opens it only once a location names this rank

    def put(self, tensors: list[torch.Tensor], stream: torch.cuda.Stream, also=None):
        """Copy ``tensors`` (on this GPU) into one region on ``stream``, call ``also()`` (further
        copies the event must follow) and record an event after them; returns ``(descs, event
        index, token)``, or None when the buffer or the events are all in use."""
        sizes = [_aligned(t.numel() * t.element_size()) for t in tensors]
        total = max(256, sum(sizes))
        with self._lock:
            if not self._free_events:
                self.full += 1
                return None
            start = self._seg.take(total)
            if start is None:
                self.full += 1
                return None
            ev = self._free_events.popleft()
        descs, at = [], start
        with torch.cuda.stream(stream):
            for t, n in zip(tensors, sizes):
                if n:
                    nbytes = t.numel() * t.element_size()
                    self.buf[at:at + nbytes].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
                descs.append((at, wire.dtype_name(t.dtype), list(t.shape)))
                at += n
            if also is not None:
                also()
            self.events[ev].record(stream)
        self.bytes_staged += total
        return descs, ev, (start, total, ev)

    def free(self, token: tuple) -> None:
        start, total, ev = token
        with self._lock:
            self._seg.give(start, total)
            self._free_events.append(ev)


class DevicePeers:
    """The peers' device buffers and events, each peer opened once by CUDA IPC — its buffer and
    every one of its events together.

    Opening an IPC handle takes the driver's context lock for writing, which a thread blocked in
    a synchronous copy holds while the copy waits for its stream (H200, driver 580: a rank's
    reader thread sat in ``cuIpcOpenEventHandle`` while its program sat in a copy to the host
    behind a deferred wait whose fold that reader was about to queue). So nothing is opened
    lazily per op: a peer's events all come with it, and the program's thread opens the peers
    of each op it issues (:meth:`meet`), where it holds no such lock, before any thread needs
    them."""

    def __init__(self, directory: str, device: torch.device):
        self.directory = directory
        self.device = device
        self._opened: dict[int, tuple[torch.Tensor, list]] = {}
        self._lock = threading.Lock()
        self.opened_late = 0
        """Peers opened by a thread other than the program's (first met in a location)."""

    def _peer(self, rank: int) -> tuple[torch.Tensor, list]:
        got = self._opened.get(rank)
        if got is not None:
            return got
        with self._lock:
            got = self._opened.get(rank)
            if got is None:
                with open(handle_path(self.directory, rank), "rb") as f:
                    buf, handles = pickle.loads(f.read())
                events = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in handles]
                got = self._opened[rank] = (buf, events)
        return got

    def meet(self, ranks) -> None:
        """Open the peers among ``ranks`` that have published their buffers and are not open yet
        (the program's thread, at an op's issue; one that has not published yet is opened when
        its location arrives)."""
        for rank in ranks:
            if rank not in self._opened and os.path.exists(handle_path(self.directory, rank)):
                self._peer(rank)

    def _late(self, rank: int) -> tuple[torch.Tensor, list]:
        got = self._opened.get(rank)
        if got is None:
            got = self._peer(rank)
            self.opened_late += 1
        return got

    def views(self, rank: int, descs) -> list[torch.Tensor]:
        buf, _ = self._late(rank)
        out = []
        for off, dt, shape in descs:
            dtype = wire.dtype_from_name(dt)
            n = wire.numel(shape) * dtype.itemsize
            out.append(buf[off:off + n].view(dtype).view(shape))
        return out

    def event(self, rank: int, index: int) -> torch.cuda.Event:
        return self._late(rank)[1][index]


class Retirer:
    """Calls ``then(op_id)`` once each queued event has completed, in order, on a thread of its
    own (an event's wait releases the GIL and, being a blocking-sync event, the CPU)."""

    def __init__(self, then, name: str):
        self._then = then
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.error: BaseException | None = None

    def put(self, event: torch.cuda.Event, op_id: int) -> None:
        self._q.put((event, op_id))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            event, op_id = item
            try:
                event.synchronize()
                self._then(op_id)
            except BaseException as e:  # noqa: BLE001 - reported by close(); the coordinator's deadlines name the op
                self.error = self.error or RuntimeError(f"op {op_id}: {type(e).__name__}: {e}")

    def close(self, timeout_s: float) -> None:
        """Retire everything queued, then end the thread (at most ``timeout_s``)."""
        self._q.put(None)
        self._thread.join(timeout_s)


def _has_run(event) -> bool:
    """Whether ``event`` has completed (one whose query fails counts as done: the fold's own wait
    for it then fails the op and says why)."""
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 - see above
        return True


class EventGate:
    """Calls each ``then()`` once all of its events have completed, polled from a thread of its
    own (in the order they were put, among those ready at once); errors are said on stderr.

    Each item has a deadline (``timeout_s``: the run's ``comm.timeout_s``): a peer whose staging
    never runs on its GPU (its process stopped, or its stream waits for good) does not keep the
    gate polling for it. Past the deadline the item is dropped and ``late(error)`` — or stderr —
    hears a :class:`CommDeadlineError` naming the op and the peers it waited for; the op itself,
    whose fold was never queued, fails by its own deadline at the program's wait."""

    POLL_S = 50e-6
    """Poll interval while an item waits (a fold queued late holds the folds behind it)."""
    IDLE_POLL_S = 1e-3
    """Poll interval once nothing became ready for :attr:`BACK_OFF_S`: a peer that is that late
    is not a matter of microseconds, and polling every 50 µs would take a core from the program."""
    BACK_OFF_S = 0.01

    def __init__(self, device: torch.device | None, name: str, timeout_s: float = GATE_TIMEOUT_S):
        self._items: list[tuple] = []
        self._cv = threading.Condition()
        self._closed = False
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(device,), name=name, daemon=True)
        self._thread.start()

    def put(self, events: list, then, what: str = "", late=None) -> None:
        """Call ``then()`` once ``events`` have run; ``what`` names the op and the peers whose
        events these are in the deadline's error, which ``late(error)`` hears if given."""
        with self._cv:
            self._items.append((events, then, time.monotonic() + self.timeout_s, what, late))
            self._cv.notify()

    def _run(self, device) -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        idle_since = None
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if not self._items:
                    return
                items = list(self._items)
            now = time.monotonic()
            ready = [item for item in items if all(_has_run(e) for e in item[0])]
            expired = [item for item in items if item not in ready and now > item[2]]
            if not ready and not expired:
                idle_since = idle_since or now
                time.sleep(self.POLL_S if now - idle_since < self.BACK_OFF_S else self.IDLE_POLL_S)
                continue
            idle_since = None
            with self._cv:
                for item in ready + expired:
                    self._items.remove(item)
            for item in expired:
                self._expire(item)
            for item in ready:
                try:
                    item[1]()
                except BaseException as e:  # noqa: BLE001 - the op's deadline names it; this says why
                    self.error = self.error or e
                    print(f"prism-launch: {self._thread.name}: queuing a fold failed: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)

    def _expire(self, item) -> None:
        events, _then, _deadline, what, late = item
        waiting = sum(not _has_run(e) for e in events)
        error = CommDeadlineError(
            f"deadline exceeded: {what or 'an exchanged op'}: {waiting} of its peers' stagings had not run on their "
            f"GPUs after {self.timeout_s:g} s, so its fold was never queued (a peer's stream waits for good, or "
            f"its process stopped: see the peers' logs) ({LIMIT_KEY}={self.timeout_s:g}; raise it with "
            f"{LIMIT_KEY}= if the peers are only slow)")
        self.error = self.error or error
        if late is not None:
            try:
                late(error)
                return
            except BaseException as e:  # noqa: BLE001 - said below with the deadline's error
                error = RuntimeError(f"{error} (and telling the op failed: {type(e).__name__}: {e})")
        print(f"prism-launch: {self._thread.name}: {error}", file=sys.stderr, flush=True)

    def close(self, timeout_s: float) -> None:
        """Stop once what is queued has run (at most ``timeout_s``; a peer that never staged
        leaves its op unqueued)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)
        with self._cv:
            self._items.clear()


def done_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event recorded on ``stream`` now, whose wait yields the CPU."""
    ev = torch.cuda.Event(blocking=True)
    ev.record(stream)
    return ev


class GpuExchange:
    """A captured rank's side of the exchange on its GPU: stages its contributions and sends
    (:meth:`stage`), computes its results from its peers' regions on the fold's stream
    (:meth:`complete`), and reports each op read once that fold has run (``read(op_id)``)."""

    def __init__(self, directory: str, rank: int, fold, nbytes: int, read, scope: frozenset[int] | None,
                 timeout_s: float = GATE_TIMEOUT_S):
        self.rank = rank
        self.fold = fold
        """The rank's :class:`~nccl_ext.exchange.device_reduce.DeviceFold` (its stream and scratch)."""
        self.device = fold.device
        self.arena = DeviceArena(directory, rank, self.device, nbytes)
        self.peers = DevicePeers(directory, self.device)
        self.retirer = Retirer(read, name=f"prism-gpu-exchange-{rank}")
        self.gate = EventGate(self.device, name=f"prism-gpu-gate-{rank}", timeout_s=timeout_s)
        self.scope = scope
        self.ops = 0
        """Ops whose contribution or send was staged on the GPU."""

    def fits(self, tensors) -> bool:
        """Whether ``tensors`` can be staged here (all on this GPU)."""
        return bool(tensors) and all(t.device == self.device for t in tensors)

    def needs_host(self, ranks) -> bool:
        """Whether the trace reads this op's data on the host: every op's in a full trace, else
        those of a group (or a send between ranks) with a sandbox rank (its digests, the kept
        contributions it consumes)."""
        return self.scope is None or not self.scope.isdisjoint(ranks)

    def stage(self, tensors: list[torch.Tensor], host) -> tuple[tuple, tuple] | None:
        """Stage ``tensors`` on the program's current stream: a region of the device buffer, and
        with ``host`` (a host :class:`~nccl_ext.exchange.arena.Arena`) a page-locked host copy, both
        before the region's event. Returns ``(location, token)`` or None (the buffer is full: the
        caller stages on the host as before)."""
        stream = torch.cuda.current_stream(self.device)
        copied = []

        def also() -> None:
            if host is not None:
                copied.append(host.put(tensors, non_blocking=True))

        got = self.arena.put(tensors, stream, also)
        if got is None:
            return None
        descs, ev, token = got
        hloc = htoken = None
        if copied:
            gen, hdescs, htoken = copied[0]
            hloc = (gen, hdescs)
        self.ops += 1
        return (DEVICE_TAG, descs, ev, hloc), (token, htoken)

    def free(self, token: tuple, host) -> None:
        dtoken, htoken = token
        self.arena.free(dtoken)
        if htoken is not None and host is not None:
            host.free(htoken)

    def issued(self) -> torch.cuda.Event:
        """An event on the program's current stream after what it issued so far (the fold reads
        the rank's own tensors after it and writes its results after it)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def when_staged(self, locations, then, gated: bool, what: str = "", late=None) -> None:
        """Call ``then()`` (which queues a fold); ``gated``: once the peers' stagings at
        ``locations`` (rank first) have run on their GPUs — at once where they have, else from the
        gate's thread —, so the fold's stream never waits on the GPU for a peer. One stream folds
        every group's ops, in the order they become ready; a fold waiting there for a peer would
        hold the folds of other groups behind it — which that peer may itself wait for through
        its program's stream: an op issued early and waited for late, with ops of another group
        between, as NCCL allows (it runs each group's kernels on a stream of their own). Gated
        where the program's waits go to the GPU (:mod:`nccl_ext.capture.deferred_waits`, from the
        program's third step): there the program's host does not stop at a wait. Else the rank's host blocks at each wait until its
        result is queued, and a gate would make that wait for the peers' GPUs as well. ``what``
        (the op) and ``late``: as :meth:`EventGate.put`'s, past the gate's deadline."""
        device = [loc for loc in locations if is_device_location(loc)] if gated else []
        events = [self.peers.event(loc[0], loc[3]) for loc in device]
        if all(_has_run(e) for e in events):
            then()
        else:
            peers = f"ranks {sorted({loc[0] for loc in device})[:16]}"
            self.gate.put(events, then, f"rank {self.rank}: {what or 'an exchanged op'} (waiting for {peers})", late)

    def own_views(self, descs) -> list[torch.Tensor]:
        """This rank's own staged pieces (its ``descs``) in its device buffer: ordered before the
        program's issue event, which every fold waits for."""
        out = []
        for off, dt, shape in descs:
            dtype = wire.dtype_from_name(dt)
            n = wire.numel(shape) * dtype.itemsize
            out.append(self.arena.buf[off:off + n].view(dtype).view(shape))
        return out

    def views(self, location, host_views) -> list[torch.Tensor] | None:
        """A member's pieces from its location (rank first): on a GPU — once the fold's stream
        waits for its event — or in a host arena (``host_views``)."""
        if location is None:
            return None
        if not is_device_location(location):
            return host_views(location)
        rank, _tag, descs, ev, _host = location
        self.fold.stream.wait_event(self.peers.event(rank, ev))
        return self.peers.views(rank, descs)

    def complete(self, p, op_id: int, issue: torch.cuda.Event, program: torch.cuda.Stream, results,
                 flag=None) -> None:
        """Complete ``p`` with ``results()`` (the pieces' views and the fold, issued on the
        fold's stream after ``issue``): the program's tensors are written on that stream, the
        program's stream waits for it, and op ``op_id`` is reported read once it has run.
        ``flag(stream)``: writes the op's flag after the results instead, which the program's
        stream waits for where the program passed its wait (:mod:`nccl_ext.capture.deferred_waits`)."""
        stream = self.fold.stream
        retired = []

        def retire() -> None:
            if not retired:
                ev = done_event(stream)
                retired.append(ev)
                if flag is not None:
                    flag(stream)
                else:
                    program.wait_event(ev)
                if p is not None:
                    p.device_done = ev
                self.retirer.put(ev, op_id)

        try:
            with torch.cuda.stream(stream):
                stream.wait_event(issue)
                out = results()
                if p is None:
                    retire()
                    return
                # written and retired by the process group on this stream, whichever thread it is on
                p.apply_stream = stream
                p.after_apply = retire
                p.complete(out)
        except BaseException as e:  # noqa: BLE001 - the op fails, the program hears it at its wait
            with torch.cuda.stream(stream):
                retire()  # a failed op's regions are released all the same
            if p is not None:
                p.fail(RuntimeError(f"{p.what}: computing the result on the GPU failed: {e} "
                                    "(capture.gpu_exchange_mib=0 exchanges through host memory instead)"))

    def close(self, timeout_s: float) -> None:
        """Report every op read whose fold is done (at most ``timeout_s``); a failure to wait for
        one is said on stderr (its regions stay: the capture's end names what is unfinished)."""
        self.gate.close(timeout_s)
        self.retirer.close(timeout_s)
        if self.retirer.error is not None:
            import sys

            print(f"prism-launch: the GPU exchange could not wait for a fold ({self.retirer.error})",
                  file=sys.stderr, flush=True)


def start_gpu_exchange(directory: str, rank: int, fold, nbytes: int, read,
                       scope: frozenset[int] | None, timeout_s: float = GATE_TIMEOUT_S) -> GpuExchange | None:
    """This rank's :class:`GpuExchange`, or None — said once on stderr — where its buffer cannot
    be shared (no CUDA IPC on this device or allocator): its contributions then go through the
    host arena, as with ``capture.gpu_exchange_mib=0``."""
    try:
        return GpuExchange(directory, rank, fold, nbytes, read, scope, timeout_s)
    except Exception as e:  # noqa: BLE001 - any failure to share leaves the host path, which always works
        import sys

        print(f"prism-launch: rank {rank}: the GPU exchange is unavailable ({type(e).__name__}: {e}); exchanged "
              "tensors go through host memory (capture.gpu_exchange_mib=0 says so up front)", file=sys.stderr, flush=True)
        return None
