"""The device-memory ledger: buffers the communication layer holds on a device outside what the
program is charged for (the device path's pool, the GPU exchange's buffers), so memory accounting
leaves them out."""

from __future__ import annotations

import torch


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


def allocate_outside(device: torch.device, nbytes: int) -> torch.Tensor:
    """A further buffer of ``nbytes`` on the CUDA ``device`` left out of the program's memory
    figures like the pool (its charged size is added to :func:`pool_bytes`)."""
    capacity = charged_size(nbytes)
    buf = torch.empty(capacity, dtype=torch.uint8, device=device)
    key = str(device)
    _POOL_BYTES[key] = _POOL_BYTES.get(key, 0) + capacity
    return buf


def release_outside(buf: torch.Tensor) -> None:
    """Undo :func:`allocate_outside` for ``buf`` (dropped by its caller): its size is no longer
    left out of the program's memory figures."""
    key = str(buf.device)
    _POOL_BYTES[key] = max(0, _POOL_BYTES.get(key, 0) - buf.numel() * buf.element_size())
