"""Where a captured rank stands, shared by its transport and the collaborators that act on it
(:mod:`nccl_ext.capture.deferred_waits`, :mod:`nccl_ext.capture.rank_exchange`): the program's
step, whether the coordinator let it keep its slot for good, whether it has closed."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class RankProgress:
    rank: int
    unit: int = 0
    """The program's step (``marker("step")`` counts them)."""
    unparked: bool = False
    """The coordinator said every rank has a slot of its own (``free``): blocking waits keep it."""
    closed: threading.Event = field(default_factory=threading.Event)
    """Set once the rank closes or its coordinator connection is gone."""
