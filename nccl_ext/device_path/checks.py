"""Divergence checks without a host copy: each live contribution's 32-bit word sum is taken on
the device into a slot of the pool (:class:`DeviceChecks`); the slots are read — one
synchronisation — at the step boundary and compared with the same sum of the recorded
tensors (:func:`word_sum`), which the host tier's loader or the stager computes. A floating
contribution's L1 norm goes into a second slot beside it: what tells a non-deterministic
kernel's rounding from a value divergence (``nccl_ext/replay/divergence.py``) for the few that mismatch."""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_WORDS = 1 << 21
"""Host-side copies and sums are split into pieces of this many 32-bit words (8 MiB)."""
CHECK_SLOTS = 4096
"""Checks queued on the device before they are read (a flush)."""
SLOT_BYTES = CHECK_SLOTS * (4 + 8)
"""Pool bytes of the checks: an int32 word sum and a float64 L1 norm per slot."""


def as_words(t: torch.Tensor) -> torch.Tensor:
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
    w = as_words(t)
    if not w.numel():
        return 0
    import numpy as np  # sums outside torch's allocator (the hook charges the program for those)

    if w.dtype == torch.int32:  # wrapping 32-bit adds: the same value mod 2**32, no widening pass
        return int(w.numpy().view(np.uint32).sum(dtype=np.uint32))
    return int(w.numpy().sum(dtype=np.int64)) & 0xFFFFFFFF


def chunked_word_sum(t: torch.Tensor, parallel: Callable[[list, Callable], list]) -> int:
    """:func:`word_sum` of a large int32-word tensor in :data:`CHUNK_WORDS` parts, summed by
    ``parallel`` (the path's helper threads)."""
    w = as_words(t)
    if w.dtype != torch.int32 or w.numel() < 2 * CHUNK_WORDS:
        return word_sum(t)
    parts = [(w[s:s + CHUNK_WORDS],) for s in range(0, w.numel(), CHUNK_WORDS)]
    return sum(parallel(parts, word_sum)) & 0xFFFFFFFF


class DeviceChecks:
    """The queued checks of one device path: live word sums in ``slots`` (int32 device memory
    of the pool, set when it is allocated), each with its reference sum and where it was taken."""

    def __init__(self, stats):
        self.stats = stats
        """The path's :class:`~nccl_ext.device_path.stats.PrefetchStats` (checks and flushes)."""
        self.slots: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None
        self._checks: list[tuple[int, object, int, torch.dtype, int]] = []
        self._bad: list[object] = []

    def attach(self, region: torch.Tensor) -> None:
        """Take the checks' slots from ``region`` (:data:`SLOT_BYTES` uint8 of the pool, 8-aligned)."""
        self.slots = region[:CHECK_SLOTS * 4].view(torch.int32)
        self.norms = region[CHECK_SLOTS * 4:SLOT_BYTES].view(torch.float64)

    def verify(self, live: list[torch.Tensor], refs: list[int], where: object) -> None:
        """Queue the word sums of ``live`` for comparison with ``refs`` at the next flush."""
        numel = sum(t.numel() for t in live)
        for i, (t, ref) in enumerate(zip(live, refs)):
            w = as_words(t)
            if not w.numel():
                continue
            if len(self._checks) == CHECK_SLOTS:
                self._flush_pending()
            slot = self.slots[len(self._checks)]
            if t.dtype.is_floating_point:  # one reduction kernel, no temporary beside its 0-d result
                # half/bf16 on CUDA accumulate and return float32 without a cast copy of the input
                # (torch's reduction kernels read low precision into a float32 output directly)
                low = t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)
                norm = torch.linalg.vector_norm(t.detach(), 1, dtype=torch.float32 if low else None)
                self.norms[len(self._checks)].copy_(norm if norm.device == slot.device else norm.to(slot.device))
            if w.device != slot.device:  # an op on host tensors while the pool is on the GPU
                v = word_sum(t)
                slot.fill_(v - (1 << 32) if v >= 1 << 31 else v)
            elif w.dtype == torch.int32:
                torch.sum(w, dim=0, dtype=torch.int32, out=slot)
            else:
                slot.copy_(w.to(torch.int64).sum())
            self._checks.append((ref, where, i, t.dtype, numel))
            self.stats.checks += 1

    def _flush_pending(self) -> None:
        self._bad += self.flush()

    def flush(self) -> list[tuple[object, int, torch.dtype, int, float | None]]:
        """Compare the queued checks (one device synchronisation). For each mismatch: its
        ``where``, the piece's index, dtype, the op's element count and the live piece's L1 norm
        (None for integer data)."""
        bad, self._bad = self._bad, []
        if not self._checks:
            return bad
        values = self.slots[: len(self._checks)].cpu().tolist()
        norms = self.norms[: len(self._checks)].cpu().tolist()
        self.stats.check_flushes += 1
        for value, norm, (ref, where, i, dtype, numel) in zip(values, norms, self._checks):
            if value & 0xFFFFFFFF != ref:
                bad.append((where, i, dtype, numel, norm if dtype.is_floating_point else None))
        self._checks = []
        return bad

