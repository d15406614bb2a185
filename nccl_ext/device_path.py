"""The device data path of emulation: tensor prefetching and on-device compensation.

A collective whose only live member is this sandbox rank (every other member virtual) —
and a send or receive with a virtual peer — never leaves the sandbox's device:

* **Prefetch.** A :class:`Stager` walks the rank's ops in the trace's order and stages what
  each needs from its virtual peers — the pieces of their recorded contributions the sandbox's
  result is made of, a folded group's recorded result, a virtual sender's payload — into a
  bounded device **pool** (a ring of device memory, FIFO like the ops), from pinned host
  memory on a side stream, ahead of the op. The op's stream waits for that copy's event only;
  the host waits only when the stager is behind (a *stall*). ``mode="off"`` stages each op when
  it is entered, on the op's stream; ``mode="preload"`` stages the whole run before the first
  op (the reference with no virtual-peer data movement at all); ``mode="inline"`` stages from
  the host tier on the program's own thread as it enters ops, one op at a time (no stager
  thread, no batches). On CUDA, with ``grow``, both do what preload does when the device can
  spare the run's data (:func:`split_pool`).
* **Compensation on device.** Reductions fold the staged recorded terms and the live tensor
  with :func:`nccl_ext.ops.fold` in group-rank order, into pool scratch — the arithmetic of the
  capture step for step, so results are bit-identical to it (IEEE adds, multiplies, min/max are
  exact per step on any device); gathers and all-to-alls just take the staged pieces.
* **Divergence checks without a host copy.** Each live contribution's 32-bit word sum is taken
  on the device into a slot of the pool; the slots are read (one synchronisation) at the step
  boundary and compared with the same sum of the recorded tensors, computed by the stager.

Nothing here allocates through torch's allocator during the run: the pool is allocated once
and its size is published (:func:`pool_bytes`) so memory accounting leaves it out, and any
memory cap of the target GPU is widened by it.

The same code runs on CPU (the "device" is host memory, copies are synchronous), which is how
it is tested where no GPU exists.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from nccl_ext import wire
from nccl_ext.ops import Collective, ReduceKind, contributors, fold

_ALIGN = 256
_CHUNK_WORDS = 1 << 21
"""Host-side copies and sums are split into pieces of this many 32-bit words (8 MiB)."""
_TIER_BATCH_BYTES = 64 << 20
"""The host tier's loader copies and sums the ops it loads in batches of about this many staged
bytes, spread over its helper threads (a single op is often one piece: no parallelism)."""
_CHECK_SLOTS = 4096
_BATCH_OPS = 64
"""Most ops the stager stages per wake-up."""


class PrefetchMode:
    STREAM = "stream"
    OFF = "off"
    PRELOAD = "preload"
    INLINE = "inline"
    ALL = (STREAM, OFF, PRELOAD, INLINE)
    STREAMING = (STREAM, INLINE)


_POOL_BYTES: dict[str, int] = {}


def pool_bytes(device: torch.device | str) -> int:
    """Bytes the device path holds on ``device`` outside the program (memory accounting
    subtracts them from the caching allocator's figures)."""
    return _POOL_BYTES.get(str(torch.device(device)), 0)


_SEGMENT = 2 << 20


def charged_size(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 2 MiB: what a device pool is given so that torch's caching
    allocator charges it exactly its size. The allocator rounds a block to 512 B and keeps a
    large block's whole segment (rounded to 2 MiB) when the rest would be under 1 MiB, so a
    pool of any other size is charged up to ~1 MiB more than it asked for — and leaving the
    asked size out of the program's memory figures would credit the program with the rest."""
    return -(-nbytes // _SEGMENT) * _SEGMENT


def eligible(sandbox: tuple[int, ...], rank: int, group_ranks: tuple[int, ...] | None = None,
             peer: int | None = None) -> bool:
    """Whether an op of sandbox ``rank`` goes through the device path: a collective whose other
    members are all virtual, or a send/receive whose peer is virtual. (Ops shared with another
    sandbox rank exchange live data over the physical group.)"""
    if peer is not None:
        return peer not in sandbox
    return not any(r != rank and r in sandbox for r in group_ranks or ())


def needed_pieces(kind: Collective, n: int, me: int, root: int | None, member: int, pieces: int) -> list[int]:
    """Indices of virtual ``member``'s contribution pieces that member ``me``'s result is made of."""
    match kind:
        case Collective.ALL_REDUCE | Collective.ALL_GATHER:
            return list(range(pieces))
        case Collective.REDUCE:
            return list(range(pieces)) if me == root else []
        case Collective.REDUCE_SCATTER:
            return [i * n + me for i in range(pieces // n)]
        case Collective.GATHER:
            return [0] if me == root else []
        case Collective.ALL_TO_ALL:
            return [me]
        case Collective.BROADCAST:
            return list(range(pieces)) if member == root else []
        case Collective.SCATTER:
            return [me] if member == root else []
    return []


def result_of(kind: Collective, n: int, me: int, root: int | None, live: list[torch.Tensor] | None,
              terms: dict[int, dict[int, torch.Tensor]], scratch: list[torch.Tensor],
              reduce: ReduceKind | None) -> list[torch.Tensor]:
    """Member ``me``'s result (the semantics of :func:`nccl_ext.ops.compute`), from its live
    pieces and the virtual members' needed pieces ``terms[m][i]``; reductions fold into
    ``scratch``."""

    def piece(m: int, i: int) -> torch.Tensor:
        return live[i] if m == me else terms[m][i]

    match kind:
        case Collective.BARRIER:
            return []
        case Collective.ALL_REDUCE | Collective.REDUCE:
            if kind is Collective.REDUCE and me != root:
                return []
            return [fold(reduce, [piece(m, i) for m in range(n)], out=scratch[i]) for i in range(len(scratch))]
        case Collective.REDUCE_SCATTER:
            return [fold(reduce, [piece(m, i * n + me) for m in range(n)], out=scratch[i]) for i in range(len(scratch))]
        case Collective.ALL_GATHER:
            k = len(live)
            return [piece(m, i) for i in range(k) for m in range(n)]
        case Collective.GATHER:
            return [piece(m, 0) for m in range(n)] if me == root else []
        case Collective.ALL_TO_ALL:
            return [piece(m, me) for m in range(n)]
        case Collective.BROADCAST:
            return list(live) if me == root else [terms[root][i] for i in sorted(terms[root])]
        case Collective.SCATTER:
            return [piece(root, me)]
    raise ValueError(f"unknown collective {kind!r}")


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest integer words they divide into (a view when contiguous)."""
    flat = t.detach().reshape(-1)
    if flat.dtype.itemsize == 0 or flat.numel() == 0:
        return flat.view(torch.uint8)[:0]
    raw = flat.view(torch.uint8)
    offset = raw.data_ptr()
    for dt in (torch.int32, torch.int16):
        if raw.numel() % dt.itemsize == 0 and offset % dt.itemsize == 0:
            return raw.view(dt)
    return raw


def word_sum(t: torch.Tensor) -> int:
    """The checksum the device path compares: the sum of ``t``'s integer words mod 2**32
    (detects changed values, not permutations)."""
    w = _words(t)
    if not w.numel():
        return 0
    import numpy as np  # sums outside torch's allocator (the hook charges the program for those)

    if w.dtype == torch.int32:  # wrapping 32-bit adds: the same value mod 2**32, no widening pass
        return int(w.numpy().view(np.uint32).sum(dtype=np.uint32))
    return int(w.numpy().sum(dtype=np.int64)) & 0xFFFFFFFF


@dataclass(slots=True)
class PrefetchStats:
    mode: str = PrefetchMode.STREAM
    pool_bytes: int = 0
    pool_grown: bool = False
    """A streaming mode took a pool holding the whole run's staged data and filled it before
    the first op (``prefetch.grow``: the device had it to spare)."""
    preload_s: float = 0.0
    """How long the first op waited while the whole run was staged (preload, or a grown pool)."""
    staged_ops: int = 0
    staged_bytes: int = 0
    hits: int = 0
    """Ops whose data was on the device before they were entered."""
    in_flight: int = 0
    """Ops whose copy was still running when entered: the op's stream waited, the host did not."""
    stalls: int = 0
    """Ops the stager had not reached when entered: the host waited."""
    stall_s: float = 0.0
    high_water_bytes: int = 0
    host_tier_bytes: int = 0
    """Pinned host memory holding the run's staged data, filled ahead by the loader."""
    host_tier_pinned: bool = False
    host_tier_load_s: float = 0.0
    """How long the loader took to fill the host tier (from the trace's mapped files)."""
    host_tier_lead_s: float | None = None
    """How long before the first op the host tier was full (negative: after it)."""
    stager_batches: int = 0
    copies: int = 0
    """Host-to-pool copies issued (a batch of ops back to back in the pool takes one)."""
    stager_cpu_s: float = 0.0
    """CPU time of the stager thread (it shares the interpreter with the program)."""
    checks: int = 0
    check_flushes: int = 0
    delayed_s: float = 0.0
    """Virtual members' lateness enqueued on the device (``emulate.timing``)."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class StagedOp:
    idx: int
    nbytes: int
    terms: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    result: list[torch.Tensor] = field(default_factory=list)
    """A folded group's recorded result, or a virtual sender's payload."""
    scratch: list[torch.Tensor] = field(default_factory=list)
    refs: list[int] = field(default_factory=list)
    """Word sums of this rank's recorded contribution pieces (divergence checks)."""
    span: tuple[int, int] | None = None
    """The op's staged bytes in the pool's data ring (None: nothing staged)."""
    scratch_span: tuple[int, int] | None = None
    """Its scratch in the pool's scratch ring."""
    ready: object = None
    """The side stream's event after the copies (CUDA), None when already there."""
    plan: object = None
    """The op's plan until its tensors are made (views of the pool, on the program's thread
    when it takes the op: the stager then makes no tensor per piece)."""


@dataclass(slots=True)
class _Item:
    """A recorded tensor to stage: its shape and dtype now, its data when loaded."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class _Plan:
    """What one op needs from the trace (nothing read yet)."""

    idx: int
    terms: dict[int, dict[int, _Item]]
    result: list[_Item]
    scratch: list[tuple[tuple[int, ...], torch.dtype]]
    own: list[_Item]
    """This rank's recorded pieces: only their word sums are kept."""
    tier_at: int = -1
    """Offset of this op's staged pieces in the pinned host tier (-1: not in it)."""
    refs: list[int] | None = None
    """Word sums of ``own``, once the host tier's loader computed them."""
    offsets: list[int] = field(default_factory=list)
    """Where each of :meth:`items` starts from the op's first staged byte, then each scratch
    tensor from the op's first scratch byte (computed once: staging an op is one copy)."""
    staged_nbytes: int = 0
    scratch_nbytes: int = 0

    def __post_init__(self) -> None:
        at = 0
        for t in self.items():
            self.offsets.append(at)
            at += _aligned(t.nbytes)
        self.staged_nbytes = at
        at = 0
        for s, d in self.scratch:
            self.offsets.append(at)
            at += _aligned(_numel(s) * d.itemsize)
        self.scratch_nbytes = at

    @property
    def nbytes(self) -> int:
        """Pool bytes of the op: staged pieces and scratch."""
        return self.staged_nbytes + self.scratch_nbytes

    def items(self) -> list[_Item]:
        """The pieces to stage, in the order they are laid out (pool and host tier alike)."""
        return [t for ts in self.terms.values() for t in ts.values()] + list(self.result)


def _chunks(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    step = max(1, (_CHUNK_WORDS * 4) // max(1, dst.element_size()))
    return [(dst[s:s + step], src[s:s + step]) for s in range(0, dst.numel(), step)]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _host_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous host memory outside torch's allocator, as a uint8 tensor. Its
    pages are zero and unmapped until first written — by the host tier's loader threads, in
    parallel — rather than zeroed up front on one thread."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(1, int(d))
    return tuple(reversed(out))


class _Ring:
    """FIFO allocation over ``[0, capacity)``: ops are staged and released in the same order."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.live: deque[tuple[int, int]] = deque()
        self.head = 0
        self._used = 0

    def used(self) -> int:
        return self._used

    def _place(self, n: int) -> int | None:
        if n > self.capacity:
            raise ValueError(f"{n} bytes do not fit a pool of {self.capacity}")
        if not self.live:
            return 0
        tail = self.live[0][0]
        if self.head > tail:
            if self.capacity - self.head >= n:
                return self.head
            return 0 if tail >= n else None
        if self.head < tail and tail - self.head >= n:
            return self.head
        return None

    def fits(self, n: int) -> bool:
        return self._place(n) is not None

    def alloc(self, n: int) -> tuple[int, int] | None:
        start = self._place(n)
        if start is None:
            return None
        span = (start, start + n)
        self.live.append(span)
        self.head = start + n
        self._used += n
        return span

    def release(self, span: tuple[int, int]) -> None:
        if self.live and self.live[0] == span:
            self.live.popleft()
        else:  # out of order: a skipped op; drop it where it is
            self.live.remove(span)
        self._used -= span[1] - span[0]


class _Space:
    """The pool's two FIFO rings: staged bytes (consecutive ops sit back to back, as in the
    host tier, so a batch of them moves in one copy) and scratch (where reductions fold)."""

    def __init__(self, data: int, scratch: int):
        self.data, self.scratch = _Ring(data), _Ring(scratch)
        self.scratch_base = data
        """Pool offset of the scratch ring."""

    @property
    def capacity(self) -> int:
        return self.data.capacity + self.scratch.capacity

    def used(self) -> int:
        return self.data.used() + self.scratch.used()

    def fits(self, plan: _Plan) -> bool:
        return (not plan.staged_nbytes or self.data.fits(plan.staged_nbytes)) and \
            (not plan.scratch_nbytes or self.scratch.fits(plan.scratch_nbytes))

    def alloc(self, plan: _Plan) -> tuple[tuple[int, int] | None, tuple[int, int] | None] | None:
        if not self.fits(plan):
            return None
        return (self.data.alloc(plan.staged_nbytes) if plan.staged_nbytes else None,
                self.scratch.alloc(plan.scratch_nbytes) if plan.scratch_nbytes else None)

    def release(self, op: StagedOp) -> None:
        if op.span is not None:
            self.data.release(op.span)
        if op.scratch_span is not None:
            self.scratch.release(op.scratch_span)


def split_pool(mode: str, plans: list[_Plan], requested: int, spare: int | None) -> tuple[int, int, bool]:
    """The pool's data and scratch rings (aligned bytes) and whether it was grown: the whole
    run's bytes for ``preload``, and for ``stream``/``inline`` when ``spare`` (device memory it
    may take) holds them (the caller then fills it before the first op); else ``requested``
    split between the rings as the run's bytes are, each at least twice its largest op."""
    staged = sum(p.staged_nbytes for p in plans)
    scratch = sum(p.scratch_nbytes for p in plans)
    whole = _aligned(staged) + _aligned(scratch)
    if mode == PrefetchMode.PRELOAD:
        return _aligned(staged), _aligned(scratch), False
    big_d = max((p.staged_nbytes for p in plans), default=0)
    big_s = max((p.scratch_nbytes for p in plans), default=0)
    work = max(2 * big_s, requested * scratch // max(1, staged + scratch))
    data = max(2 * big_d, requested - work)
    data, work = _aligned(data), _aligned(work)
    if mode in PrefetchMode.STREAMING and spare is not None and data + work < whole <= spare:
        return _aligned(staged), _aligned(scratch), True
    return data, work, False


class DevicePath:
    """One sandbox rank's device data path (see the module docstring)."""

    def __init__(self, *, rank: int, sandbox: tuple[int, ...], recording, mode: str = PrefetchMode.STREAM,
                 pool_bytes: int = 512 << 20, check: bool = True, timeout_s: float = 300.0,
                 read_lock: threading.Lock | None = None, device_kind: str = "cpu", workers: int = 4,
                 host_tier_bytes: int = 16 << 30, tier_on_host: bool = False, grow: bool = False,
                 expected_peak: int | None = None, reserve_bytes: int = 4 << 30, share: int = 1):
        if mode not in PrefetchMode.ALL:
            raise ValueError(f"emulate.prefetch.mode must be one of {PrefetchMode.ALL} (got {mode!r})")
        self.rank = rank
        self.sandbox = sandbox
        self.recording = recording
        self.mode = mode
        self.requested_pool = int(pool_bytes)
        self.check = check
        self.timeout_s = timeout_s
        self.stats = PrefetchStats(mode=mode)
        self.device: torch.device | None = None
        """Where the pool lives: the current CUDA device of a ``device_kind="cuda"`` sandbox (set
        when its first op arrives, after the program chose its device), else host memory."""
        self.device_kind = device_kind
        self._cuda = False
        self._pool: torch.Tensor | None = None
        self._mirror: torch.Tensor | None = None
        self._tier: torch.Tensor | None = None
        self._loader: threading.Thread | None = None
        self.host_tier_bytes = int(host_tier_bytes)
        """Largest pinned host tier (the run's staged data) to fill ahead; beyond it each op is
        copied through a pinned mirror of the pool when staged."""
        self._tier_on_host = tier_on_host
        """Use the host tier when the "device" is host memory too (tests of its logic on CPU)."""
        self.grow = grow
        """Streaming on CUDA: take a pool holding the whole run, filled before the first op,
        when the device can spare it (``emulate.prefetch.grow``)."""
        self.expected_peak = expected_peak
        """The program's peak device memory in the capture (what it will still grow to)."""
        self.reserve_bytes = int(reserve_bytes)
        self.share = max(1, int(share))
        """Processes growing pools on this GPU: each may take its share of the spare memory."""
        self._space: _Space | None = None
        self._plans: deque[_Plan] = deque()
        self._ready: deque[StagedOp] = deque()
        self._taken: list[tuple[StagedOp, object]] = []
        self._released: list = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._read_lock = read_lock or threading.Lock()
        self._side = None
        self._slots: torch.Tensor | None = None
        self._checks: list[tuple[int, object]] = []
        self._bad: list[object] = []
        self._cycles_per_s: float | None = None
        self._workers = max(1, int(workers))
        self._executor = None
        self._prep: threading.Thread | None = None
        self._planned: list[_Plan] | None = None
        self._pinned = False
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._refill_at = 0
        self._inline = False
        self._t_first: float | None = None
        self._t_loaded: float | None = None

    @property
    def on_device(self) -> bool:
        """Whether results are produced on a CUDA stream (completion is immediate, ordered by it)."""
        return self._cuda

    # -- setup ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Plan the run and fill the host tier now, on a background thread, while the program
        sets up (the transport exists before the model is built): the tier's loading — reading
        the trace and host copies — is then over before the first step instead of competing
        with it. Without this call both happen when the first op arrives."""
        if self._prep is None and self.device is None:
            self._prep = threading.Thread(target=self._prepare, name=f"prism-prefetch-plan-{self.rank}", daemon=True)
            self._prep.start()

    def _prepare(self) -> None:
        try:
            plans = self._plan_all()
            self._lay_out_tier(plans)
            with self._cond:
                self._planned = plans
                self._cond.notify_all()
            if self._tier is not None:
                self._load_tier(plans)
        except BaseException as e:  # noqa: BLE001 - surfaced by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _start(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        if self._prep is not None:
            plans = self._await_plans()
        else:
            plans = self._plan_all()
            self._lay_out_tier(plans)
            if self._tier is not None:
                self._loader = threading.Thread(target=self._load_tier, args=(list(plans),),
                                                name=f"prism-prefetch-load-{self.rank}", daemon=True)
                self._loader.start()
        spare = self._spare_bytes() if self.grow and self.mode in PrefetchMode.STREAMING else None
        data, work, self.stats.pool_grown = split_pool(self.mode, plans, self.requested_pool, spare)
        self._allocate(data + work + _aligned(_CHECK_SLOTS * 4))
        self._space = _Space(data, work)
        largest = max((p.nbytes for p in plans), default=0)
        self._refill_at = self._space.capacity - max(self._space.capacity // 4, largest)
        self._slots = self._pool[data + work:data + work + _CHECK_SLOTS * 4].view(torch.int32)
        self._plans = deque(plans)
        if self._cuda:
            self._side = torch.cuda.Stream(device)
            if self._tier is not None:
                self._pin_tier()
        if self.mode == PrefetchMode.PRELOAD or self.stats.pool_grown:
            t0 = time.monotonic()
            while self._plans:
                self._stage(self._plans.popleft(), on_side=True)
            if self._cuda:
                self._side.synchronize()
            self.stats.preload_s = time.monotonic() - t0
        elif self.mode == PrefetchMode.INLINE and self._tier is not None:
            self._inline = True  # the program's thread stages as it enters ops (take)
        elif self.mode in PrefetchMode.STREAMING:
            self._thread = threading.Thread(target=self._run, name=f"prism-prefetch-{self.rank}", daemon=True)
            self._thread.start()

    def _spare_bytes(self) -> int | None:
        """Device memory a grown pool may take: free memory, less what the program will still
        take from the device to reach its captured peak (a quarter more for the allocator's
        rounding and fragmentation) and the reserve; None without a captured peak."""
        if self.expected_peak is None or not self._cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        cached = torch.cuda.memory_reserved(self.device) - allocated
        to_come = max(0, self.expected_peak - allocated - cached)
        spare = free - to_come * 5 // 4 - self.reserve_bytes
        spare //= self.share  # the others on this GPU see the same free memory
        limit = int(os.environ.get("PRISM_MEMORY_LIMIT", "0"))
        if limit > 0:  # the target GPU's cap stays enforceable: cap plus pool within the device
            spare = min(spare, total - limit)
        return max(0, spare)

    def _await_plans(self) -> list[_Plan]:
        with self._cond:
            while self._planned is None:
                if self._error is not None:
                    raise RuntimeError(f"rank {self.rank}: planning the prefetch failed: {self._error}") \
                        from self._error
                self._cond.wait(0.05)
            return self._planned

    def _lay_out_tier(self, plans: list[_Plan]) -> None:
        """The host tier: every op's staged pieces in one host buffer (pinned before the first
        copy on CUDA), filled in the trace's order by a loader that runs as far ahead as host
        memory bandwidth allows (it is not bound by the device pool), so staging an op is one
        DMA and never a host copy."""
        staged = sum(p.staged_nbytes for p in plans)
        cuda = self.device_kind == "cuda" and torch.cuda.is_available()
        host = self._tier_on_host or self.mode == PrefetchMode.INLINE  # inline stages from the tier only
        if not (cuda or host) or self.mode == PrefetchMode.OFF or not 0 < staged <= self.host_tier_bytes:
            return
        self._tier = _host_pages(staged)
        at = 0
        for p in plans:
            p.tier_at = at
            at += p.staged_nbytes
        self.stats.host_tier_bytes = staged

    def _pin_tier(self) -> None:
        """Page-lock the host tier so its copies are asynchronous DMA (registered in place: the
        loader may still be filling it). Failing that, copies still work, synchronously."""
        err = int(torch.cuda.cudart().cudaHostRegister(self._tier.data_ptr(), self._tier.numel(), 0))
        self._pinned = err == 0
        self.stats.host_tier_pinned = self._pinned

    def _load_tier(self, plans: list[_Plan]) -> None:
        t0 = time.monotonic()
        try:
            batch, nbytes = [], 0
            for k, plan in enumerate(plans):
                if self._closed:
                    return
                work, at = [], plan.tier_at
                with self._read_lock:
                    for item in plan.items():
                        if item.nbytes:
                            src = item.load().reshape(-1)
                            src = (src if src.is_contiguous() else src.contiguous()).view(torch.uint8)
                            work += _chunks(self._tier[at:at + src.numel()], src)
                        at += _aligned(item.nbytes)
                    own = [item.load() if item.nbytes else None for item in plan.own]
                batch.append((plan, work, own))
                nbytes += plan.staged_nbytes
                if k == 0 or nbytes >= _TIER_BATCH_BYTES or k == len(plans) - 1:  # the first op at once
                    self._fill_tier(batch)
                    batch, nbytes = [], 0
            self._t_loaded = time.monotonic()
            self.stats.host_tier_load_s = self._t_loaded - t0
        except BaseException as e:  # noqa: BLE001 - surfaced by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _fill_tier(self, batch: list) -> None:
        """Copy a batch of ops' pieces into the tier and sum their own recorded pieces, all as
        one set of jobs on the helper threads (the tier's fresh pages are faulted in there too),
        then hand the ops over."""
        jobs: list = [(_copy, (dst, src)) for _, work, _ in batch for dst, src in work]
        copies, where = len(jobs), []
        for i, (_, _, own) in enumerate(batch):
            for j, t in enumerate(own):
                if t is None:
                    continue
                w = _words(t)
                parts = [w[s:s + _CHUNK_WORDS] for s in range(0, w.numel(), _CHUNK_WORDS)] \
                    if w.dtype == torch.int32 and w.numel() >= 2 * _CHUNK_WORDS else [t]
                for part in parts:
                    where.append((i, j))
                    jobs.append((word_sum, (part,)))
        done = self._parallel(jobs, lambda fn, args: fn(*args))
        refs = [[0] * len(own) for _, _, own in batch]
        for (i, j), v in zip(where, done[copies:]):
            refs[i][j] = (refs[i][j] + v) & 0xFFFFFFFF
        with self._cond:
            for (plan, _, _), r in zip(batch, refs):
                plan.refs = r
            self._cond.notify_all()

    def _wait_loaded(self, plan: _Plan) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while plan.refs is None:
                if self._error is not None or self._closed:
                    raise RuntimeError(f"rank {self.rank}: loading op #{plan.idx} into the host tier failed: "
                                       f"{self._error}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.rank}: op #{plan.idx} was not loaded into the host tier within "
                                       f"{self.timeout_s:.0f} s (reading the trace stalled?); raise comm.timeout_s "
                                       "if the trace's storage is that slow")
                self._cond.wait(0.05)

    def _allocate(self, capacity: int) -> None:
        """The pool, outside what the program is charged for; a memory cap of the target GPU
        (``PRISM_MEMORY_LIMIT``) is widened by it first so the pool itself never trips it."""
        if self._cuda:
            capacity = charged_size(capacity)
            limit = int(os.environ.get("PRISM_MEMORY_LIMIT", "0"))
            if limit > 0:
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, (limit + capacity) / total), self.device)
            self._pool = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        else:
            self._pool = wire.untracked_empty((capacity,), torch.uint8)
        _POOL_BYTES[str(self.device if self._cuda else torch.device("cpu"))] = capacity
        self.stats.pool_bytes = capacity

    def _plan_all(self) -> list[_Plan]:
        plans = []
        with self._read_lock:
            for op, gid, seq, peer, tag in self.recording.ops_of(self.rank):
                plan = self._plan(op, gid, seq, peer, tag)
                if plan is not None:
                    plans.append(plan)
        return plans

    def _plan(self, op, gid: int, seq: int, peer: int, tag: int) -> _Plan | None:
        rec = self.recording

        def items(r: int, o) -> list[_Item]:
            return [_Item(tuple(s), wire.dtype_from_name(d), lambda r=r, i=i: rec.piece(r, gid, seq, i))
                    for i, (s, d) in enumerate(zip(o.shapes, o.dtypes))]

        if op.kind in ("send", "recv"):
            if not eligible(self.sandbox, self.rank, peer=peer):
                return None
            src, dst = (peer, self.rank) if op.kind == "recv" else (self.rank, peer)
            sent = rec.sent(gid, src, dst, tag, seq)
            if sent is None:
                return None
            sop = sent[0]
            item = _Item(tuple(sop.shapes[0]), wire.dtype_from_name(sop.dtypes[0]),
                         lambda: rec.payload(gid, src, dst, tag, seq))
            if op.kind == "recv":
                return _Plan(op.idx, {}, [item], [], [])
            return _Plan(op.idx, {}, [], [], [item] if self.check else [])
        if not op.kind:
            return None
        ranks = rec.group_ranks(gid)
        if not eligible(self.sandbox, self.rank, ranks):
            return None
        kind = Collective(op.kind)
        n, me = len(ranks), ranks.index(self.rank)
        own = items(self.rank, op) if self.check and me in contributors(kind, n, op.root) else []
        if rec.folded(gid):
            result = [_Item(s, d, lambda i=i: rec.result_piece(self.rank, gid, seq, i))
                      for i, (s, d) in enumerate(rec.result_meta(self.rank, gid, seq))]
            return _Plan(op.idx, {}, result, [], own)
        terms: dict[int, dict[int, _Item]] = {}
        for m, r in enumerate(ranks):
            if m == me:
                continue
            if not needed_pieces(kind, n, me, op.root, m, n):
                continue  # nothing of this member (e.g. a broadcast's non-root)
            mop = rec.collective(r, gid, seq)
            if mop is None:
                raise RuntimeError(f"rank {self.rank}: no recorded op of virtual member rank {r} "
                                   f"(group {gid} seq {seq}); the trace is incomplete")
            want = needed_pieces(kind, n, me, op.root, m, mop.n_tensors)  # the member's own count
            pieces = items(r, mop)
            terms[m] = {i: pieces[i] for i in want}
        shapes = [tuple(s) for s in op.shapes]
        dtypes = [wire.dtype_from_name(d) for d in op.dtypes]
        match kind:
            case Collective.ALL_REDUCE:
                scratch = list(zip(shapes, dtypes))
            case Collective.REDUCE:
                scratch = list(zip(shapes, dtypes)) if me == op.root else []
            case Collective.REDUCE_SCATTER:
                scratch = [(shapes[i * n + me], dtypes[i * n + me]) for i in range(op.n_tensors // n)]
            case _:
                scratch = []
        return _Plan(op.idx, terms, [], scratch, own)

    # -- staging (stager thread, or the op's own thread when prefetch is off) -------------------
    def _run(self) -> None:
        """Stage ops in the trace's order while they fit in the pool. Once it is full, wait
        until a quarter of it is free again and stage a batch: a few wake-ups per pool's worth
        of ops rather than one per op (each costs the program's thread the interpreter lock)."""
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)
            cpu0 = time.thread_time()
            while True:
                with self._cond:
                    while not self._closed and self._plans and not self._room(self._plans[0]):
                        self._cond.wait(0.2)
                    self.stats.stager_batches += 1
                    if self._closed or not self._plans:
                        return
                    batch = []
                    while self._plans and len(batch) < _BATCH_OPS:
                        spans = self._space.alloc(self._plans[0])
                        if spans is None:
                            break
                        batch.append((self._plans.popleft(), spans))
                    released, self._released = self._released, []
                if self._tier is not None:
                    self._stage_batch(batch, released)
                else:
                    for j, (plan, spans) in enumerate(batch):
                        self._stage(plan, on_side=True, spans=spans, released=released if j == 0 else [])
                self.stats.stager_cpu_s = time.thread_time() - cpu0
        except BaseException as e:  # noqa: BLE001 - surfaced by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _stage_batch(self, batch: list, released: list) -> None:
        """Stage a batch from the host tier: the first op with its own copy and event, handed
        over at once (the program may be waiting for it); the rest with one copy per run of
        ops back to back in the pool (the tier holds them back to back too) and one event,
        handed over together."""
        ops = []
        for plan, (span, scratch) in batch:
            self._wait_loaded(plan)
            ops.append(StagedOp(idx=plan.idx, nbytes=plan.nbytes, span=span, scratch_span=scratch, plan=plan,
                                refs=plan.refs))
        first, rest = ops[0], ops[1:]
        first.ready = self._from_tier(first.span, batch[0][0].tier_at, released, event=True)
        self._publish([first])
        if not rest:
            return
        run: list[tuple[StagedOp, int]] = []
        for op, (plan, _) in zip(rest, batch[1:]):
            if op.span is None:
                continue
            if run and run[-1][0].span[1] != op.span[0]:
                self._from_tier((run[0][0].span[0], run[-1][0].span[1]), run[0][1], [], event=False)
                run = []
            run.append((op, plan.tier_at))
        if run:
            self._from_tier((run[0][0].span[0], run[-1][0].span[1]), run[0][1], [], event=False)
        last = self._record_side()
        for op in rest:
            op.ready = last
        self._publish(rest)

    def _publish(self, ops: list[StagedOp]) -> None:
        with self._cond:
            for op in ops:
                self.stats.staged_ops += 1
                self.stats.staged_bytes += op.span[1] - op.span[0] if op.span is not None else 0
                self._ready.append(op)
            self.stats.high_water_bytes = max(self.stats.high_water_bytes, self._space.used())
            self._cond.notify_all()

    def _record_side(self):
        if not self._cuda:
            return None
        ready = torch.cuda.Event()
        ready.record(self._side)
        return ready

    def _room(self, plan: _Plan) -> bool:
        """Whether to stage now (under the lock): the pool is below its refill mark or the next
        op is not staged at all (the program may be waiting for it), and the op fits."""
        if self._space.used() > self._refill_at and self._ready:
            return False
        return self._space.fits(plan)

    def _view(self, at: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool's bytes at ``at`` as a tensor (one call: a strided view of the typed pool)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._pool.view(dtype)
        return typed.as_strided(shape, _strides(shape), at // dtype.itemsize)

    def _make_tensors(self, staged: StagedOp) -> StagedOp:
        """The op's pieces and scratch as views of its pool space (once)."""
        plan = staged.plan
        if plan is None:
            return staged
        base = staged.span[0] if staged.span is not None else 0
        items = plan.items()
        views = [self._view(base + off, t.shape, t.dtype) if t.nbytes else
                 torch.empty(t.shape, dtype=t.dtype, device=self._pool.device)
                 for t, off in zip(items, plan.offsets)]
        if plan.scratch:
            at = self._space.scratch_base + staged.scratch_span[0]
            staged.scratch = [self._view(at + off, s, d) if _numel(s) else torch.empty(s, dtype=d, device=self._pool.device)
                              for (s, d), off in zip(plan.scratch, plan.offsets[len(items):])]
        k = 0
        for m, ps in plan.terms.items():
            staged.terms[m] = dict(zip(ps, views[k:k + len(ps)]))
            k += len(ps)
        staged.result = views[k:]
        staged.plan = None
        return staged

    def _stage(self, plan: _Plan, *, on_side: bool, spans: tuple | None = None,
               released: list | None = None) -> StagedOp:
        """Stage one op (preload, prefetch off, or no host tier)."""
        if spans is None:
            with self._cond:
                spans = self._space.alloc(plan)
            if spans is None:
                raise RuntimeError(f"rank {self.rank}: prefetch pool full staging op #{plan.idx}")
        span = spans[0]
        base = span[0] if span is not None else 0
        tiered = self._tier is not None and plan.tier_at >= 0 and on_side
        if tiered:
            self._wait_loaded(plan)
        staged = StagedOp(idx=plan.idx, nbytes=plan.nbytes, span=span, scratch_span=spans[1], plan=plan)
        with self._read_lock:
            if tiered:  # one copy, no tensor per piece: they are made when the op is taken
                staged.refs = plan.refs
                staged.ready = self._from_tier(span, plan.tier_at, released or [], event=True)
            else:
                self._make_tensors(staged)
                views = [t for ts in staged.terms.values() for t in ts.values()] + staged.result
                staged.refs = [self._word_sum(item.load()) if item.nbytes else 0 for item in plan.own]
                copies = [(v, base + off, t.load()) for v, t, off in zip(views, plan.items(), plan.offsets)
                          if t.nbytes]
                if self._cuda and on_side:
                    staged.ready = self._upload(base, base + plan.staged_nbytes, copies, released or [])
                else:  # host memory, or prefetch off (the op's stream moves the data now)
                    for dst, _, host in copies:
                        dst.copy_(host)
        if on_side and self.mode != PrefetchMode.OFF:
            self._publish([staged])
        else:
            self.stats.staged_ops += 1
            self.stats.staged_bytes += plan.staged_nbytes
            self.stats.high_water_bytes = max(self.stats.high_water_bytes, self._space.used())
        return staged

    def _from_tier(self, span: tuple[int, int] | None, tier_at: int, released: list, event: bool = True):
        """One DMA of loaded bytes from the host tier at ``tier_at`` into ``span`` of the pool,
        on the side stream once the ops' streams are done with whatever the space held before;
        the copy's event when ``event``."""
        n = span[1] - span[0] if span is not None else 0
        self.stats.copies += n > 0
        if not self._cuda:
            if n:
                self._pool[span[0]:span[1]].copy_(self._tier[tier_at:tier_at + n])
            return None
        side = self._side
        for e in released:
            side.wait_event(e)
        if n:
            with torch.cuda.stream(side):
                self._pool[span[0]:span[1]].copy_(self._tier[tier_at:tier_at + n], non_blocking=True)
        return self._record_side() if event else None

    def _upload(self, start: int, end: int, copies, released: list):
        """Fill the pinned mirror of ``[start, end)`` of the pool on the helper threads and move
        it with one asynchronous copy on the side stream; returns the copy's event. Memory the
        ring hands out again is written once the op's stream is done reading it."""
        for event in released:
            event.synchronize()
        if self._mirror is None:
            self._mirror = torch.empty(self._pool.numel(), dtype=torch.uint8, pin_memory=True)
        work = []
        for _, at, host in copies:
            src = host.reshape(-1)
            src = (src if src.is_contiguous() else src.contiguous()).view(torch.uint8)
            work += _chunks(self._mirror[at:at + src.numel()], src)
        self._parallel(work, lambda a, b: a.copy_(b))
        with torch.cuda.stream(self._side):
            if end > start:
                self._pool[start:end].copy_(self._mirror[start:end], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side)
        return ready

    def _parallel(self, work: list, fn) -> list:
        """``fn`` over ``work`` on the stager's helper threads (copies and sums release the GIL)."""
        if len(work) <= 1 or self._workers <= 1:
            return [fn(*w) for w in work]
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix=f"prism-prefetch-{self.rank}")
        return list(self._executor.map(lambda w: fn(*w), work))

    def _word_sum(self, t: torch.Tensor) -> int:
        w = _words(t)
        if w.dtype != torch.int32 or w.numel() < 2 * _CHUNK_WORDS:
            return word_sum(t)
        parts = [(w[s:s + _CHUNK_WORDS],) for s in range(0, w.numel(), _CHUNK_WORDS)]
        return sum(self._parallel(parts, word_sum)) & 0xFFFFFFFF

    # -- the op's side ------------------------------------------------------------------------
    def take(self, idx: int, what: str) -> StagedOp:
        """The staged data of op ``idx`` (the rank's event index), on the op's stream."""
        if self.device is None:
            self._t_first = time.monotonic()
            cuda = self.device_kind == "cuda" and torch.cuda.is_available()
            self._start(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        self._release_taken()
        if self.mode == PrefetchMode.OFF:
            while self._plans and self._plans[0].idx < idx:
                self._plans.popleft()
            if not self._plans or self._plans[0].idx != idx:
                raise RuntimeError(f"{what}: not in the trace's order of this rank's ops; the program diverged")
            self.stats.stalls += 1
            staged = self._stage(self._plans.popleft(), on_side=False)
        else:
            late = self._stage_inline(idx) if self._inline else False
            staged = self._next_ready(idx, what, late)
        self._make_tensors(staged)
        self._taken.append((staged, torch.cuda.current_stream(self.device) if self._cuda else None))
        return staged

    def _stage_inline(self, idx: int) -> bool:
        """``mode=inline``: on the program's thread as op ``idx`` is entered, issue the copies of
        the ops after it that the pool has room for and the host tier holds — one op at a time,
        so copies are spread through the step instead of a stager's batches (a device
        synchronise of the program waits for any copy still running) and no second thread
        wants the interpreter. Op ``idx`` itself is staged now if it was not yet; True when that
        waited for the host tier's loader (a stall)."""
        late = False
        with self._cond:
            self._drop_skipped(idx)
        while self._plans and self._plans[0].idx < idx:  # never staged, never needed
            self._plans.popleft()
        while self._plans:
            plan = self._plans[0]
            due = plan.idx == idx
            if not due and plan.refs is None:
                break  # the loader has not reached it: the next op entered tries again
            with self._cond:
                spans = self._space.alloc(plan)
            if spans is None:
                if due:
                    raise RuntimeError(f"rank {self.rank}: prefetch pool full staging op #{plan.idx}")
                break
            if due and plan.refs is None:
                t0 = time.monotonic()
                self._wait_loaded(plan)
                self.stats.stall_s += time.monotonic() - t0
                late = True
            self._plans.popleft()
            released, self._released = self._released, []
            span, scratch = spans
            op = StagedOp(idx=plan.idx, nbytes=plan.nbytes, span=span, scratch_span=scratch, plan=plan,
                          refs=plan.refs)
            op.ready = self._from_tier(span, plan.tier_at, released, event=True)
            self._publish([op])
        return late

    def _drop_skipped(self, idx: int) -> None:
        """Free the staged ops before ``idx`` that the program skipped (under the lock)."""
        while self._ready and self._ready[0].idx < idx:
            skipped = self._ready.popleft()
            self._space.release(skipped)
            if skipped.ready is not None:  # its copy may still run: reuse waits for it
                self._released.append(skipped.ready)

    def _next_ready(self, idx: int, what: str, late: bool = False) -> StagedOp:
        t0 = time.monotonic()
        waited = late
        with self._cond:
            while True:
                self._drop_skipped(idx)
                if self._ready:
                    break
                if self._error is not None:
                    raise RuntimeError(f"{what}: prefetch failed: {self._error}") from self._error
                if self._inline or not self._plans and (self._thread is None or not self._thread.is_alive()):
                    break  # nothing more will be staged for this op
                if time.monotonic() - t0 > self.timeout_s:
                    raise RuntimeError(f"{what}: the prefetcher did not stage this op within {self.timeout_s:.0f} s")
                waited = True
                self._cond.wait(0.05)
            staged = self._ready.popleft() if self._ready and self._ready[0].idx == idx else None
            if not self._ready:
                self._cond.notify_all()  # the stager may be holding off until the pool drains
        if staged is None:
            raise RuntimeError(f"{what}: not in the trace's order of this rank's ops; the program diverged")
        if waited:
            self.stats.stalls += 1
            self.stats.stall_s += 0.0 if late else time.monotonic() - t0
        elif staged.ready is None or staged.ready.query():
            self.stats.hits += 1
        else:
            self.stats.in_flight += 1
        if staged.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(staged.ready)
        return staged

    def _release_taken(self) -> None:
        """Free the pool space of ops already handed over: their results were written into
        the program's tensors when their works completed, on the stream recorded with them."""
        if not self._taken:
            return
        taken, self._taken = self._taken, []
        events = []
        if self._cuda:  # an event on a stream covers everything enqueued there before it
            for stream in {s.cuda_stream: s for _, s in taken}.values():
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        with self._cond:
            for staged, _ in taken:
                if self.mode != PrefetchMode.PRELOAD:
                    self._space.release(staged)
            self._released.extend(events)
            if self._plans and self._room(self._plans[0]):  # wake the stager only when it has work
                self._cond.notify_all()

    def on(self, staged: StagedOp, device: torch.device) -> StagedOp:
        """``staged`` with its tensors on ``device`` — for an op on host tensors while the pool is
        on the GPU (megatron's object collectives): copied out, so the host fold is the same."""
        if device == self.device:
            return staged

        def out(t: torch.Tensor) -> torch.Tensor:
            c = wire.untracked_empty(t.shape, t.dtype) if device.type == "cpu" else torch.empty_like(t, device=device)
            c.copy_(t)
            return c

        return StagedOp(idx=staged.idx, nbytes=staged.nbytes, span=staged.span, refs=staged.refs,
                        terms={m: {i: out(t) for i, t in ps.items()} for m, ps in staged.terms.items()},
                        result=[out(t) for t in staged.result], scratch=[out(t) for t in staged.scratch])

    def finish(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """Results as the caller may keep them: views of the pool on a device (written into the
        program's tensors before the space is reused); copies on CPU, where completion may be
        delayed by a timer past the next op."""
        if self._cuda:
            return results
        out = []
        for t in results:
            c = wire.untracked_empty(t.shape, t.dtype)
            c.copy_(t)
            out.append(c)
        return out

    def verify(self, live: list[torch.Tensor], refs: list[int], where: object) -> None:
        """Queue the word sums of ``live`` for comparison with ``refs`` at the next flush."""
        for t, ref in zip(live, refs):
            w = _words(t)
            if not w.numel():
                continue
            if len(self._checks) == _CHECK_SLOTS:
                self._flush_pending()
            slot = self._slots[len(self._checks)]
            if w.device != slot.device:  # an op on host tensors while the pool is on the GPU
                v = word_sum(t)
                slot.fill_(v - (1 << 32) if v >= 1 << 31 else v)
            elif w.dtype == torch.int32:
                torch.sum(w, dim=0, dtype=torch.int32, out=slot)
            else:
                slot.copy_(w.to(torch.int64).sum())
            self._checks.append((ref, where))
            self.stats.checks += 1

    def _flush_pending(self) -> None:
        self._bad += self.flush()

    def flush(self) -> list[object]:
        """Compare the queued checks (one device synchronisation); the ``where`` of each mismatch."""
        bad, self._bad = self._bad, []
        if not self._checks:
            return bad
        values = self._slots[: len(self._checks)].cpu().tolist()
        self.stats.check_flushes += 1
        for value, (ref, where) in zip(values, self._checks):
            if value & 0xFFFFFFFF != ref:
                bad.append(where)
        self._checks = []
        return bad

    def delay(self, seconds: float) -> None:
        """Make the op's stream wait ``seconds`` (a virtual member's lateness) before its result."""
        if seconds <= 0 or not self._cuda:
            return
        if self._cycles_per_s is None:
            self._cycles_per_s = _calibrate_sleep(self.device)
        torch.cuda._sleep(int(seconds * self._cycles_per_s))
        self.stats.delayed_s += seconds

    def close(self) -> tuple[int, int | None]:
        """Stop staging; returns how many of the rank's staged-path ops were never entered, and
        the first of them."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in (self._thread, self._loader, self._prep):
            if thread is not None:
                thread.join(timeout=5)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._pinned:
            self._side.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._tier.data_ptr())
            self._pinned = False
        if self._t_first is not None and self._t_loaded is not None:
            self.stats.host_tier_lead_s = self._t_first - self._t_loaded
        left = [s.idx for s in self._ready] + [p.idx for p in self._plans]
        if self.device is None:  # never started: every op of the path is left
            left = [p.idx for p in (self._planned if self._planned is not None else self._plan_all())]
        self._taken = []
        self._ready.clear()
        self._plans.clear()
        return len(left), (min(left) if left else None)


def _calibrate_sleep(device: torch.device) -> float:
    """GPU clock cycles per second of ``torch.cuda._sleep`` on this device."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


