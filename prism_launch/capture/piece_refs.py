"""Pieces of a staged contribution named, not yet viewed: the coordinator's thread reads only
their shapes and dtypes (the trace's rows); the views of the rank's arena (or, where only its GPU
holds the data, meta tensors) are made on the worker threads that digest or copy them. A view
costs several torch calls, each a chance for another thread to take the interpreter from the
coordinator, which answers every rank."""

from __future__ import annotations

import torch

from nccl_ext.core import wire


class PieceRef:
    """Piece ``(offset, dtype, shape)`` of ``rank``'s arena generation ``gen`` (``views``: the
    coordinator's :class:`~nccl_ext.exchange.arena.PeerViews`; None: only the rank's GPU has it)."""

    __slots__ = ("dtype", "shape", "_views", "_where")

    def __init__(self, views, rank: int, gen: int, offset: int, dtype: str, shape) -> None:
        self.dtype = wire.dtype_from_name(dtype)
        self.shape = tuple(int(d) for d in shape)
        self._views = views
        self._where = (rank, gen, offset, dtype)

    def numel(self) -> int:
        return wire.numel(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        if self._views is None:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        rank, gen, offset, dtype = self._where
        return self._views.view(rank, gen, offset, dtype, self.shape)


def refs(views, rank: int, gen: int, descs) -> list[PieceRef]:
    """The pieces of a location's ``descs`` (``[(offset, dtype, shape)]``); the arena's generation
    is mapped now, while the rank that owns it runs (it removes the file at its exit)."""
    if views is not None and descs:
        views.hold(rank, gen)
    return [PieceRef(views, rank, gen, off, dt, shape) for off, dt, shape in descs]


def materialized(tensors) -> list[torch.Tensor]:
    """``tensors`` with each :class:`PieceRef` made a tensor (on the thread that reads them)."""
    return [t.tensor() if isinstance(t, PieceRef) else t for t in tensors]
