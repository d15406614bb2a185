"""The fold plan of a folded capture as the trace records it (``fold.json``): which logical
ranks were captured and which captured rank stands in for every other one. How the plan is
made is :mod:`prism_launch.capture.fold`'s business; capture, replay and prediction read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prism_launch.errors import FoldError


@dataclass(slots=True)
class FoldPlan:
    world_size: int
    captured: list[int]
    """Logical ranks that run in the capture, sorted."""
    rep: list[int]
    """For every logical rank, the captured rank that mirrors it (itself when captured)."""
    replicated: list[str] = field(default_factory=list)
    """The group-description patterns treated as data-parallel."""
    ep_positions: list[int] = field(default_factory=list)
    """EP positions captured in every expert-parallel group (``capture.ep_sample``); empty: whole
    EP groups are captured."""
    tp_positions: list[int] = field(default_factory=list)
    """TP positions captured in every tensor-parallel group (``capture.tp_sample``); empty: whole
    TP groups are captured."""
    _captured_set: frozenset = frozenset()
    _cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._captured_set = frozenset(self.captured)

    @property
    def folded(self) -> bool:
        return len(self.captured) < self.world_size

    def is_captured(self, rank: int) -> bool:
        return rank in self._captured_set

    def sources(self, group_ranks: Sequence[int]) -> tuple[int, ...] | None:
        """For each member of a group, the captured rank whose data stands in for it
        (members themselves when captured); None if no member is captured."""
        key = tuple(group_ranks)
        hit = self._cache.get(key)
        if hit is not None or key in self._cache:
            return hit
        present = [r for r in key if r in self._captured_set]
        if not present:
            out = None
        else:
            members = set(key)
            out = tuple(
                r if r in self._captured_set
                else (self.rep[r] if self.rep[r] in members else present[i % len(present)])
                for i, r in enumerate(key)
            )
        self._cache[key] = out
        return out

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "captured": self.captured, "rep": self.rep,
                "replicated": self.replicated, "ep_positions": self.ep_positions,
                "tp_positions": self.tp_positions}

    @classmethod
    def from_dict(cls, d: dict) -> FoldPlan:
        return cls(world_size=int(d["world_size"]), captured=[int(r) for r in d["captured"]],
                   rep=[int(r) for r in d["rep"]], replicated=list(d.get("replicated", [])),
                   ep_positions=[int(p) for p in d.get("ep_positions", [])],
                   tp_positions=[int(p) for p in d.get("tp_positions", [])])

    @classmethod
    def identity(cls, world_size: int) -> FoldPlan:
        return cls(world_size=world_size, captured=list(range(world_size)), rep=list(range(world_size)))
