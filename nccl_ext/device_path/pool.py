"""The device pool: one allocation of device memory (host memory on CPU) that the run's staged
data and reduction scratch pass through, FIFO like the ops.

:class:`Space` splits it into two rings (:class:`Ring`): staged bytes — consecutive ops back to
back, as in the host tier, so a batch of them moves in one copy — and scratch, where
reductions fold. :func:`split_pool` sizes the rings (the whole run when it is preloaded or the
device can spare it); :func:`allocate` takes the memory outside what the program is charged
for, in whole allocator segments (:func:`charged_size`), and publishes its size
(:func:`pool_bytes`) so memory accounting leaves it out; a memory cap of the target GPU is
widened by it first.
"""

from __future__ import annotations

from collections import deque

import torch

from nccl_ext.core import wire
from nccl_ext.core.device_memory import _POOL_BYTES, charged_size, pool_bytes
from nccl_ext.device_path.plan import Plan, StagedOp, aligned
from nccl_ext.device_path.stats import PrefetchMode

def allocate(device: torch.device, capacity: int, memory_limit_bytes: int = 0) -> torch.Tensor:
    """A pool of ``capacity`` bytes on ``device``, outside what the program is charged for; a
    memory cap of the target GPU (``memory_limit_bytes``, 0: none) is widened by it first so the
    pool itself never trips it. Its size is published for :func:`pool_bytes`."""
    cuda = device.type == "cuda"
    if cuda:
        capacity = charged_size(capacity)
        if memory_limit_bytes > 0:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, (memory_limit_bytes + capacity) / total), device)
        pool = torch.empty(capacity, dtype=torch.uint8, device=device)
    else:
        pool = wire.untracked_empty((capacity,), torch.uint8)
    _POOL_BYTES[str(device if cuda else torch.device("cpu"))] = capacity
    return pool


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` (a view of the typed pool at an offset)."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(1, int(d))
    return tuple(reversed(out))


class Ring:
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


class Space:
    """The pool's two FIFO rings: staged bytes (consecutive ops sit back to back, as in the
    host tier, so a batch of them moves in one copy) and scratch (where reductions fold)."""

    def __init__(self, data: int, scratch: int):
        self.data, self.scratch = Ring(data), Ring(scratch)
        self.scratch_base = data
        """Pool offset of the scratch ring."""

    @property
    def capacity(self) -> int:
        return self.data.capacity + self.scratch.capacity

    def used(self) -> int:
        return self.data.used() + self.scratch.used()

    def fits(self, plan: Plan) -> bool:
        return (not plan.staged_nbytes or self.data.fits(plan.staged_nbytes)) and \
            (not plan.scratch_nbytes or self.scratch.fits(plan.scratch_nbytes))

    def alloc(self, plan: Plan) -> tuple[tuple[int, int] | None, tuple[int, int] | None] | None:
        if not self.fits(plan):
            return None
        return (self.data.alloc(plan.staged_nbytes) if plan.staged_nbytes else None,
                self.scratch.alloc(plan.scratch_nbytes) if plan.scratch_nbytes else None)

    def release(self, op: StagedOp) -> None:
        if op.span is not None:
            self.data.release(op.span)
        if op.scratch_span is not None:
            self.scratch.release(op.scratch_span)


def split_pool(mode: str, plans: list[Plan], requested: int, spare: int | None) -> tuple[int, int, bool]:
    """The pool's data and scratch rings (aligned bytes) and whether it was grown: the whole
    run's bytes for ``preload``, and for ``stream``/``inline`` when ``spare`` (device memory it
    may take) holds them (the caller then fills it before the first op); else ``requested``
    split between the rings as the run's bytes are, each at least twice its largest op."""
    staged = sum(p.staged_nbytes for p in plans)
    scratch = sum(p.scratch_nbytes for p in plans)
    whole = aligned(staged) + aligned(scratch)
    if mode == PrefetchMode.PRELOAD:
        return aligned(staged), aligned(scratch), False
    big_d = max((p.staged_nbytes for p in plans), default=0)
    big_s = max((p.scratch_nbytes for p in plans), default=0)
    work = max(2 * big_s, requested * scratch // max(1, staged + scratch))
    data = max(2 * big_d, requested - work)
    data, work = aligned(data), aligned(work)
    if mode in PrefetchMode.STREAMING and spare is not None and data + work < whole <= spare:
        return aligned(staged), aligned(scratch), True
    return data, work, False

