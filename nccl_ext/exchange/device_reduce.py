"""A captured rank's result of an exchanged collective, computed on its GPU.

The members' contributions lie in host arenas (:mod:`nccl_ext.exchange.arena`); a rank whose tensors
are on a GPU takes the pieces its result needs from its peers' arenas straight into a device
scratch buffer (one host-to-device copy each), uses its own contribution where it already is,
and folds there — the same :func:`nccl_ext.core.ops.fold`, left to right in group-rank order, whose
every step is one elementwise IEEE operation, so the bits are those of the host fold (and of the
sandbox's fold at emulation). What it saves against a host fold: the host arithmetic, a copy of
every piece that is not a reduction's, and the result's trip back to the device.

The work runs on a stream of its own; :meth:`DeviceFold.finish` waits for it once the results
are in the program's tensors, before the program is woken, so whatever stream the program uses
reads finished data. The copies from the peers' pieces are asynchronous: their regions may be
freed only after :meth:`DeviceFold.finish`. The scratch is reused by the next op: a result is
valid until then.
"""

from __future__ import annotations

import time

import torch

from nccl_ext.core.ops import Collective, ReduceKind, compute, fold

SCRATCH_BYTES = 64 << 20
"""Device scratch of a rank's exchanged results (outside the program's memory figures). An op
whose pieces do not fit is folded on the host, as on CPU."""

_ALIGN = 512

REDUCTIONS = (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)


class DeviceFold:
    """One rank's device scratch and stream for exchanged results on ``device``."""

    def __init__(self, device: torch.device, nbytes: int = SCRATCH_BYTES):
        self.device = device
        if device.type == "cuda":
            from nccl_ext.core.device_memory import allocate_outside

            self.buf = allocate_outside(device, nbytes)
            self.stream = torch.cuda.Stream(device)
        else:  # the same arithmetic in host memory (tests)
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            self.stream = None
        self._at = 0
        self.device_ops = 0
        self.host_ops = 0
        """Ops whose pieces did not fit the scratch (folded on the host)."""
        self.finish_s = 0.0
        """Seconds :meth:`finish` waited for the stream."""

    def _take(self, like: torch.Tensor) -> torch.Tensor | None:
        n = like.numel() * like.element_size()
        start = -(-self._at // _ALIGN) * _ALIGN
        if start + n > self.buf.numel():
            return None
        self._at = start + n
        return self.buf[start:start + n].view(like.dtype).view(like.shape)

    def _on_device(self, t: torch.Tensor, own: set[int]) -> torch.Tensor | None:
        if id(t) in own:
            return t
        out = self._take(t)
        if out is not None:
            # ordered before the fold on the stream; the source stays mapped until :meth:`finish`
            out.copy_(t, non_blocking=True)
        return out

    def results(self, kind: Collective, contributions: list, me: int, *, reduce: ReduceKind | None = None,
                root: int | None = None) -> list[torch.Tensor] | None:
        """Member ``me``'s result tensors on the device, given every member's contribution in
        group-rank order (host views of the peers' pieces, ``me``'s own on the device — used
        where it is —, None where a member contributes nothing); None when the pieces do not fit the scratch (the caller
        folds on the host). Call inside ``torch.cuda.stream(self.stream)``."""
        self._at = 0
        own = {id(t) for t in contributions[me] or ()}
        out = self._reduced(kind, contributions, me, reduce, root, own) if kind in REDUCTIONS else \
            self._moved(kind, contributions, me, root, own)
        if out is None:
            self.host_ops += 1
        else:
            self.device_ops += 1
        return out

    def _reduced(self, kind, contributions, me, reduce, root, own) -> list[torch.Tensor] | None:
        n = len(contributions)
        if kind is Collective.REDUCE and me != root:
            return []
        if kind is Collective.REDUCE_SCATTER:
            k = len(contributions[0]) // n
            indices = [i * n + me for i in range(k)]
        else:
            indices = range(len(contributions[0]))
        out = []
        for idx in indices:
            terms = [c[idx] for c in contributions]
            acc = self._take(terms[0])
            if acc is None:
                return None
            rest = [self._on_device(t, own) for t in terms[1:]]
            if any(t is None for t in rest):
                return None
            out.append(fold(reduce, [terms[0], *rest], out=acc))  # the first term is copied into acc
        return out

    def _moved(self, kind, contributions, me, root, own) -> list[torch.Tensor] | None:
        out = []
        for t in compute(kind, contributions, root=root)[me]:
            d = self._on_device(t, own)
            if d is None:
                return None
            out.append(d)
        return out

    def finish(self) -> None:
        """Wait until the stream's work — the fold and the copies into the program's tensors —
        is done."""
        if self.stream is not None:
            t0 = time.perf_counter()
            self.stream.synchronize()
            self.finish_s += time.perf_counter() - t0


def gpu_results(fold: DeviceFold, kind: Collective, views: list, me: int, reduce: ReduceKind | None,
                root: int | None) -> list[torch.Tensor]:
    """Member ``me``'s results on ``fold``'s device from every member's pieces (on the device or
    on the host): in the scratch, or, where they do not fit it, computed by :func:`compute` on
    the device (on the current stream)."""
    out = fold.results(kind, views, me, reduce=reduce, root=root)
    if out is not None:
        return out
    views = [None if v is None else [t.to(fold.device, non_blocking=True) for t in v] for v in views]
    return compute(kind, views, reduce=reduce, root=root)[me]
