"""DeepSpeed MoE gates' token counts, sent with the dispatch they precede (rank side).

DeepSpeed's ``MOELayer`` all-to-alls a fixed capacity per expert, so the trace's op sizes say
nothing of routing; the counts stay in the gate's outputs (``TopKGate.forward``, DeepSpeed
0.19: ``top1gating``/``top2gating``/``topkgating``). A forward hook on every ``TopKGate``
reads what the gate returned:

- ``exp_counts``: tokens routed to each expert by the top-k, before the capacity limit;
- the routes kept within capacity: with ``sparse_routes`` (what ``MOELayer`` asks for) the
  expert index of every route, ``-1`` where the capacity dropped it; else the dispatch mask
  ``[tokens, experts, capacity]``;
- the capacity (``drop_tokens=False``: the EP group's maximum, after DeepSpeed's all-reduce).

and hands ``[TAG, layer, experts, capacity, *exp_counts, *routed]`` to
:func:`nccl_ext.core.routing_counts.attach`: the capture sends it as the ``ints`` of the
rank's next all-to-all, the token dispatch. The gate's auxiliary loss ``l_aux`` (its first
output, before the recipe's coefficient) goes with it (:mod:`integrations.moe_aux`). Nothing is communicated and nothing the program
computes changes; the hook acts only in a capture on an expert-parallel gate (EP size > 1), and
reads the few counts back from the GPU (the layer synchronises on its capacity anyway).
``layer`` is the order in which the rank's gates first ran (its pipeline stage's MoE layers).
"""

from __future__ import annotations

import itertools
import weakref

from integrations import moe_aux
from nccl_ext.core import host_read
from integrations.import_hooks import replaces

TAG = 0x5DE7
"""First value of attached gate counts (tells them from any other integers on an all-to-all)."""
HEADER = 4
"""Values before the counts: tag, layer, experts, capacity."""

_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_next_layer = itertools.count()


def encode(layer: int, capacity: int, exp_counts: list[int], routed: list[int]) -> list[int]:
    if len(exp_counts) != len(routed):
        raise ValueError(f"gate counts of {len(exp_counts)} and {len(routed)} experts: expected one per expert each")
    return [TAG, layer, len(routed), capacity, *exp_counts, *routed]


def decode(values: list[int]) -> dict | None:
    """``{"layer", "num_experts", "capacity", "exp_counts", "routed"}`` of attached gate counts, or
    None when ``values`` are not gate counts."""
    if len(values) < HEADER or values[0] != TAG:
        return None
    _tag, layer, e, capacity = values[:HEADER]
    if len(values) != HEADER + 2 * e:
        return None
    return {"layer": layer, "num_experts": e, "capacity": capacity,
            "exp_counts": list(values[HEADER:HEADER + e]), "routed": list(values[HEADER + e:])}


def gate_counts(output) -> tuple[int, list[int], list[int]]:
    """``(capacity, exp_counts, routed per expert)`` of a ``TopKGate`` output (both forms)."""
    import torch

    exp_counts = output[-1]
    e = int(exp_counts.numel())
    with torch.no_grad():
        if len(output) == 7:  # sparse routes: (l_aux, capacity, E, indices, locations, gates, exp_counts)
            idx = output[3].reshape(-1)
            routed = torch.bincount(idx[idx >= 0].long(), minlength=e)
            capacity = torch.as_tensor(output[1], device=routed.device).reshape(1)
        else:  # (l_aux, combine_weights, dispatch_mask [S, E, C], exp_counts)
            mask = output[2]
            routed = mask.sum(dim=(0, 2))
            capacity = torch.tensor([mask.shape[2]], device=routed.device)
        flat = torch.cat([capacity.long(), exp_counts.reshape(-1).long().to(routed.device), routed.long()])
    values = [int(v) for v in host_read.read([flat])[0]]
    return values[0], values[1:1 + e], values[1 + e:]


def _capturing() -> bool:
    from nccl_ext.frontend.install import current_world

    world = current_world()
    return world is not None and type(world.transport).__module__ == "nccl_ext.capture.transport"


def _ep_size(gate) -> int:
    group = getattr(gate, "ep_group", None)
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def record(gate, _inputs, output) -> None:
    """Forward hook of a ``TopKGate`` (module doc)."""
    if not _capturing() or _ep_size(gate) <= 1:
        return
    from nccl_ext.core import routing_counts

    layer = _layers.get(gate)
    if layer is None:
        layer = _layers[gate] = next(_next_layer)
    capacity, exp_counts, routed = gate_counts(output)
    routing_counts.attach(encode(layer, capacity, exp_counts, routed))
    if hasattr(output[0], "detach"):
        moe_aux.attach(layer, "l_aux", output[0])


def patch_gate(mod) -> None:
    """Every ``TopKGate`` made after this records its counts (:func:`record`)."""
    cls = getattr(mod, "TopKGate", None)
    if cls is None:
        return

    @replaces(cls, "__init__")
    def __init__(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.register_forward_hook(record)
