"""The capture protocol: every message a captured rank sends its coordinator, and every reply,
as a named tuple with field names — one schema for both sides (:mod:`nccl_ext.capture.transport`,
:mod:`prism_launch.capture.coordinator`).

On the wire a message is the plain tuple ``(TAG, *fields)`` (:func:`encode`, :func:`decode`):
these go with every collective of every rank, and a plain tuple pickles several times faster
than a named tuple (which pickles its class by name). Every field is always sent, defaults
included, so :func:`decode` rebuilds the named tuple without calling its constructor.

A connection begins with :class:`Hello` (its first field the sender's :data:`PROTOCOL_VERSION`),
answered :class:`Welcome` or :class:`Refused` (:mod:`nccl_ext.core.handshake`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from nccl_ext.core.errors import ProtocolError

PROTOCOL_VERSION = 2
"""Raised whenever a message's fields or meaning change: a rank and a coordinator of different
versions refuse each other by name at connection instead of misreading fields."""


# -- handshake --------------------------------------------------------------------------------
class Hello(NamedTuple):
    """A rank's first message (its version first, so any version can read it)."""
    version: int
    rank: int
    pid: int


class Welcome(NamedTuple):
    version: int


class Refused(NamedTuple):
    reason: str


# -- rank -> coordinator ------------------------------------------------------------------------
class Park(NamedTuple):
    """The rank blocks on op ``op_id``, which is not complete: its execution slot may go."""
    op_id: int


class Group(NamedTuple):
    key: str
    ranks: tuple
    occurrence: int
    desc: str


class Coll(NamedTuple):
    """A collective whose contribution (if any) rides the socket with the message."""
    op_id: int
    key: str
    seq: int
    api: str
    kind: str
    reduce: str | None
    root: int | None
    contributes: Any
    """True, False, or ``"standin"`` (the tensors are offered for an uncaptured root)."""
    unit: int
    t: float
    wall: float
    cpu: float


class SColl(NamedTuple):
    """A collective the coordinator computes, the contribution staged in the rank's arena."""
    op_id: int
    key: str
    seq: int
    api: str
    kind: str
    reduce: str | None
    root: int | None
    contributes: Any
    unit: int
    t: float
    wall: float
    cpu: float
    location: tuple
    """``(gen, descs)`` in the rank's arena."""


class XColl(NamedTuple):
    """A collective its members compute from each other's staged contributions."""
    op_id: int
    key: str
    seq: int
    api: str
    kind: str
    reduce: str | None
    root: int | None
    contributes: Any
    unit: int
    t: float
    wall: float
    cpu: float
    location: tuple | None
    """Where the contribution lies (host arena or GPU, :mod:`nccl_ext.exchange.ipc`); None: none."""


class Meta(NamedTuple):
    """``payload=none``: a collective the rank synthesized (metadata only)."""
    key: str
    seq: int
    api: str
    kind: str
    reduce: str | None
    root: int | None
    unit: int
    t: float
    wall: float
    cpu: float
    shapes: list
    dtypes: list
    nbytes: int


class Ints(NamedTuple):
    """The values of the rank's small integer contribution to its next op on group ``key`` at
    ``seq`` (:mod:`nccl_ext.core.routing_counts`), sent just before the op's own message."""
    key: str
    seq: int
    values: list


class Outs(NamedTuple):
    """The shapes of the pieces the rank expects from each member at its next all-to-all on group
    ``key`` at ``seq``, sent just before the op when the group has uncaptured members (an
    EP-folded capture sizes their pieces by them: :mod:`prism_launch.capture.ep_fold`)."""
    key: str
    seq: int
    shapes: list


class LColl(NamedTuple):
    """A folded group's collective the rank computed itself (:mod:`nccl_ext.core.mirrored`)."""
    key: str
    seq: int
    api: str
    kind: str
    reduce: str | None
    root: int | None
    unit: int
    t: float
    wall: float
    cpu: float
    shapes: list
    dtypes: list
    nbytes: int
    kept: tuple | None
    """``(op id, contribution location, result location)`` the trace reads, or None."""


class PSend(NamedTuple):
    """``payload=none``: a send (metadata only)."""
    key: str
    peer: int
    tag: int
    seq: int
    unit: int
    t: float
    wall: float
    cpu: float
    shape: list
    dtype: str
    nbytes: int


class PRecv(NamedTuple):
    """``payload=none``: a receive, answered by the rank itself (metadata only)."""
    key: str
    peer: int
    tag: int
    seq: int
    unit: int
    t: float
    wall: float
    cpu: float
    shape: list
    dtype: str
    nbytes: int


class Send(NamedTuple):
    """A send whose tensor rides the socket with the message."""
    op_id: int
    key: str
    dst: int
    tag: int
    seq: int
    unit: int
    t: float
    wall: float
    cpu: float


class XSend(NamedTuple):
    """A send staged in the sender's arena (or GPU) until the receiver has read it."""
    op_id: int
    key: str
    dst: int
    tag: int
    seq: int
    unit: int
    t: float
    wall: float
    cpu: float
    location: tuple


