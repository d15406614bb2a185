"""Writing a collective's results into the caller's tensors (what a real backend's kernels do)."""

from __future__ import annotations

import torch

from nccl_ext.core.errors import CommError


def same(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``src`` already is ``dst``'s memory (a result written in place)."""
    return dst.data_ptr() == src.data_ptr() and dst.numel() == src.numel() and dst.dtype == src.dtype \
        and src.is_contiguous() and dst.is_contiguous()


def raw(dst: torch.Tensor) -> torch.Tensor:
    """``dst``'s memory under a tensor of its own: writing it leaves ``dst``'s version counter as
    it is, as a real backend's kernels do. A result written after the program went on past its
    wait (:mod:`nccl_ext.capture.deferred_waits`) — into a tensor autograd saved meanwhile, such as
    Megatron's attention mask broadcast within its tensor-parallel group — would otherwise fail
    the backward pass ("modified by an inplace operation")."""
    return torch.empty((0,), dtype=dst.dtype, device=dst.device).set_(
        dst.untyped_storage(), dst.storage_offset(), dst.size(), dst.stride())


def no_grad_copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.numel() != src.numel():
        raise CommError(f"{what}: result has {src.numel()} elements, output tensor has {dst.numel()}")
    if same(dst, src):
        return
    with torch.no_grad():
        raw(dst).copy_(src.reshape(dst.shape))


def own_copies(value):
    """Copies of a result's tensors (a transport's results that it reuses after the op)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(own_copies(v) for v in value)
    return value


HOST_CAT_BYTES = 4 << 20
"""Host pieces of a result up to this size in all are joined on the host and copied to the
device once."""


def copy_pieces(dst: torch.Tensor, pieces, what: str) -> None:
    """Write ``pieces`` back to back into ``dst`` without a temporary concatenation on its device."""
    total = sum(p.numel() for p in pieces)
    if dst.numel() != total:
        raise CommError(f"{what}: result has {total} elements, output tensor has {dst.numel()}")
    dst = raw(dst)
    flat = dst.view(-1) if dst.is_contiguous() else None
    with torch.no_grad():
        if flat is not None and dst.device.type != "cpu" and len(pieces) > 1 \
                and total * dst.element_size() <= HOST_CAT_BYTES and all(p.device.type == "cpu" for p in pieces):
            # many small host pieces (a folded all-gather's result: one per member) reach the
            # device in one copy, not one each
            flat.copy_(torch.cat([p.reshape(-1) for p in pieces]))
            return
        if flat is None:
            dst.copy_(torch.cat([p.reshape(-1) for p in pieces]).reshape(dst.shape))
            return
        offset = 0
        for p in pieces:
            k = p.numel()
            flat[offset : offset + k].copy_(p.reshape(-1))
            offset += k
