"""The device path of one sandbox rank (:class:`DevicePath`): its settings, its setup — plan
the run, lay out and fill the host tier, size and allocate the pool, start the prefetch mode —
the helper threads its copies and sums run on, and its end. Staging and the host tier are its
base classes (:mod:`~nccl_ext.device_path.stager`, :mod:`~nccl_ext.device_path.host_tier`); the
divergence checks a part of it (:mod:`~nccl_ext.device_path.checks`)."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from concurrent import futures

import torch

from nccl_ext.core import wire
from nccl_ext.core.errors import CommError
from nccl_ext.device_path import pool
from nccl_ext.device_path.checks import SLOT_BYTES, DeviceChecks, chunked_word_sum
from nccl_ext.device_path.host_tier import HostTier
from nccl_ext.device_path.plan import Plan, StagedOp, aligned, plan_ops
from nccl_ext.device_path.stager import Stager
from nccl_ext.device_path.stats import PrefetchMode, PrefetchStats


CLOSE_S = 5.0
"""How long :meth:`DevicePath.close` waits, in all, for the path's threads (staging, the host
tier's loading, planning) and the copies and sums on its helper threads: by then the program
has ended, so one still running is stuck (the trace's storage, or the GPU); it is named on
stderr and left behind (daemon threads), the host tier then left page-locked until the
process ends, not unlocked under a copy that may still read it."""


class DevicePath(Stager, HostTier):
    """One sandbox rank's device data path (see :mod:`nccl_ext.device_path`)."""

    def __init__(self, *, rank: int, sandbox: tuple[int, ...], recording, mode: str = PrefetchMode.STREAM,
                 pool_bytes: int = 512 << 20, check: bool = True, timeout_s: float = 300.0,
                 read_lock: threading.Lock | None = None, device_kind: str = "cpu", workers: int = 4,
                 host_tier_bytes: int = 16 << 30, tier_on_host: bool = False, grow: bool = False,
                 expected_peak: int | None = None, reserve_bytes: int = 4 << 30, share: int = 1,
                 memory_limit_bytes: int = 0):
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
        self.memory_limit_bytes = int(memory_limit_bytes)
        """The target GPU's memory cap this process runs under (0: none): the pool widens it by
        its own size, and a grown pool leaves the cap within the device."""
        self._space: pool.Space | None = None
        self._plans: deque[Plan] = deque()
        self._ready: deque[StagedOp] = deque()
        self._taken: list[tuple[StagedOp, object]] = []
        self._released: list = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._read_lock = read_lock or threading.Lock()
        self._side = None
        self._checks = DeviceChecks(self.stats)
        self._cycles_per_s: float | None = None
        self._workers = max(1, int(workers))
        self._executor = None
        self._inflight: set[futures.Future] = set()
        """Copies and sums submitted to the helper threads and not yet done."""
        self._prep: threading.Thread | None = None
        self._planned: list[Plan] | None = None
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
        data, work, self.stats.pool_grown = pool.split_pool(self.mode, plans, self.requested_pool, spare)
        self._allocate(data + work + aligned(SLOT_BYTES))
        self._space = pool.Space(data, work)
        largest = max((p.nbytes for p in plans), default=0)
        self._refill_at = self._space.capacity - max(self._space.capacity // 4, largest)
        self._checks.attach(self._pool[data + work:data + work + SLOT_BYTES])
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
        if self.memory_limit_bytes > 0:  # the target GPU's cap stays enforceable: cap plus pool within the device
            spare = min(spare, total - self.memory_limit_bytes)
        return max(0, spare)

    def _await_plans(self) -> list[Plan]:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._planned is None:
                if self._error is not None:
                    raise CommError(f"rank {self.rank}: planning the prefetch failed: {self._error}") \
                        from self._error
                if time.monotonic() > deadline:
                    raise CommError(f"rank {self.rank}: planning the prefetch (reading the trace's events) took "
                                       f"over {self.timeout_s:g} s; raise comm.timeout_s if its storage is that slow")
                self._cond.wait(0.05)
            return self._planned

    def _allocate(self, capacity: int) -> None:
        """The pool (:func:`~nccl_ext.device_path.pool.allocate`: outside what the program is
        charged for, the target GPU's cap widened by it)."""
        self._pool = pool.allocate(self.device if self._cuda else torch.device("cpu"), capacity,
                                   self.memory_limit_bytes)
        self.stats.pool_bytes = self._pool.numel()

    def _plan_all(self) -> list[Plan]:
        return plan_ops(self.recording, self.rank, self.sandbox, self.check, self._read_lock)

    # -- the helper threads -------------------------------------------------------------------
    def _parallel(self, work: list, fn) -> list:
        """``fn`` over ``work`` on the stager's helper threads (copies and sums release the GIL)."""
        if len(work) <= 1 or self._workers <= 1:
            return [fn(*w) for w in work]
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix=f"prism-prefetch-{self.rank}")
        submitted = [self._executor.submit(fn, *w) for w in work]
        self._inflight.update(submitted)
        try:
            return [f.result() for f in submitted]
        finally:
            self._inflight.difference_update(submitted)

    def _word_sum(self, t: torch.Tensor) -> int:
        return chunked_word_sum(t, self._parallel)

    # -- the op's side, after the stager handed it over -----------------------------------------
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
        self._checks.verify(live, refs, where)

    def flush(self) -> list[tuple]:
        """Compare the queued checks (one device synchronisation): each mismatch as
        :meth:`DeviceChecks.flush <nccl_ext.device_path.checks.DeviceChecks.flush>` gives it."""
        return self._checks.flush()

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
        if not self._end_threads(CLOSE_S):
            self._unpin_tier()
        if self._t_first is not None and self._t_loaded is not None:
            self.stats.host_tier_lead_s = self._t_first - self._t_loaded
        left = [s.idx for s in self._ready] + [p.idx for p in self._plans]
        if self.device is None:  # never started: every op of the path is left
            left = [p.idx for p in (self._planned if self._planned is not None else self._plan_all())]
        self._taken = []
        self._ready.clear()
        self._plans.clear()
        return len(left), (min(left) if left else None)

    def _end_threads(self, limit_s: float) -> list[str]:
        """Join the path's threads and its helper threads' work within ``limit_s`` in all;
        what each still running was doing (said on stderr)."""
        deadline = time.monotonic() + limit_s
        left = []
        for doing, thread in (("staging ops ahead", self._thread), ("loading the host tier", self._loader),
                              ("planning", self._prep)):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    left.append(f"{thread.name} ({doing})")
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            _, running = futures.wait(list(self._inflight), timeout=max(0.0, deadline - time.monotonic()))
            if running:
                left.append(f"{len(running)} copies or sums on the helper threads")
            self._executor = None
        if left:
            print(f"prism-launch: rank {self.rank}: the device data path's close waited {limit_s:g} s and left "
                  f"{', '.join(left)} running (the trace's storage or the GPU stopped answering?); the host tier "
                  "stays page-locked until the process ends", file=sys.stderr, flush=True)
        return left


def _calibrate_sleep(device: torch.device) -> float:
    """GPU clock cycles per second of ``torch.cuda._sleep`` on this device."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


