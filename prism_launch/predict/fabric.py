"""Which links a collective or a transfer crosses on a cluster, and how much of each it uses.

Links (integer ids, so the replay's bookkeeping stays cheap):

* a GPU's NVLink port (``4r`` for GPU ``r``), both directions as one link: NCCL's
  collectives load both directions alike, and one link per GPU halves the replay's
  bookkeeping; the price is that two transfers in opposite directions through one port
  (rare: pipeline neighbours sit on different nodes) are taken to share it;
* a NIC, one per direction (``4j + 2`` / ``4j + 3`` for NIC ``j = node × nics_per_node + rail``;
  a GPU uses the NIC of its rail, ``local_rank × nics_per_node // gpus_per_node``);
* a leaf switch's uplinks and downlinks to the spines (``-(2L + 1)`` / ``-(2L + 2)`` for leaf
  ``L = (node // fabric.nodes_per_leaf) × nics_per_node + rail``: the fabric is rail-optimised,
  a leaf serves one rail of ``nodes_per_leaf`` nodes).

A group on one node uses its members' NVLink ports; a group spanning nodes is bound by the
network and uses its members' NICs (its NVLink traffic, a fraction of NVLink's capacity, is
left out); a group spanning leaves also crosses their uplinks. A demand is the share of a
link the flow uses when it runs at its own rate: ``1.0`` on the links that bound it; on an
uplink, the NIC streams that leave the leaf over the uplink's capacity (``nodes_per_leaf``
NICs' worth divided by ``fabric.oversubscription``): one stream per rail for a ring, tree or
pipeline (each leaves a leaf once), each member's off-leaf share for all_to_all, gather and
scatter. A demand above 1 slows the flow even alone (an oversubscribed uplink).
"""

from __future__ import annotations

from collections.abc import Sequence

from prism_launch.config.cluster import ClusterSpec
from prism_launch.predict.network import Flow

__all__ = ["Flow", "collective_links", "p2p_links", "uplink_slowdown"]

Links = tuple[tuple[int, float], ...]

DIRECT_KINDS = frozenset({"all_to_all", "gather", "scatter"})
"""Collectives whose members exchange with every peer (their off-leaf share crosses uplinks)."""


def _nic_demand(c: ClusterSpec, members: int) -> float:
    # a GPU drives its share of the node's NICs: nics/gpus of one NIC (at most the whole NIC)
    return min(1.0, members * c.nics_per_node / c.gpus_per_node)


def collective_links(c: ClusterSpec, kind: str, ranks: Sequence[int]) -> Links:
    """``(link, demand)`` of a collective among global ``ranks`` (module docstring)."""
    gpn, nics, npl = c.gpus_per_node, c.nics_per_node, c.fabric.nodes_per_leaf
    nodes = {r // gpn for r in ranks}
    if len(nodes) == 1:
        return tuple((4 * r, 1.0) for r in ranks)
    per_nic: dict[int, int] = {}
    for r in ranks:
        j = (r // gpn) * nics + (r % gpn) * nics // gpn
        per_nic[j] = per_nic.get(j, 0) + 1
    out: list[tuple[int, float]] = []
    for j, m in per_nic.items():
        d = _nic_demand(c, m)
        out += ((4 * j + 2, d), (4 * j + 3, d))
    groups = {n // npl for n in nodes}
    if len(groups) > 1:
        over = c.fabric.oversubscription / npl
        p = len(ranks)
        per_leaf: dict[int, float] = {}
        if kind in DIRECT_KINDS:
            in_group: dict[int, int] = {}
            for r in ranks:
                g = r // gpn // npl
                in_group[g] = in_group.get(g, 0) + 1
            for j, m in per_nic.items():
                node, rail = divmod(j, nics)
                leaf = (node // npl) * nics + rail
                off = (p - in_group[node // npl]) / p
                per_leaf[leaf] = per_leaf.get(leaf, 0.0) + _nic_demand(c, m) * off * over
        else:
            for j in per_nic:
                node, rail = divmod(j, nics)
                per_leaf[(node // npl) * nics + rail] = over
        for leaf, d in per_leaf.items():
            out += ((-(2 * leaf + 1), d), (-(2 * leaf + 2), d))
    return tuple(out)


def p2p_links(c: ClusterSpec, src: int, dst: int) -> Links:
    """``(link, demand)`` of a transfer from global rank ``src`` to ``dst``."""
    gpn, nics, npl = c.gpus_per_node, c.nics_per_node, c.fabric.nodes_per_leaf
    sn, dn = src // gpn, dst // gpn
    if sn == dn:
        return ((4 * src, 1.0), (4 * dst, 1.0))
    d = _nic_demand(c, 1)
    js = sn * nics + (src % gpn) * nics // gpn
    jd = dn * nics + (dst % gpn) * nics // gpn
    out = [(4 * js + 2, d), (4 * jd + 3, d)]
    if sn // npl != dn // npl:
        up = d * c.fabric.oversubscription / npl
        out += [(-(2 * ((sn // npl) * nics + js % nics) + 1), up), (-(2 * ((dn // npl) * nics + jd % nics) + 2), up)]
    return tuple(out)


def uplink_slowdown(links: Links) -> float:
    """Factor by which a flow's own demand on its links slows it when it is alone (>= 1)."""
    return max(1.0, max((d for _, d in links), default=0.0))
