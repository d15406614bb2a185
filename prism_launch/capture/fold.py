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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from prism_launch.trace.fold import FoldError, FoldPlan

__all__ = ["FoldError", "FoldPlan", "is_replicated", "plan"]


def is_replicated(desc: str, ranks: Sequence[int], world_size: int, patterns: Iterable[str]) -> bool:
    if len(ranks) >= world_size:
        return True  # the world group spans every replica by definition
    return any(p and p in (desc or "") for p in patterns)


def plan(groups: Sequence[tuple[Sequence[int], str]], seeds: Iterable[int], world_size: int,
         patterns: Sequence[str]) -> FoldPlan:
    """Close ``seeds`` under the model-parallel groups of ``groups`` and mirror the rest."""
    seeds = sorted(set(int(r) for r in seeds))
    bad = [r for r in seeds if not 0 <= r < world_size]
    if bad:
        raise FoldError(f"ranks {bad} are outside the world of {world_size}")
    model_groups_of: dict[int, list[int]] = defaultdict(list)
    model_groups: list[Sequence[int]] = []
    replicated: list[Sequence[int]] = []
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
    captured: set[int] = set(seeds)
    todo = list(seeds)
    used: set[int] = set()
    while todo:
        r = todo.pop()
        for gi in model_groups_of.get(r, ()):
            if gi in used:
                continue
            used.add(gi)
            for m in model_groups[gi]:
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
    for u in range(world_size):
        if u in captured:
            continue
        s = score.get(u)
        rep[u] = min(s, key=lambda c: (-s[c], c)) if s else order[u % len(order)]
    return FoldPlan(world_size=world_size, captured=order, rep=rep, replicated=list(patterns))
