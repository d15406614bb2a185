"""The host tier: every op's staged pieces in one host buffer, filled in the trace's order by a
loader that runs as far ahead as host memory bandwidth allows (it is not bound by the device
pool), so staging an op is one DMA into the pool (:meth:`HostTier._from_tier`) and never a host
copy. On CUDA the buffer is page-locked in place before the first copy. The loader also takes
the word sums of this rank's own recorded pieces (the divergence checks' references).
"""

from __future__ import annotations

import time

import torch

from nccl_ext.core.errors import CommError
from nccl_ext.device_path.checks import CHUNK_WORDS, as_words, word_sum
from nccl_ext.device_path.plan import Plan, aligned
from nccl_ext.device_path.stats import PrefetchMode

TIER_BATCH_BYTES = 64 << 20
"""The host tier's loader copies and sums the ops it loads in batches of about this many staged
bytes, spread over its helper threads (a single op is often one piece: no parallelism)."""


def chunks(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``dst`` and ``src`` (same length) in matching pieces of :data:`CHUNK_WORDS` words: jobs
    for the helper threads."""
    step = max(1, (CHUNK_WORDS * 4) // max(1, dst.element_size()))
    return [(dst[s:s + step], src[s:s + step]) for s in range(0, dst.numel(), step)]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _host_pages(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous host memory outside torch's allocator, as a uint8 tensor. Its
    pages are zero and unmapped until first written — by the host tier's loader threads, in
    parallel — rather than zeroed up front on one thread."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class HostTier:
    """The host tier's part of :class:`~nccl_ext.device_path.DevicePath` (a base class of it).

    Owns ``_tier`` (the buffer, or None), ``_loader`` (its thread when not filled by
    ``prepare``), ``_pinned``, ``_t_loaded`` and the ``host_tier_*`` figures of ``stats``; each
    plan's ``tier_at`` and ``refs``. Uses the path's ``_cond`` (plans loaded, errors, closing),
    ``_error``, ``_closed``, ``_read_lock``, ``_parallel``, ``_pool``, ``_side`` and
    ``timeout_s``.
    """

    def _lay_out_tier(self, plans: list[Plan]) -> None:
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

    def _load_tier(self, plans: list[Plan]) -> None:
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
                            work += chunks(self._tier[at:at + src.numel()], src)
                        at += aligned(item.nbytes)
                    own = [item.load() if item.nbytes and item.wsum is None else None for item in plan.own]
                batch.append((plan, work, own))
                nbytes += plan.staged_nbytes
                if k == 0 or nbytes >= TIER_BATCH_BYTES or k == len(plans) - 1:  # the first op at once
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
                w = as_words(t)
                parts = [w[s:s + CHUNK_WORDS] for s in range(0, w.numel(), CHUNK_WORDS)] \
                    if w.dtype == torch.int32 and w.numel() >= 2 * CHUNK_WORDS else [t]
                for part in parts:
                    where.append((i, j))
                    jobs.append((word_sum, (part,)))
        done = self._parallel(jobs, lambda fn, args: fn(*args))
        refs = [[0] * len(own) for _, _, own in batch]
        for (i, j), v in zip(where, done[copies:]):
            refs[i][j] = (refs[i][j] + v) & 0xFFFFFFFF
        with self._cond:
            for (plan, _, _), r in zip(batch, refs):
                plan.refs = [item.wsum if item.wsum is not None else v for item, v in zip(plan.own, r)]
            self._cond.notify_all()

    def _wait_loaded(self, plan: Plan) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while plan.refs is None:
                if self._error is not None or self._closed:
                    raise CommError(f"rank {self.rank}: loading op #{plan.idx} into the host tier failed: "
                                       f"{self._error}")
                if time.monotonic() > deadline:
                    raise CommError(f"rank {self.rank}: op #{plan.idx} was not loaded into the host tier within "
                                       f"{self.timeout_s:.0f} s (reading the trace stalled?); raise comm.timeout_s "
                                       "if the trace's storage is that slow")
                self._cond.wait(0.05)
    def _unpin_tier(self) -> None:
        """Release the tier's page lock once the side stream's copies from it are done."""
        if self._pinned:
            self._side.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._tier.data_ptr())
            self._pinned = False

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
