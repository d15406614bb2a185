"""One collective as a member enters it: what the process group hands every transport."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nccl_ext.core.ops import Collective, ReduceKind


@dataclass(slots=True)
class CollectiveCall:
    """One collective as a member enters it."""

    api: str
    """The torch ProcessGroup method (e.g. ``all_gather_single``)."""
    kind: Collective
    tensors: list[torch.Tensor] | None
    """This member's contribution; ``None`` when it contributes nothing."""
    reduce: ReduceKind | None = None
    root: int | None = None
    """Group rank of the root for rooted ops."""
    standin: list[torch.Tensor] | None = None
    """A non-root's own buffers of a broadcast: what a folded capture uses as the root's data
    when the root is not captured and this member stands in for it."""
    outputs: list[torch.Tensor] | None = None
    """The caller's output tensors where they are not its inputs (reduce-scatter, all-to-all
    pieces by source, scatter): where a transport that computes results on the spot
    (:mod:`nccl_ext.core.synth`) writes them."""
