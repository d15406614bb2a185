"""Object collectives whose root a folded capture does not run.

``broadcast_object_list`` and ``scatter_object_list`` send pickles that only the root's program
makes. In a folded capture a root that is not captured has no program: its captured stand-in
takes part as a receiver, so the "root's data" would be the stand-in's own receive buffers
(object sizes never set, zero bytes) and the receiver's unpickling fails far from the cause
("UnpicklingError: invalid load key, '\\x00'"). Seen on the H200 with upstream Megatron-LM
``pretrain_gpt.py --save … --ckpt-format torch_dist`` at 1,024 ranks: torch.distributed.checkpoint
gathers every rank's save plan to rank 0, which scatters the global plan back.

:func:`guard` wraps both functions so that such a call fails at once, naming the root and the
fix (capture that rank too, or capture unfolded). Tensor broadcasts are left alone: a
stand-in's own buffer is the root's data when the root's program would compute the same
thing (Megatron's replicated broadcasts). Checked against torch 2.11 and 2.13 (keyword
``src`` or ``group_src``, either positional after the object list).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from nccl_ext.core.errors import UncapturedRootError

_NAMES = ("broadcast_object_list", "scatter_object_list")


def _root(fn: Callable, name: str, args: tuple, kwargs: dict) -> int:
    """The root's global rank of a call of ``fn``."""
    bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    group = bound.get("group")
    src, group_src = bound.get("src"), bound.get("group_src")
    if group_src is not None:
        return dist.get_global_rank(group or c10d._get_default_group(), group_src)
    return 0 if src is None else int(src)


def guard(captured: Callable[[], frozenset[int] | None], rank: Callable[[], int]) -> None:
    """Wrap the object collectives of ``torch.distributed``; ``captured()`` is the set of ranks
    the capture runs (None: not a folded capture, nothing is checked)."""
    for name in _NAMES:
        real = getattr(c10d, name)
        if getattr(real, "_prism_object_root_guard", False):
            continue

        @functools.wraps(real)
        def wrapper(*args, _real=real, _name=name, **kwargs):
            ranks = captured()
            if ranks is not None:
                src = _root(_real, _name, args, kwargs)
                if src not in ranks:
                    me = rank()
                    raise UncapturedRootError(
                        f"rank {me}: {_name} from rank {src}, which this folded capture does not run: "
                        f"nothing computes the objects rank {src} sends (its captured stand-in only holds "
                        f"receive buffers). Capture rank {src} too: add it to the sandbox ranks "
                        f"(sandbox.ranks=[{src},{me}]), or capture without folding (capture.fold=false). "
                        "torch.distributed.checkpoint saves do this (Megatron-LM's --ckpt-format torch_dist "
                        "scatters its save plan from rank 0)."
                    )
            return _real(*args, **kwargs)

        wrapper._prism_object_root_guard = True
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)
