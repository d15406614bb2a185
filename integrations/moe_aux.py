"""MoE routers' auxiliary losses, carried into the trace and summed up for the report.

A router computes its auxiliary losses (load balancing, z-loss) on the rank and communicates
none of them, so no op of the trace says what they were. A capturing rank's integration hands
each value to :func:`nccl_ext.core.routing_counts.attach` (:func:`attach`), read when the
rank's next all-to-all — the token dispatch that follows the router — is issued: by then the
dispatcher has synchronised on its split sizes, so reading the scalar costs no extra wait. It
travels as one list of that all-to-all's ``ints``: ``[TAG, layer, len(name), *name's code
points, value's IEEE-754 bits as a signed int64]``.

:func:`collect` reads them back from the events of a trace: per loss name, the mean over every
recorded router call (captured ranks, micro-batches, the recomputed forward of activation
checkpointing included, which repeats a value), per step and per layer. A router whose
dispatch makes no all-to-all (expert parallelism 1, megatron-core's ``allgather`` dispatcher)
leaves nothing. A router that drops tokens over its experts' capacity sends its pre-drop
tokens per expert the same way (:func:`attach_pre_drop`), so dropped tokens are known without
an aux-loss all-reduce to read them from.
"""

from __future__ import annotations

import json
import math
import statistics
import struct

TAG = 0xA0C5
"""First value of an attached auxiliary loss (tells it from gate counts and other integers)."""


def encode(layer: int, name: str, value: float) -> list[int]:
    bits = struct.unpack("<q", struct.pack("<d", float(value)))[0]
    return [TAG, int(layer), len(name), *(ord(c) for c in name), bits]


def decode(values: list[int]) -> dict | None:
    """``{"layer", "name", "value"}`` of an attached auxiliary loss, or None when ``values`` are not one."""
    if len(values) < 4 or values[0] != TAG:
        return None
    n = values[2]
    if n < 0 or len(values) != 4 + n:
        return None
    try:
        name = "".join(chr(c) for c in values[3:3 + n])
        value = struct.unpack("<d", struct.pack("<q", values[3 + n]))[0]
    except (ValueError, OverflowError, struct.error):
        return None
    return {"layer": values[1], "name": name, "value": value}


def attach(layer: int, name: str, value) -> None:
    """Send ``value`` (a scalar tensor or number) with the rank's next all-to-all (module doc)."""
    from nccl_ext.core import routing_counts

    key = (TAG, name, int(layer))
    if hasattr(value, "detach"):
        routing_counts.attach(lambda got: encode(layer, name, float(got[0][0])), key=key, tensors=[value.detach()])
    else:
        routing_counts.attach(encode(layer, name, float(value)), key=key)


PRE_DROP_TAG = 0xA0C6
"""First value of a router's tokens per expert before its capacity dropped any (the top-k)."""


def attach_pre_drop(routing_map) -> None:
    """Send a router's pre-drop tokens per expert (``routing_map``: ``[tokens, experts]``, the
    top-k before capacity dropping) with the rank's next all-to-all, its token dispatch."""
    from nccl_ext.core import routing_counts

    counts = routing_map.detach().sum(dim=0).long()
    routing_counts.attach(lambda got: [PRE_DROP_TAG, *got[0]], key=(PRE_DROP_TAG,), tensors=[counts])


def pre_drop_of(row: dict) -> list[int] | None:
    """The pre-drop counts a dispatch all-to-all carries (:func:`attach_pre_drop`), or None."""
    extra = row.get("extra")
    if not extra or str(PRE_DROP_TAG) not in extra:
        return None
    for values in json.loads(extra).get("ints") or ():
        if values and int(values[0]) == PRE_DROP_TAG:
            return [int(v) for v in values[1:]]
    return None


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def collect(rows: list[dict]) -> dict:
    """Every attached auxiliary loss in the trace's events, by name: ``{"mean", "calls",
    "ranks", "per_step": [{"step", "mean"}], "per_layer": [{"layer", "mean"}]}``; {} when none."""
    found: dict[str, list[tuple[int, int, int, float]]] = {}
    for row in rows:
        extra = row.get("extra")
        if row.get("kind") != "collective" or not extra or str(TAG) not in extra:
            continue
        for values in json.loads(extra).get("ints") or ():
            got = decode([int(v) for v in values])
            if got is not None:
                found.setdefault(got["name"], []).append((int(row["unit"]), got["layer"], int(row["rank"]),
                                                          got["value"]))
    out = {}
    for name, calls in sorted(found.items()):
        steps = sorted({u for u, _l, _r, _v in calls})
        layers = sorted({layer for _u, layer, _r, _v in calls})
        out[name] = {
            "mean": _mean([v for *_k, v in calls]),
            "calls": len(calls),
            "ranks": len({r for _u, _l, r, _v in calls}),
            "per_step": [{"step": u, "mean": _mean([v for uu, _l, _r, v in calls if uu == u])} for u in steps],
            "per_layer": [{"layer": layer, "mean": _mean([v for _u, ll, _r, v in calls if ll == layer])}
                          for layer in layers],
        }
    return out