class Recv(NamedTuple):
    op_id: int
    key: str
    src: int
    tag: int
    seq: int
    unit: int
    t: float
    wall: float
    cpu: float


class XRead(NamedTuple):
    """The rank has read op ``op_id``'s staged data (``kept``: where its kept result lies)."""
    op_id: int
    kept: tuple | None = None


class Marker(NamedTuple):
    name: str
    unit: int
    t: float
    wall: float
    cpu: float


class Wait(NamedTuple):
    """Where the rank blocked on an op (``ref``: which), from ``t0`` to ``t1``."""
    ref: tuple
    unit: int
    t: float
    wall: float
    cpu: float
    t0: float | None
    t1: float | None


class Memory(NamedTuple):
    rank: int
    summary: dict


class Stats(NamedTuple):
    """The rank's own counters and seconds by activity, at its close."""
    rank: int
    stats: dict


class Stalled(NamedTuple):
    """The rank's waits on the GPU stopped (:mod:`nccl_ext.capture.deferred_waits`)."""
    rank: int
    what: str


class Bye(NamedTuple):
    rank: int


# -- coordinator -> rank ------------------------------------------------------------------------
class Go(NamedTuple):
    """The rank holds an execution slot."""


class Alive(NamedTuple):
    """Heartbeat: the rank is still queued for a slot."""


class Free(NamedTuple):
    """Every rank has a slot of its own: blocking waits keep it."""


class Mirror(NamedTuple):
    """The rank computes group ``key``'s collectives itself; ``keep``: the trace keeps its data."""
    key: str
    keep: bool


class Ok(NamedTuple):
    """Op ``op_id``'s results, the tensors of the message."""
    op_id: int


class OpFailed(NamedTuple):
    op_id: int
    message: str
    deadline: bool


class XOk(NamedTuple):
    """Every member staged its contribution: where each lies, when the coordinator saw the last,
    and for a folded group's op the ``(group rank, factor)`` terms of the sum."""
    op_id: int
    locations: list
    t: float
    parts: list | None


class SOk(NamedTuple):
    """Op ``op_id``'s result lies in the coordinator's arena at ``location``."""
    op_id: int
    location: tuple


class XRecv(NamedTuple):
    """A receive's tensor lies where its sender staged it."""
    op_id: int
    location: tuple


class XFree(NamedTuple):
    """Every reader is done with the region of op ``op_id``: the rank may free it."""
    op_id: int


RANK_MESSAGES: dict[str, type] = {
    "hello": Hello, "park": Park, "group": Group, "coll": Coll, "scoll": SColl, "xcoll": XColl,
    "meta": Meta, "ints": Ints, "outs": Outs, "lcoll": LColl, "psend": PSend, "precv": PRecv, "send": Send, "xsend": XSend,
    "recv": Recv, "xread": XRead, "marker": Marker, "wait": Wait, "memory": Memory, "stats": Stats,
    "stalled": Stalled, "bye": Bye,
}
"""Every message a rank sends, by wire tag (the coordinator has a handler for each)."""

REPLIES: dict[str, type] = {
    "welcome": Welcome, "refused": Refused, "go": Go, "alive": Alive, "free": Free, "mirror": Mirror,
    "ok": Ok, "failed": OpFailed, "xok": XOk, "sok": SOk, "xrecv": XRecv, "xfree": XFree,
}
"""Every message the coordinator sends, by wire tag."""

HANDSHAKE = (Hello, Welcome, Refused)
"""Messages of the connection's start (:mod:`nccl_ext.core.handshake`)."""

_BY_TAG: dict[str, type] = {**RANK_MESSAGES, **REPLIES}
for _tag, _cls in _BY_TAG.items():
    _cls.TAG = _tag
del _tag, _cls

_new = tuple.__new__


def encode(message: tuple) -> tuple:
    """The wire form of ``message``: a plain tuple, its tag first."""
    return (message.TAG, *message)


def decode(header: tuple) -> tuple:
    """The message ``header`` (from :func:`encode`) carries."""
    try:
        cls = _BY_TAG[header[0]]
    except (KeyError, IndexError, TypeError):
        raise ProtocolError(f"capture protocol: unknown message {header!r:.120} (this side speaks "
                            f"version {PROTOCOL_VERSION})") from None
    if len(header) != len(cls._fields) + 1:
        raise ProtocolError(f"capture protocol: a {header[0]!r} message has {len(header) - 1} fields, "
                            f"version {PROTOCOL_VERSION} has {len(cls._fields)} ({', '.join(cls._fields)})")
    return _new(cls, header[1:])


def check_version(theirs, who: str) -> None:
    """Raise :class:`ProtocolError` naming both versions unless ``theirs`` is this side's."""
    if theirs != PROTOCOL_VERSION:
        raise ProtocolError(
            f"capture protocol version mismatch: {who} speaks version {theirs}, this side version "
            f"{PROTOCOL_VERSION}; run the ranks and the launcher from the same prism-launch installation")
