"""Network cost model: how long a collective or a point-to-point transfer takes on a
*target* cluster that is not physically present.

The emulation replay asks a :class:`CostModel` for the duration of every communication
op whose members are not all real. :class:`NcclCostModel` follows the shape of NCCL's
own tuner: every algorithm costs ``latency + bytes / bandwidth``; the latency is a
per-launch base (``ClusterSpec.protocol_latency_us``) plus one hop latency per
algorithm step (NVLink-class hops inside a node, network hops between nodes); the
bandwidth is the *bus bandwidth* of the group's bottleneck link, turned into time with
the same per-collective factors nccl-tests uses, so that a model bus bandwidth of ``B``
reads back as ``B`` in an nccl-tests style report.

Units: sizes in bytes, times in seconds (``*_us`` fields in microseconds), bandwidths
in GB/s with 1 GB = 1e9 bytes (the nccl-tests convention).

What ``nbytes`` means, per collective kind: the bytes of the tensors one member puts
into the op (for broadcast and scatter, the root's), which is what a PrismTrace records
for it; nccl-tests' reported ``size`` is given alongside (:func:`nccl_tests_bytes`):

=================  ====================================================  ===============
kind               ``nbytes`` is                                         nccl-tests size
=================  ====================================================  ===============
all_reduce         one member's buffer (input = output)                  nbytes
broadcast          the root's buffer (= every member's output)           nbytes
reduce             one member's input buffer (= the root's output)       nbytes
reduce_scatter     one member's *input* (all ``p`` chunks)               nbytes
all_to_all         one member's *input* (all ``p`` per-peer chunks)      nbytes
all_gather         one member's *contribution* (output is ``p`` × it)    p × nbytes
gather             one member's contribution (the root receives ``p``×)  p × nbytes
scatter            the root's input (all ``p`` chunks; one member gets   nbytes
                   ``nbytes / p``)
barrier            ignored (costed as a 4-byte all_reduce, as torch
                   implements a barrier over NCCL)                       --
=================  ====================================================  ===============
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "COLLECTIVE_KINDS",
    "COST_MODELS",
    "ClusterSpec",
    "CostModel",
    "Estimate",
    "FabricSpec",
    "LinkSpec",
    "NcclCostModel",
    "busbw_factor",
    "bus_bandwidth_gbps",
    "cluster_from_config",
    "curve_key",
    "load_cluster",
    "make_cost_model",
    "nccl_tests_bytes",
    "preset_dir",
]

GB = 1e9
"""Bytes per GB in every bandwidth figure (nccl-tests convention)."""

US = 1e-6
"""Seconds per microsecond."""

P2P = "p2p"
"""Pseudo-kind for a point-to-point transfer, accepted by :func:`fit_alpha_beta`."""

BARRIER_BYTES = 4
"""A barrier is costed as an all_reduce of this many bytes."""

TREE_BW_EFFICIENCY = 0.9
"""Share of the ring bus bandwidth a tree all_reduce reaches (NCCL's tuner uses the same derating)."""

COLLNET_BW_EFFICIENCY = 0.9
"""Share of the group's network bandwidth an IB SHARP (CollNet) all_reduce reaches, as the tree."""

MIB = 1 << 20


from prism_launch.config.cluster import (  # noqa: F401 - re-exported
    ClusterSpec,
    COLLECTIVE_KINDS,
    FabricSpec,
    KindCost,
    LinkSpec,
    cluster_from_config,
    load_cluster,
    preset_dir,
)
from prism_launch.predict.fabric import Flow, collective_links, p2p_links, uplink_slowdown


# --------------------------------------------------------------------------- nccl-tests conventions


def _check_kind(kind: str, *, allow_p2p: bool = False) -> str:
    kind = str(kind)
    if kind in COLLECTIVE_KINDS or (allow_p2p and kind == P2P):
        return kind
    valid = ", ".join(COLLECTIVE_KINDS + ((P2P,) if allow_p2p else ()))
    raise ValueError(f"unknown collective kind {kind!r} (valid: {valid})")


def busbw_factor(kind: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``busbw = algbw × factor`` for a group of ``p``.

    all_reduce 2(p−1)/p; reduce_scatter, all_gather, all_to_all, gather, scatter (p−1)/p;
    broadcast, reduce and p2p 1; barrier 0 (moves no payload).
    """
    kind = _check_kind(kind, allow_p2p=True)
    if p < 1:
        raise ValueError(f"group size must be >= 1 (got {p})")
    if kind == "all_reduce":
        return 2 * (p - 1) / p
    if kind in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (p - 1) / p
    if kind == "barrier":
        return 0.0
    return 1.0


def nccl_tests_bytes(kind: str, nbytes: int, p: int) -> int:
    """The ``size`` nccl-tests would report for this op (the module table): ``p × nbytes``
    for all_gather/gather, ``nbytes`` otherwise."""
    kind = _check_kind(kind, allow_p2p=True)
    return p * nbytes if kind in ("all_gather", "gather") else nbytes


def bus_bandwidth_gbps(kind: str, nbytes: int, p: int, seconds: float) -> float:
    """Bus bandwidth in GB/s of an op that took ``seconds`` (nccl-tests' busbw column)."""
    if seconds <= 0:
        return math.inf
    return nccl_tests_bytes(kind, nbytes, p) / seconds * busbw_factor(kind, p) / GB


def _link_coefficients(kind: str, p: int) -> tuple[int, float]:
    """(hop latencies, multiple of ``nbytes / B``) of ``kind`` over ``p`` members on one link class.

    ``time = protocol + steps × α + coef × nbytes / B``; at large sizes this gives a bus
    bandwidth of exactly ``B`` in nccl-tests terms.
    """
    if kind == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if kind in ("reduce_scatter", "all_to_all", "scatter"):
        return p - 1, (p - 1) / p
    if kind in ("all_gather", "gather"):
        return p - 1, float(p - 1)
    if kind in ("broadcast", "reduce"):
        return p - 1, 1.0
    if kind == P2P:
        return 1, 1.0
    raise ValueError(f"collective kind {kind!r} moves no payload; its α/β cannot be fitted")


# --------------------------------------------------------------------------- model


@runtime_checkable
class CostModel(Protocol):
    """Predicts communication times on the target cluster (seconds)."""

    def collective_time(self, kind: str, nbytes: int, ranks: Sequence[int]) -> float:
        """Duration of collective ``kind`` among global ``ranks``; ``nbytes`` per the module table."""
        ...

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        """Duration of sending ``nbytes`` from global rank ``src`` to ``dst``."""
        ...


@dataclass(frozen=True, slots=True)
class Estimate:
    """One priced operation, split into its parts (for reports and tests)."""

    seconds: float
    """Total predicted time."""
    algorithm: str
    """``ring``, ``tree``, ``nvls``, ``nvls_tree``, ``collnet`` (IB SHARP), ``pipeline``
    (broadcast/reduce), ``direct`` (all_to_all/gather/scatter/p2p) or ``none``."""
    latency_s: float
    """Fixed part: launch + hop latencies."""
    transfer_s: float
    """Size-dependent part."""
    bus_bandwidth_gbps: float
    """Bus bandwidth the transfer part was priced at (GB/s), 0 if none."""


_NONE = Estimate(seconds=0.0, algorithm="none", latency_s=0.0, transfer_s=0.0, bus_bandwidth_gbps=0.0)


@dataclass(frozen=True, slots=True)
class _Geometry:
    p: int
    n_nodes: int
    k_min: int
    """Fewest group members on one node."""
    k_max: int
    """Most group members on one node."""
    k_root: int
    """Group members on the node of ``ranks[0]`` (the root of rooted collectives)."""
    n_leaves: int = 1
    """Leaf switches (per rail) the group's nodes hang from (``node // fabric.nodes_per_leaf``)."""


class NcclCostModel:
    """NCCL-like α–β model of a :class:`ClusterSpec`, with NCCL's message-size efficiency,
    its all_reduce algorithm choice and the fabric's oversubscription.

    * A group lying on one node uses ``intra_node``; a group spanning nodes pays network
      hop latency on the steps that cross nodes and runs at the bottleneck bandwidth:
      ``min(intra-node busbw, k × per-GPU network share)`` where ``k`` is the fewest
      group members on a node (a ring leaves each node once per channel, and the
      group's ``k`` GPUs can drive their own share of the node's NICs).
    * Bandwidth follows the message size: the achieved bus bandwidth of the bottleneck link
      class is ``bandwidth_gbps × s^k / (1 + s^k)``, ``s = key / half_size``
      (``LinkSpec.half_size_mib``, ``curve_exponent``), fitted to published nccl-tests figures.
      The ``key`` is the bytes one member streams over that link class in one dependent step
      of the algorithm (:func:`curve_key`): a ring's step moves ``size / p`` and waits for the
      step before it, so at a fixed size a ring over more members runs lower on the curve
      (NCCL's ring busbw falls with the node count at a fixed size), while a tree streams each
      member's ``1/k`` slice of the buffer through in one pass.
    * all_reduce: NCCL's tuner (``src/graph/tuning.cc``) prices every enabled algorithm as
      ``latency + size / bandwidth`` and runs the cheapest; so does this model, over
      ring (``2(p−1)`` hops, ``2(p−1)/p · n / B``); across nodes the double binary tree
      (an intra-node chain plus a ``log2(nodes)``-deep tree, both ways; each node's network
      carries the buffer twice per direction, once on two nodes); NVLS inside an NVLink domain
      when ``cluster.nvls`` (algorithm bandwidth ``nvls_bandwidth_gbps``), NVLS-tree across
      nodes (a tree whose intra-node part is NVLS: no intra-node chain latency); CollNet when
      ``cluster.sharp`` (the switches reduce: each node sends and receives the buffer once,
      whatever the node count, one network hop up and one down).
    * all_gather / reduce_scatter: ring, ``(p−1)`` hops and ``(p−1)/p`` of the full buffer.
    * broadcast / reduce: pipelined ring, ``(p−1)`` hops and ``n / B``.
    * all_to_all / gather / scatter: direct transfers; peers on the same node are reached
      over ``intra_node`` and the rest through the member's network share, concurrently
      (the slower of the two bounds the transfer). Rings and direct transfers share one
      per-GPU network figure; what differs is the curve key: a direct member posts all its
      off-node sends at once and its NIC streams them back to back, so it sits high on the
      curve where a ring's small per-step chunks do not.
    * Traffic that leaves a leaf switch crosses its uplinks (:mod:`prism_launch.predict.fabric`):
      with ``fabric.oversubscription`` > 1 a group whose off-leaf streams exceed them is slowed.
    * A kind named in ``cluster.kinds`` (measured on its own: gloo's kinds differ by more than
      their hops and bytes) is priced by the same formulas over its own overhead, hop latency
      and bandwidth; a barrier follows all_reduce's.
    * Every op pays ``protocol_latency_us`` once; groups of one member and empty
      payloads cost nothing (NCCL returns at once).

    :meth:`flow` / :meth:`p2p_flow` give the same price split for the replay's link sharing.
    """

    name = "nccl"

    def __init__(self, cluster: ClusterSpec | Any):
        self.cluster = cluster_from_config(cluster)
        self._geometry_cache: dict[tuple[int, ...], _Geometry] = {}
        # kinds with their own measured cost (cluster.kinds): the same formulas over their figures
        self._by_kind = {kind: NcclCostModel(_kind_cluster(self.cluster, cost))
                         for kind, cost in self.cluster.kinds.items()}

    def __repr__(self) -> str:
        return f"NcclCostModel(cluster={self.cluster.name!r})"

    # ---------------------------------------------------------------- public API

    def collective_time(self, kind: str, nbytes: int, ranks: Sequence[int]) -> float:
        return self.estimate(kind, nbytes, ranks).seconds

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        return self.estimate_p2p(nbytes, src, dst).seconds

    def flow(self, kind: str, nbytes: int, ranks: Sequence[int]) -> Flow:
        """The collective as a flow for the replay: latency, unshared transfer time and links."""
        own = self._by_kind.get("all_reduce" if kind == "barrier" else kind)
        if own is not None:
            return own.flow(kind, nbytes, ranks)
        est = self._estimate(kind, nbytes, ranks)
        if est.transfer_s <= 0:
            return Flow(latency_s=est.latency_s, work_s=0.0, links=())
        g = self._geometry(ranks)
        return Flow(latency_s=est.latency_s, work_s=est.transfer_s, links=collective_links(self.cluster, kind, ranks),
                    members_only=g.n_nodes == 1 and g.p == self.cluster.gpus_per_node)

    def p2p_flow(self, nbytes: int, src: int, dst: int) -> Flow:
        """The transfer as a flow for the replay (see :meth:`flow`)."""
        est = self._estimate_p2p(nbytes, src, dst)
        if est.transfer_s <= 0:
            return Flow(latency_s=est.latency_s, work_s=0.0, links=())
        return Flow(latency_s=est.latency_s, work_s=est.transfer_s, links=p2p_links(self.cluster, src, dst))

    def estimate(self, kind: str, nbytes: int, ranks: Sequence[int], algorithm: str | None = None) -> Estimate:
        """:meth:`collective_time` with its breakdown (alone on the cluster); ``algorithm``
        forces one of all_reduce's (as ``NCCL_ALGO`` does) instead of the cheapest."""
        est = self._estimate(kind, nbytes, ranks, algorithm)
        g = self._geometry(ranks)
        if g.n_leaves > 1 and self.cluster.fabric.oversubscription > 1 and est.transfer_s > 0:
            est = _slowed(est, uplink_slowdown(collective_links(self.cluster, kind, ranks)))
        return est

    def estimate_p2p(self, nbytes: int, src: int, dst: int) -> Estimate:
        """:meth:`p2p_time` with its breakdown (alone on the cluster)."""
        est = self._estimate_p2p(nbytes, src, dst)
        if self.cluster.fabric.oversubscription > 1 and est.transfer_s > 0:
            est = _slowed(est, uplink_slowdown(p2p_links(self.cluster, src, dst)))
        return est

    def algorithm(self, kind: str, nbytes: int, ranks: Sequence[int]) -> str:
        """The algorithm the model picks (``ring``, ``tree``, ``nvls``, ...)."""
        return self.estimate(kind, nbytes, ranks).algorithm

    def busbw_curve(self, link: LinkSpec, key: float) -> float:
        """Achieved bus bandwidth (GB/s) over ``link`` at curve key ``key`` (bytes one member
        streams per dependent step, :func:`curve_key`)."""
        return _curve(link.bandwidth_gbps, link, key)

    # ---------------------------------------------------------------- internals

    def _estimate(self, kind: str, nbytes: int, ranks: Sequence[int], algorithm: str | None = None) -> Estimate:
        kind = _check_kind(kind)
        own = self._by_kind.get("all_reduce" if kind == "barrier" else kind)  # a barrier is a tiny all_reduce
        if own is not None:
            return own._estimate(kind, nbytes, ranks, algorithm)
        nbytes = _check_nbytes(nbytes)
        g = self._geometry(ranks)
        if g.p == 1:
            return _NONE
        if kind == "barrier":
            kind, nbytes = "all_reduce", BARRIER_BYTES
        if nbytes == 0:
            return _NONE
        if kind == "all_reduce":
            options = [self._ring(kind, nbytes, g)]
            if g.n_nodes > 1:
                options.append(self._tree_all_reduce(nbytes, g))
                if self.cluster.sharp:
                    options.append(self._collnet_all_reduce(nbytes, g))
            elif self.cluster.nvls:
                options.append(self._nvls_all_reduce(nbytes, g))
            if algorithm is not None:
                forced = [e for e in options if e.algorithm == algorithm]
                if not forced:
                    have = ", ".join(e.algorithm for e in options)
                    raise ValueError(f"all_reduce over this group cannot use {algorithm!r} on {self.cluster.name} "
                                     f"(available: {have})")
                return forced[0]
            return min(options, key=lambda e: e.seconds)
        if kind in ("all_gather", "reduce_scatter"):
            return self._ring(kind, nbytes, g)
        if kind in ("broadcast", "reduce"):
            return self._ring(kind, nbytes, g, algorithm="pipeline")
        return self._direct(kind, nbytes, g)

    def _estimate_p2p(self, nbytes: int, src: int, dst: int) -> Estimate:
        nbytes = _check_nbytes(nbytes)
        src, dst = _check_rank(src), _check_rank(dst)
        if src == dst or nbytes == 0:
            return _NONE
        c = self.cluster
        same_node = src // c.gpus_per_node == dst // c.gpus_per_node
        link = c.intra_node if same_node else c.inter_node
        bw = c.intra_node.bandwidth_gbps if same_node else c.network_share_gbps
        eff = _curve(bw, link, nbytes)
        return self._make("direct", link.latency_us, nbytes / (eff * GB), eff)

    def _geometry(self, ranks: Sequence[int]) -> _Geometry:
        key = tuple(ranks)
        g = self._geometry_cache.get(key)
        if g is not None:
            return g
        if not key:
            raise ValueError("a collective needs at least one rank (got an empty group)")
        per_node: dict[int, int] = {}
        gpn = self.cluster.gpus_per_node
        for r in map(_check_rank, key):
            per_node[r // gpn] = per_node.get(r // gpn, 0) + 1
        if sum(per_node.values()) != len(set(key)):
            raise ValueError(f"a group's ranks must be distinct (got {len(key)} ranks, {len(set(key))} distinct)")
        counts = per_node.values()
        npl = self.cluster.fabric.nodes_per_leaf
        g = _Geometry(
            p=len(key),
            n_nodes=len(per_node),
            k_min=min(counts),
            k_max=max(counts),
            k_root=per_node[_check_rank(key[0]) // gpn],
            n_leaves=len({n // npl for n in per_node}),
        )
        if len(self._geometry_cache) >= 4096:
            self._geometry_cache.clear()
        self._geometry_cache[key] = g
        return g

    def _link(self, g: _Geometry) -> LinkSpec:
        """The link class whose size curve applies: the network once the group spans nodes."""
        return self.cluster.intra_node if g.n_nodes == 1 else self.cluster.inter_node

    def _ring_bandwidth(self, g: _Geometry) -> float:
        """Plateau bus bandwidth (GB/s) of a ring over the group: its bottleneck link."""
        c = self.cluster
        if g.n_nodes == 1:
            return c.intra_node.bandwidth_gbps
        net = g.k_min * c.network_share_gbps
        return min(c.intra_node.bandwidth_gbps, net) if g.k_max > 1 else net

    def _make(self, algorithm: str, hop_latency_us: float, transfer_s: float, bw_gbps: float) -> Estimate:
        latency_s = (self.cluster.protocol_latency_us + hop_latency_us) * US
        return Estimate(
            seconds=latency_s + transfer_s,
            algorithm=algorithm,
            latency_s=latency_s,
            transfer_s=transfer_s,
            bus_bandwidth_gbps=bw_gbps,
        )

    def _ring(self, kind: str, nbytes: int, g: _Geometry, algorithm: str = "ring") -> Estimate:
        c = self.cluster
        steps, coef = _link_coefficients(kind, g.p)
        # Of the ring's hops, those leaving a node cross the network: once per node per pass.
        passes = 2 if kind == "all_reduce" else 1
        inter_steps = passes * (g.n_nodes - 1)
        hop_us = (steps - inter_steps) * c.intra_node.latency_us + inter_steps * c.inter_node.latency_us
        key = curve_key("pipeline" if algorithm == "pipeline" else "ring", kind, nbytes, g.p, g.k_min)
        bw = _curve(self._ring_bandwidth(g), self._link(g), key)
        return self._make(algorithm, hop_us, coef * nbytes / (bw * GB), bw)

    def _algbw_estimate(self, algorithm: str, hop_us: float, nbytes: int, algbw: float, g: _Geometry) -> Estimate:
        """An all_reduce moving the buffer at algorithm bandwidth ``algbw`` (plateau, GB/s)."""
        eff = _curve(algbw, self._link(g), curve_key(algorithm, "all_reduce", nbytes, g.p, g.k_min))
        return self._make(algorithm, hop_us, nbytes / (eff * GB), eff * busbw_factor("all_reduce", g.p))

    def _tree_all_reduce(self, nbytes: int, g: _Geometry) -> Estimate:
        c = self.cluster
        depth = math.ceil(math.log2(g.n_nodes))
        chain = 0 if c.nvls else g.k_max - 1      # NVLS-tree: the switch reduces inside a node
        hop_us = 2 * (chain * c.intra_node.latency_us + depth * c.inter_node.latency_us)
        # per direction a node's network carries the buffer once on two nodes (each tree is a
        # two-node chain), twice on more (interior in one tree, leaf in the other); the
        # intra-node part runs over NVLink, so the ring's bottleneck bounds it too
        algbw = TREE_BW_EFFICIENCY * self._ring_bandwidth(g) / (1 if g.n_nodes == 2 else 2)
        return self._algbw_estimate("nvls_tree" if c.nvls else "tree", hop_us, nbytes, algbw, g)

    def _collnet_all_reduce(self, nbytes: int, g: _Geometry) -> Estimate:
        c = self.cluster
        chain = 0 if c.nvls else g.k_max - 1
        hop_us = 2 * (chain * c.intra_node.latency_us + c.inter_node.latency_us)
        algbw = COLLNET_BW_EFFICIENCY * g.k_min * c.network_share_gbps
        return self._algbw_estimate("collnet", hop_us, nbytes, algbw, g)

    def _nvls_all_reduce(self, nbytes: int, g: _Geometry) -> Estimate:
        # the switch reduces and multicasts: one NVLink round trip, whatever the group size
        c = self.cluster
        return self._algbw_estimate("nvls", 2 * c.intra_node.latency_us, nbytes, c.nvls_bandwidth_gbps, g)

    def _direct(self, kind: str, nbytes: int, g: _Geometry) -> Estimate:
        """all_to_all / gather / scatter: concurrent transfers to every peer."""
        c = self.cluster
        p = g.p
        k_net = g.k_min if kind == "all_to_all" else g.k_root
        intra_bw = _curve(c.intra_node.bandwidth_gbps, c.intra_node, curve_key("direct", kind, nbytes, p))
        net_bw = _curve(c.network_share_gbps, c.inter_node, curve_key("direct_net", kind, nbytes, p, k_net))
        if kind == "all_to_all":
            # Each member sends one p-th of its input to every peer; check the member
            # with the most on-node peers and the one with the most off-node peers.
            def member(k: int) -> float:
                return max((k - 1) / p * nbytes / (intra_bw * GB), (p - k) / p * nbytes / (net_bw * GB))

            transfer = max(member(g.k_min), member(g.k_max))
            k_lat = g.k_min
        else:
            # The root receives (gather) or sends (scatter) one chunk per peer.
            chunk = nbytes if kind == "gather" else nbytes / p
            k = g.k_root
            transfer = max((k - 1) * chunk / (intra_bw * GB), (p - k) * chunk / (net_bw * GB))
            k_lat = k
        hop_us = (k_lat - 1) * c.intra_node.latency_us + (p - k_lat) * c.inter_node.latency_us
        bw = intra_bw if g.n_nodes == 1 else min(intra_bw, net_bw) if g.k_max > 1 else net_bw
        return self._make("direct", hop_us, transfer, bw)


def _kind_cluster(cluster: ClusterSpec, cost: KindCost) -> ClusterSpec:
    """``cluster`` with one kind's measured cost (:class:`KindCost`) in place of its per-op
    latency and its links' latency and bandwidth (the size curves and the fabric kept)."""
    def link(spec: LinkSpec) -> LinkSpec:
        return dataclasses.replace(spec, latency_us=cost.latency_us, bandwidth_gbps=cost.bandwidth_gbps)

    return dataclasses.replace(cluster, protocol_latency_us=cost.overhead_us, intra_node=link(cluster.intra_node),
                               inter_node=link(cluster.inter_node), kinds={})


def curve_key(algorithm: str, kind: str, nbytes: int, p: int, k: int = 1) -> float:
    """The size (bytes) the bandwidth curve is read at: what one member streams over the link
    in one dependent step of ``algorithm`` (``kind`` over ``p`` members, ``nbytes`` per the
    module table, ``k`` group members on the node in question).

    NCCL's achieved bandwidth ramps with the size of what is in flight: each dependent step
    pays pipeline fill, protocol and proxy start-up again before it runs at the link's rate.

    * ``ring`` (all_reduce, all_gather, reduce_scatter): ``size / p`` — each of the ring's steps
      moves one ``p``-th of the nccl-tests ``size`` (for all_gather the gathered output) and
      cannot start before the step before it has arrived, so one size spread over more members
      runs lower on the curve;
    * ``nvls``: ``nbytes / p`` — each member reduces and multicasts its own ``1/p`` slice;
    * ``tree``, ``nvls_tree``, ``collnet``: ``nbytes / k`` — the buffer is split over the node's
      ``k`` members (NCCL's channels, one rail NIC each; NVLS-tree's per-GPU slices) and each
      slice streams through the tree in one pipelined pass;
    * ``pipeline`` (broadcast, reduce) and ``p2p``: ``nbytes`` — the whole buffer streams through;
    * ``direct`` (all_to_all, gather, scatter over NVLink): the chunk for one peer (each peer is
      reached over its own connection);
    * ``direct_net`` (the same over the network): the member's off-node bytes, ``p − k`` chunks —
      all its sends are posted at once and leave through its one rail NIC back to back.
    """
    if algorithm in ("ring", "nvls"):
        return nccl_tests_bytes(kind, nbytes, p) / p
    if algorithm in ("tree", "nvls_tree", "collnet"):
        return nbytes / k
    if algorithm in ("direct", "direct_net"):
        chunk = nbytes if kind == "gather" else nbytes / p
        return chunk * (p - k) if algorithm == "direct_net" else chunk
    return float(nbytes)


def _curve(plateau_gbps: float, link: LinkSpec, key: float) -> float:
    """Achieved bandwidth over ``link``'s class at curve key ``key`` (bytes, :func:`curve_key`):
    ``plateau × s^k / (1 + s^k)``, ``s = key / half_size`` (``LinkSpec.half_size_mib``)."""
    if link.half_size_mib <= 0 or key <= 0:
        return plateau_gbps
    sk = (key / (link.half_size_mib * MIB)) ** link.curve_exponent
    return plateau_gbps * sk / (1.0 + sk)


def _slowed(est: Estimate, factor: float) -> Estimate:
    if factor <= 1.0:
        return est
    transfer = est.transfer_s * factor
    return Estimate(seconds=est.latency_s + transfer, algorithm=est.algorithm, latency_s=est.latency_s,
                    transfer_s=transfer, bus_bandwidth_gbps=est.bus_bandwidth_gbps / factor)


def _check_nbytes(nbytes: int) -> int:
    try:
        value = operator.index(nbytes)
    except TypeError:
        value = int(nbytes) if isinstance(nbytes, float) and math.isfinite(nbytes) else -1
    if isinstance(nbytes, bool) or value < 0:
        raise ValueError(f"nbytes must be a non-negative number of bytes (got {nbytes!r})")
    return value


def _check_rank(r: int) -> int:
    try:
        value = operator.index(r)
    except TypeError:
        raise ValueError(f"ranks must be non-negative integers (got {r!r})") from None
    if value < 0 or isinstance(r, bool):
        raise ValueError(f"ranks must be non-negative integers (got {r!r})")
    return value

# --------------------------------------------------------------------------- registry

COST_MODELS: dict[str, type] = {"nccl": NcclCostModel}
"""Cost models by name; each class is constructed from a :class:`ClusterSpec`."""


def make_cost_model(name: str, cluster: ClusterSpec | Any) -> CostModel:
    """Construct the cost model called ``name`` for ``cluster``."""
    try:
        cls = COST_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown cost model {name!r} (valid: {', '.join(sorted(COST_MODELS))})") from None
    return cls(cluster)
