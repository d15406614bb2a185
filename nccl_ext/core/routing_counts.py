"""Small integer collectives, recorded by value in every payload mode.

A MoE token dispatcher exchanges how many tokens each rank routes to every expert before it
moves the tokens (megatron-core's alltoall dispatcher all-gathers ``num_local_tokens_per_expert``,
an int64 ``[num_experts]``; DeepSpeed's exchanges its counts with an all-to-all). Those few
integers are what routing statistics need, and a trace that keeps no tensors (``payload=none``)
or only a sandbox rank's consumption (``exact``) would otherwise lose them. So a captured rank
sends the values of every small integer contribution to an all-gather, all-reduce or
all-to-all with the op (:class:`nccl_ext.core.protocol.Ints`), whatever the payload policy;
the trace keeps them in the event's ``extra["ints"]``. Nothing here knows about MoE: what
reads them decides what they mean.

Some dispatchers exchange no counts: DeepSpeed's ``MOELayer`` all-to-alls a fixed capacity per
expert, its gate's counts stay on the rank. An integration hands such counts to
:func:`attach` (from a forward hook, reading what the program computed anyway); they travel
as the ``ints`` of the rank's next all-to-all whose own contribution is no integer counts —
the dispatch that follows the gate — and the program issues nothing more. Several attachments
(a gate's counts, a router's auxiliary losses) travel together, one list each; a later one with
the same key replaces an earlier one.
"""

from __future__ import annotations

import torch

from nccl_ext.core import host_read
from nccl_ext.core.ops import Collective

INTS_MAX_BYTES = 4096
"""Contributions of at most this many bytes (all tensors together) are recorded by value:
a count per expert for up to 512 experts in int64."""

EP_GROUPS = ("EXPERT_MODEL_PARALLEL", "EXPERT_TENSOR_AND_MODEL_PARALLEL", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL",
             "DEEPSPEED_EXPERT_PARALLEL")
"""Substrings of the descriptions of expert-parallel groups (megatron-core's names, and the
label :mod:`integrations.deepspeed_compat` gives DeepSpeed's); :data:`EP_PROPER` name the EP
groups proper, whose member order gives a rank's EP position."""

EP_PROPER = ("EXPERT_MODEL_PARALLEL", "DEEPSPEED_EXPERT_PARALLEL")
"""The EP groups proper among :data:`EP_GROUPS` (megatron-core's combined expert groups also
contain ``EXPERT_MODEL_PARALLEL`` in their names: :func:`is_ep_proper` excludes them)."""


def is_expert_parallel(desc: str) -> bool:
    return any(p in (desc or "") for p in EP_GROUPS)


def is_ep_proper(desc: str) -> bool:
    """Whether ``desc`` names an EP group proper (not one combined with tensor or pipeline parallelism)."""
    desc = desc or ""
    return any(p in desc for p in EP_PROPER) and not any(p in desc for p in EP_GROUPS if p not in EP_PROPER)


_attached: dict = {}
"""What integrations attached to the rank's next all-to-all (:func:`attach`), by key, in order:
``(values, tensors)``, ``values`` a list of small integers, or with ``tensors`` a function of
their values (read when the all-to-all is issued, all at once, when the dispatcher has
synchronised on its split sizes anyway)."""


def attach(values, key=None, tensors=None) -> None:
    """Send ``values`` (small integers) as one of the ``ints`` of this rank's next all-to-all
    whose own contribution is no integer counts (module doc); with ``tensors``, ``values`` is a
    function of their values (one flat list per tensor) returning the integers, called when
    that all-to-all is issued. It replaces an earlier attachment of the same ``key`` (default:
    the first value, a tag) not yet sent. Only a capturing transport consumes them."""
    if tensors is None:
        values = [int(v) for v in values]
        if key is None and values:
            key = values[0]
    _attached[key] = (values, list(tensors) if tensors is not None else None)


def take_attached() -> list[list[int]] | None:
    """The attached lists, once (None when there are none); the device values of all of them
    are read together (one wait, :func:`nccl_ext.core.host_read.read`)."""
    if not _attached:
        return None
    items = list(_attached.values())
    _attached.clear()
    flat = [t for _v, ts in items if ts is not None for t in ts]
    read = iter(host_read.read(flat)) if flat else iter(())
    out = []
    for values, ts in items:
        if ts is not None:
            values = values([next(read) for _ in ts])
        out.append([int(v) for v in values])
    return out


def carried_counts(kind: Collective, tensors, desc: str) -> bool:
    """Whether a ``payload=none`` capture computes this op for real instead of synthesizing it:
    an all-gather of small integer counts on an expert-parallel group (the dispatcher's tokens
    per expert), so that every EP rank's all-to-all sizes follow real routing (the captured
    routers', for uncaptured members of an EP-folded capture) instead of n times its own."""
    return kind is Collective.ALL_GATHER and is_expert_parallel(desc) and small_ints(kind, tensors, read=False)


_KINDS = (Collective.ALL_GATHER, Collective.ALL_REDUCE, Collective.ALL_TO_ALL)
_COUNT_DTYPES = (torch.int64, torch.int32, torch.int16)


def small_ints(kind: Collective, tensors, read: bool = True):
    """The values of ``tensors`` (one flat list per tensor) when they form a small integer
    contribution to a collective that exchanges counts, else None (``read=False``: True
    instead of the values). On a GPU this reads the
    few bytes back through pinned memory (:mod:`nccl_ext.core.host_read`; a synchronisation the
    dispatcher makes anyway for its split sizes)."""
    if kind not in _KINDS or not tensors:
        return None
    if read and kind is Collective.ALL_TO_ALL and _attached and \
            any(t.dtype not in _COUNT_DTYPES for t in tensors):
        return take_attached()  # the integration's counts for this dispatch (module doc)
    total = 0
    for t in tensors:
        if t.dtype not in _COUNT_DTYPES:  # bytes (uint8: pickled objects) and floats are no counts
            return None
        total += t.numel() * t.element_size()
        if total > INTS_MAX_BYTES:
            return None
    if not read:
        return True
    return [[int(v) for v in values] for values in host_read.read(list(tensors))]


def apportion(weights: list[int], total: int, salt: int = 0) -> list[int]:
    """``total`` split over the entries in proportion to ``weights`` (largest remainder; ties go
    to entries from ``salt`` on, so members apportioned alike do not all favour the same entry).
    All weights zero: spread evenly. What an uncaptured EP rank routes under an EP-folded capture:
    the captured routers' tokens per expert at that op, scaled to its own token count."""
    n = len(weights)
    if n == 0:
        return []
    s = sum(weights)
    if s <= 0:
        weights, s = [1] * n, n
    exact = [total * w / s for w in weights]
    out = [int(x) for x in exact]
    left = total - sum(out)
    order = sorted(range(n), key=lambda e: (-(exact[e] - out[e]), (e - salt) % n))
    for e in order[:left]:
        out[e] += 1
    return out
