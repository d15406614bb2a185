"""EP-folded capture (``capture.ep_sample``): what uncaptured expert-parallel ranks contribute
to their EP group's ops, from what the captured routers did at the same op.

A folded group's uncaptured member normally contributes its stand-in's data. On an
expert-parallel group that would make every uncaptured rank route exactly as one captured rank
(one sample times n). Instead:

- an all-gather of small integer contributions (the dispatcher's tokens per expert): an
  uncaptured member routes its stand-in's token count over the experts in proportion to the
  captured members' summed counts at this op (:func:`nccl_ext.core.routing_counts.apportion`),
  so an expert the captured routers favour is favoured by every rank;
- an all-to-all: an uncaptured member's piece to a captured member has the size that member
  expects from it (sent by the rank with the op, :class:`nccl_ext.core.protocol.Outs`: what the
  gathered counts told it), its rows taken from the stand-in's own pieces (synthesized data);
  pieces between captured members are their real ones (exact).

:func:`derived_counts` recomputes the counts the capture gave uncaptured members, from the
captured ones the events keep, for the report's statistics.
"""

from __future__ import annotations

import torch

from nccl_ext.core.ops import Collective
from nccl_ext.core.routing_counts import apportion
from prism_launch.capture.fold import is_expert_parallel


def derived_counts(captured: dict[int, list[int]], group: list[int], standin_of: dict[int, int]) -> dict[int, list[int]]:
    """Every member's counts of one count all-gather: captured members' own, each uncaptured
    member's apportioned from the captured sum (its stand-in's total; ``salt``: its position)."""
    summed = [sum(col) for col in zip(*captured.values())]
    out = {}
    for i, m in enumerate(group):
        if m in captured:
            out[m] = list(captured[m])
        else:
            out[m] = apportion(summed, sum(captured[standin_of[m]]), salt=i)
    return out


class EpFold:
    """The coordinator's part of EP folding for the ``fold`` plan (no-op when it samples no EP)."""

    def __init__(self, fold) -> None:
        self.active = fold is not None and bool(getattr(fold, "ep_positions", None))
        self._outs: dict[tuple[int, str, int], list] = {}
        self.synthesized = {"count_gathers": 0, "all_to_alls": 0, "pieces_exact": 0, "pieces_synthesized": 0}

    def note_outs(self, rank: int, key: str, seq: int, shapes: list) -> None:
        self._outs[(rank, key, seq)] = shapes

    def applies(self, group) -> bool:
        return self.active and group.sources is not None and is_expert_parallel(group.desc)

    def contributions(self, pc, contributions: list) -> list:
        """``contributions`` (uncaptured members' already their stand-ins') with uncaptured
        members' rewritten as the module doc says, for an op on an EP group."""
        group = pc.group
        captured = [i for i, c in enumerate(pc.contributions) if c is not None]
        if pc.kind is Collective.ALL_GATHER and captured and self._counts(contributions, captured):
            return self._gather(group, contributions, captured)
        if pc.kind is Collective.ALL_TO_ALL:
            return self._all_to_all(pc, group, contributions, captured)
        return contributions

    @staticmethod
    def _counts(contributions: list, captured: list[int]) -> bool:
        return all(len(contributions[i]) == 1 and not contributions[i][0].is_floating_point()
                   and contributions[i][0].dim() == 1 for i in captured)

    def _gather(self, group, contributions: list, captured: list[int]) -> list:
        mine = {group.ranks[i]: [int(x) for x in contributions[i][0].tolist()] for i in captured}
        index = {r: i for i, r in enumerate(group.ranks)}
        standin = {r: group.sources[i] for i, r in enumerate(group.ranks)}
        counts = derived_counts(mine, list(group.ranks), standin)
        out = list(contributions)
        like = contributions[captured[0]][0]
        for r, c in counts.items():
            if r not in mine:
                out[index[r]] = [torch.tensor(c, dtype=like.dtype)]
        self.synthesized["count_gathers"] += 1
        return out

    def _all_to_all(self, pc, group, contributions: list, captured: list[int]) -> list:
        out = list(contributions)
        receivers = {j: self._outs.pop((group.ranks[j], group.key, pc.seq), None) for j in captured}
        for i, c in enumerate(pc.contributions):
            if c is not None:
                self.synthesized["pieces_exact"] += len(captured)
                continue
            own = contributions[i]  # the stand-in's pieces
            parts = [p.reshape(p.shape[0], -1) for p in own if p.dim() >= 1 and p.numel() > 0]
            rows = torch.cat(parts) if parts and len({p.shape[1] for p in parts}) == 1 else None
            pieces = list(own)
            for j, shapes in receivers.items():
                if shapes is None:
                    continue
                pieces[j] = _rows(rows, shapes[i], own[j])
                self.synthesized["pieces_synthesized"] += 1
            out[i] = pieces
        self.synthesized["all_to_alls"] += 1
        return out


def _numel(shape: list) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rows(rows: torch.Tensor | None, shape: list, like: torch.Tensor) -> torch.Tensor:
    """A piece of ``shape`` made of the first rows of ``rows`` (repeated when too few)."""
    need = shape[0] if shape else 1
    if rows is None or need == 0 or rows[0].numel() * need != _numel(shape):
        return torch.zeros(shape, dtype=like.dtype)
    reps = -(-need // rows.shape[0])
    flat = rows.repeat(reps, 1)[:need] if reps > 1 else rows[:need]
    return flat.reshape(shape).to(like.dtype).clone()
