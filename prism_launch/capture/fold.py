"""Symmetry-folded capture: which logical ranks to capture, and who stands in for the rest.

Ranks that hold the same coordinates in every non-data-parallel dimension run the same
program on different data. A folded capture runs only the **captured set**: the sandbox
ranks closed under every *model-parallel* group (tensor, pipeline, context, expert,
embedding… — any group whose description does not mark it as spanning data-parallel
replicas). Every other rank ``u`` is **mirrored** by a captured rank ``rep[u]``: the
captured rank that shares the most data-parallel groups with it (the same model shard).

What stays exact and what is approximated:
- Everything a captured rank computes from its own data and its model-parallel peers is
  real. Sandbox ranks inside the captured set replay bit-identically to the folded capture.
- A collective on a group with uncaptured members (data-parallel gradient reduction, the
  distributed optimizer's gathers, world-wide reductions) takes each uncaptured member's
  contribution from a captured stand-in (:meth:`FoldPlan.sources`). That is exact when the
  replicas' contributions are equal (e.g. the same data on every replica) and the group has at
  most 64 members (larger sums scale each stand-in by its count: equal up to rounding), and
  an approximation otherwise: uncaptured replicas contribute copies of captured ones, and
  their MoE routing is that of the captured rank they mirror.
- Timing: an uncaptured rank's timeline is its stand-in's (same program, same shapes).

Expert parallelism (``ep_sample``): an expert-parallel group (:data:`EP_GROUPS`) is not closed
over whole. The captured set takes, in every EP group it reaches, the members at a few EP
positions — the seeds' own, then positions spread evenly over the group, ``ep_sample`` in all,
the same positions in every group so that pipeline stages line up — and closes those under the
other model-parallel groups. The EP ranks left out mirror a captured EP rank of their group
(every EP rank holds a same-shaped expert shard); what they route is synthesized from the
captured routers (:mod:`prism_launch.capture.ep_fold`).

Tensor parallelism (``tp_sample``, ``capture.payload=none`` only): tensor-parallel peers run
same-shaped shards of one stage, and without payloads their collectives' results are synthesized
anyway. The captured set then takes, in every tensor-parallel group (:data:`TP_GROUPS`), TP
position 0 (megatron-core loads each micro-batch there and broadcasts it to its peers), the seeds'
positions and positions spread evenly, ``tp_sample`` in all, in every group the closure reaches
(a pipeline, embedding or model-parallel group adds only members at those positions). A rank at
another position mirrors its own TP group's member at the nearest captured position other than 0
(its stand-in's stand-in where that member is an uncaptured replica).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from nccl_ext.core.routing_counts import EP_GROUPS, is_ep_proper, is_expert_parallel
from prism_launch.trace.fold import FoldError, FoldPlan

__all__ = ["EP_GROUPS", "FoldError", "FoldPlan", "TP_GROUPS", "ep_positions", "is_expert_parallel", "is_replicated",
           "is_tensor_parallel", "plan"]

TP_GROUPS = ("TENSOR_MODEL_PARALLEL_GROUP", "mesh_tp")
"""Descriptions of tensor-parallel groups proper: megatron-core's, and a ``DeviceMesh``'s ``tp``
dimension (torchtitan); a group whose description ends with one of them."""


def is_tensor_parallel(desc: str) -> bool:
    return (desc or "").endswith(TP_GROUPS)


def ep_positions(size: int, seeds: Iterable[int], sample: int) -> list[int]:
    """EP positions to capture in a group of ``size``: the seeds' positions, then positions
    spread evenly from the first seed's on, ``sample`` in all (the seeds' always)."""
    chosen = sorted(set(seeds))
    start = chosen[0] if chosen else 0
    step = size / max(sample, 1)
    for i in range(sample):
        if len(chosen) >= sample:
            break
        p = (start + round(i * step)) % size
        if p not in chosen:
            chosen.append(p)
    return sorted(chosen)


def is_replicated(desc: str, ranks: Sequence[int], world_size: int, patterns: Iterable[str]) -> bool:
    if len(ranks) >= world_size:
        return True  # the world group spans every replica by definition
    return any(p and p in (desc or "") for p in patterns)


def tp_mirror_position(q: int, positions: Sequence[int]) -> int:
    """The captured TP position that stands in for position ``q``: the nearest other than 0 (ties to
    the lower), 0 when only 0 is captured."""
    others = [p for p in positions if p != 0] or [0]
    return min(others, key=lambda p: (abs(p - q), p))


def plan(groups: Sequence[tuple[Sequence[int], str]], seeds: Iterable[int], world_size: int,
         patterns: Sequence[str], ep_sample: int | None = None, tp_sample: int | None = None) -> FoldPlan:
    """Close ``seeds`` under the model-parallel groups of ``groups`` and mirror the rest; with
    ``ep_sample``, expert-parallel groups contribute only ``ep_sample`` EP positions; with
    ``tp_sample``, only ``tp_sample`` TP positions are captured anywhere (module doc)."""
    seeds = sorted(set(int(r) for r in seeds))
    bad = [r for r in seeds if not 0 <= r < world_size]
    if bad:
        raise FoldError(f"ranks {bad} are outside the world of {world_size}")
    model_groups_of: dict[int, list[int]] = defaultdict(list)
    model_groups: list[Sequence[int]] = []
    replicated: list[Sequence[int]] = []
    ep_pos: dict[int, int] = {}   # rank -> its position in its EP group
    ep_size = 0
    tp_of: dict[int, tuple[int, ...]] = {}  # rank -> its TP group's members
    tp_pos: dict[int, int] = {}  # rank -> its position in its TP group
    expert_groups: set[int] = set()
    for ranks, desc in groups:
        if len(ranks) <= 1:
            continue
        if is_replicated(desc, ranks, world_size, patterns):
            replicated.append(ranks)
        else:
            gi = len(model_groups)
            model_groups.append(ranks)
            for r in ranks:
                model_groups_of[r].append(gi)
            if tp_sample and is_tensor_parallel(desc):
                members = tuple(int(m) for m in ranks)
                for i, r in enumerate(members):
                    tp_of.setdefault(r, members)
                    tp_pos.setdefault(r, i)
            if ep_sample and is_expert_parallel(desc):
                expert_groups.add(gi)
                if is_ep_proper(desc):
                    ep_size = max(ep_size, len(ranks))
                    for i, r in enumerate(ranks):
                        ep_pos.setdefault(int(r), i)
    positions: set[int] | None = None
    if ep_sample and ep_size > ep_sample and ep_pos:
        positions = set(ep_positions(ep_size, [ep_pos[r] for r in seeds if r in ep_pos], ep_sample))
    tp_size = max((len(g) for g in tp_of.values()), default=0)
    tp_positions: list[int] = []
    if tp_sample and tp_size > tp_sample:
        tp_positions = ep_positions(tp_size, [0, *(tp_pos[r] for r in seeds if r in tp_pos)], tp_sample)
    tp_kept = set(tp_positions)

    def unsampled(r: int) -> bool:
        return bool(tp_kept) and r in tp_pos and tp_pos[r] not in tp_kept

    captured: set[int] = set(seeds)
    todo = list(seeds)
    used: set[int] = set()
    while todo:
        r = todo.pop()
        for gi in model_groups_of.get(r, ()):
            if gi in used:
                continue
            used.add(gi)
            sampled = positions is not None and gi in expert_groups
            for m in model_groups[gi]:
                if sampled and ep_pos.get(m, -1) not in positions:
                    continue
                if unsampled(m):
                    continue
                if m not in captured:
                    captured.add(m)
                    todo.append(m)
    order = sorted(captured)
    # mirror: the captured rank sharing the most data-parallel groups with each rank
    score: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for ranks in replicated:
        if len(ranks) >= world_size:
            continue
        present = [r for r in ranks if r in captured]
        if not present:
            continue
        for u in ranks:
            if u in captured:
                continue
            s = score[u]
            for c in present:
                s[c] += 1
    rep = list(range(world_size))
    mirrored_in_tp = []
    for u in range(world_size):
        if u in captured:
            continue
        if unsampled(u):
            mirrored_in_tp.append(u)
            continue
        s = score.get(u)
        rep[u] = min(s, key=lambda c: (-s[c], c)) if s else order[u % len(order)]
    for u in mirrored_in_tp:  # its TP group's member at the mirroring position, or that member's stand-in
        rep[u] = rep[tp_of[u][tp_mirror_position(tp_pos[u], tp_positions)]]
    return FoldPlan(world_size=world_size, captured=order, rep=rep, replicated=list(patterns),
                    ep_positions=sorted(positions) if positions is not None else [], tp_positions=tp_positions)
