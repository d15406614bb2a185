"""What the coordinator holds per group and per op in flight, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from nccl_ext.core.ops import Collective, ReduceKind
from nccl_ext.core.ranklist import short_ranks
from prism_launch.errors import CaptureDeadlineError, CaptureError, PayloadBudgetError  # noqa: F401 - re-exported


@dataclass(slots=True)
class OpGroup:
    id: int
    key: str
    ranks: tuple[int, ...]
    occurrence: int
    desc: str
    sources: tuple[int, ...] | None = None
    """Folded capture: the captured stand-in of every member (None: all members captured)."""
    present: int = 0
    """Members that run in this capture."""
    consumed: bool = True
    """A sandbox-scoped capture: a sandbox rank is a member (else nothing of the group is stored)."""


@dataclass(slots=True)
class Arrival:
    rank: int
    op_id: int
    conn: Connection
    row: dict
    staged: bool = False
    """The member staged its contribution (``scoll``): its result is staged too."""


@dataclass(slots=True)
class PendingCollective:
    group: OpGroup
    seq: int
    api: str
    kind: Collective
    reduce: ReduceKind | None
    root: int | None
    first_t: float
    contributions: list[list[torch.Tensor] | None]
    arrivals: dict[int, Arrival] = field(default_factory=dict)
    standins: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Folded capture: members' own buffers offered for an uncaptured broadcast root."""
    locations: dict[int, tuple] | None = None
    """Exchanged through shared memory: each contributing member's ``(rank, gen, descs)``."""
    held: list = field(default_factory=list)
    """Notes of contributions staged on a GPU: taken once every member has read (their host
    copies are complete by then)."""


@dataclass(slots=True)
class Reads:
    """An exchanged collective whose members are reading each other's regions."""
    left: int
    owners: list[tuple[Connection, int]]
    notes: list = field(default_factory=list)
    """(function, arguments) of the trace's notes to take once every member has read."""
    result_key: str | None = None
    """A folded group's op: the prefix of the results the trace keeps (``r/<group>/<seq>``), which
    the members in its scope stage and name in their ``xread``."""


def describe(ranks: tuple[int, ...]) -> str:
    return short_ranks(ranks)


class Lags:
    """Where a capture's coordinator answers late, by what (``note(what, seconds)``):
    ``between_pumps`` (the launcher's own work between two pumps, when no message is read),
    ``pump`` (one pump), ``handle_<message>`` and ``drain`` (parts of a pump), ``arrival`` (an
    op at the coordinator after its rank issued it), ``spread`` (a collective's last member
    after its first): the longest (with what it was, where the caller names it), and how many
    (and how long in all) took 10 ms or more."""

    SLOW_S = 0.01

    def __init__(self) -> None:
        self._max: dict[str, float] = {}
        self._slow: dict[str, list] = {}
        self._worst: dict[str, str] = {}

    def note(self, what: str, seconds: float, detail: str | None = None) -> None:
        if seconds > self._max.get(what, -1.0):
            self._max[what] = seconds
            if detail is not None:
                self._worst[what] = detail
        if seconds >= self.SLOW_S:
            cell = self._slow.setdefault(what, [0, 0.0])
            cell[0] += 1
            cell[1] += seconds

    def to_dict(self) -> dict:
        return {what: {"max_s": round(m, 4), "over_10ms": self._slow.get(what, [0, 0.0])[0],
                       "over_10ms_s": round(self._slow.get(what, [0, 0.0])[1], 3),
                       **({"longest": self._worst[what]} if what in self._worst else {})}
                for what, m in self._max.items()}


def op_label(message: tuple) -> str:
    """What a rank's message to the coordinator was (:mod:`nccl_ext.core.protocol`), for
    :class:`Lags`: its kind, and for a collective (``coll``, ``xcoll``, ``scoll``...) its call,
    group and sequence number."""
    api = getattr(message, "api", None)
    if api is not None:
        return f"{message.TAG} {api} seq {message.seq} on group {message.key}"
    return message.TAG
