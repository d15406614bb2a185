"""Staging: ops' data moved into the device pool ahead of them, in the trace's order, by the
prefetch mode (``emulate.prefetch.mode``) — and handed to each op as it is entered
(:meth:`Stager.take`).

* ``stream``: a stager thread stages ops while they fit in the pool, from the host tier (one
  DMA per run of ops back to back) or through a pinned mirror of the pool, on a side stream;
  the op's stream waits for that copy's event only, the host only when the stager is behind
  (a *stall*). Once the pool is full it refills in batches, a quarter of the pool at a time.
* ``inline``: the program's own thread issues the copies from the host tier as it enters ops,
  one op at a time (no stager thread, no batches).
* ``off``: each op is staged when it is entered, on the op's stream.
* ``preload``: the whole run is staged before the first op (no virtual-peer data movement
  during the run at all); ``stream`` and ``inline`` do the same with a grown pool.
"""

from __future__ import annotations

import time

import torch

from nccl_ext.core import wire
from nccl_ext.core.errors import CommError, DivergenceError
from nccl_ext.device_path.host_tier import chunks
from nccl_ext.device_path.plan import Plan, StagedOp
from nccl_ext.device_path.pool import strides
from nccl_ext.device_path.stats import PrefetchMode

BATCH_OPS = 64
"""Most ops the stager stages per wake-up."""


class Stager:
    """The staging part of :class:`~nccl_ext.device_path.DevicePath` (a base class of it).

    Owns the queues of ops — ``_plans`` (not staged yet), ``_ready`` (staged, not entered),
    ``_taken`` (handed over, space not yet given back), ``_released`` (events reuse of given-back
    space waits for) —, the stager ``_thread``, ``_inline``, ``_mirror``, ``_typed`` and the
    staging figures of ``stats``. Uses the path's pool (``_pool``, ``_space``, ``_refill_at``,
    ``_side``), its lock ``_cond``, ``_error``, ``_closed``, the host tier (``_tier``,
    ``_wait_loaded``, ``_from_tier``) and ``_start``, ``_parallel``, ``_word_sum``.
    """

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
                    while self._plans and len(batch) < BATCH_OPS:
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

    def _room(self, plan: Plan) -> bool:
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
        return typed.as_strided(shape, strides(shape), at // dtype.itemsize)

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
            staged.scratch = [self._view(at + off, s, d) if wire.numel(s) else
                              torch.empty(s, dtype=d, device=self._pool.device)
                              for (s, d), off in zip(plan.scratch, plan.offsets[len(items):])]
        k = 0
        for m, ps in plan.terms.items():
            staged.terms[m] = dict(zip(ps, views[k:k + len(ps)]))
            k += len(ps)
        staged.result = views[k:]
        staged.plan = None
        return staged

    def _stage(self, plan: Plan, *, on_side: bool, spans: tuple | None = None,
               released: list | None = None) -> StagedOp:
        """Stage one op (preload, prefetch off, or no host tier)."""
        if spans is None:
            with self._cond:
                spans = self._space.alloc(plan)
            if spans is None:
                raise CommError(f"rank {self.rank}: prefetch pool full staging op #{plan.idx}")
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
                staged.refs = [item.wsum if item.wsum is not None else self._word_sum(item.load()) if item.nbytes else 0
                               for item in plan.own]
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
            work += chunks(self._mirror[at:at + src.numel()], src)
        self._parallel(work, lambda a, b: a.copy_(b))
        with torch.cuda.stream(self._side):
            if end > start:
                self._pool[start:end].copy_(self._mirror[start:end], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side)
        return ready

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
                raise DivergenceError(f"{what}: not in the trace's order of this rank's ops; the program diverged")
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
                    raise CommError(f"rank {self.rank}: prefetch pool full staging op #{plan.idx}")
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
                    raise CommError(f"{what}: prefetch failed: {self._error}") from self._error
                if self._inline or not self._plans and (self._thread is None or not self._thread.is_alive()):
                    break  # nothing more will be staged for this op
                if time.monotonic() - t0 > self.timeout_s:
                    raise CommError(f"{what}: the prefetcher did not stage this op within {self.timeout_s:.0f} s")
                waited = True
                self._cond.wait(0.05)
            staged = self._ready.popleft() if self._ready and self._ready[0].idx == idx else None
            if not self._ready:
                self._cond.notify_all()  # the stager may be holding off until the pool drains
        if staged is None:
            raise DivergenceError(f"{what}: not in the trace's order of this rank's ops; the program diverged")
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

