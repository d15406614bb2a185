"""What replay reads from a captured trace: :class:`RecordedOp` (one rank's op as recorded) and
:class:`Recording`, the read access to a trace that the replay transport, the device path and
the assistant need (the launcher's rank side implements it over a trace directory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nccl_ext.core import wire


@dataclass(frozen=True, slots=True)
class RecordedOp:
    """What the recording holds about one rank's op."""

    op: str
    unit: int
    t_start: float
    t_end: float
    n_tensors: int
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    idx: int = -1
    """The rank's event index: the tag of the assistant's message for this op."""
    kind: str = ""
    """Semantic collective kind (``nccl_ext.core.ops.Collective``), "send" or "recv"."""
    root: int | None = None
    reduce: str | None = None
    """A reduction's operator (``nccl_ext.core.ops.ReduceKind`` value)."""
    digests: tuple[str, ...] = ()
    """Checksum of each contribution tensor's bytes (divergence checks without reading tensors)."""
    stats: tuple[tuple, ...] = ()
    """Of a contribution the trace does not store (``capture.payload=exact`` keeps a sandbox
    rank's own data as statistics only): per piece ``(word sum, L1 norm, max |x|)``
    (:func:`nccl_ext.replay.divergence.piece_stats`); empty when the tensors are stored."""

    @property
    def nbytes(self) -> int:
        return sum(wire.numel(s) * wire.dtype_from_name(d).itemsize for s, d in zip(self.shapes, self.dtypes))


class Recording(Protocol):
    """Read access to a captured trace, as replay needs it."""

    def group_id(self, key: str) -> int | None: ...

    def collective(self, rank: int, group_id: int, seq: int) -> RecordedOp | None: ...

    def contribution(self, rank: int, group_id: int, seq: int) -> list[torch.Tensor]: ...

    def stored(self, rank: int, group_id: int, seq: int) -> bool:
        """Whether ``rank``'s contribution is in the trace (a sandbox-scoped trace keeps only
        statistics of the sandbox ranks' own data and nothing of ops no sandbox rank consumes)."""
        ...

    def sent(self, group_id: int, src: int, dst: int, tag: int, seq: int) -> tuple[RecordedOp, Callable[[], torch.Tensor]] | None:
        """The recorded send and a loader of its payload (None when the trace keeps only its
        statistics: a sandbox rank's own send)."""
        ...

    def received(self, rank: int, group_id: int, src: int, tag: int, seq: int) -> RecordedOp | None: ...

    def group_ranks(self, group_id: int) -> tuple[int, ...]: ...

    def ops_of(self, rank: int) -> list[tuple[RecordedOp, int, int, int, int]]:
        """The rank's communication ops in issue order: (op, group_id, seq, peer, tag)."""
        ...

    def captured_members(self, group_id: int) -> tuple[int, ...]:
        """Members of the group that were captured (all of them unless the capture was folded)."""
        ...

    def folded(self, group_id: int) -> bool:
        """Folded capture: the group has uncaptured members, whose data captured stand-ins
        provided; its results were recorded (:meth:`result`)."""
        ...

    def result(self, rank: int, group_id: int, seq: int) -> list[torch.Tensor]:
        """A folded collective's recorded result for ``rank``."""
        ...

    def piece(self, rank: int, group_id: int, seq: int, i: int) -> torch.Tensor:
        """Piece ``i`` of ``rank``'s recorded contribution."""
        ...

    def result_meta(self, rank: int, group_id: int, seq: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of a folded collective's recorded result (nothing read)."""
        ...

    def result_piece(self, rank: int, group_id: int, seq: int, i: int) -> torch.Tensor: ...

    def payload(self, group_id: int, src: int, dst: int, tag: int, seq: int) -> torch.Tensor:
        """A recorded send's payload."""
        ...
