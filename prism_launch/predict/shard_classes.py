"""Shard classes: ranks whose compute spans are interchangeable, so calibration measures one
class member (with repeats) and gives every member the median.

Two ranks are in one class when they run the same shard of the same model on the same kind
of data: the tensor-parallel peers of one pipeline stage (each holds a slice of the same
layers, the same shapes), the data-parallel replicas of a model shard, and a folded capture's
uncaptured ranks with the captured rank that stands in for them. What tells them apart, from
what the trace knows:

* the rank's position in its pipeline group (the stage: stages hold different layers) — a
  group named as a pipeline group (:data:`PIPELINE_DESCS`);
* the rank's own event sequence when the trace has it: kind, op, bytes and group size of
  every event. Ranks whose sequences differ (the first and last stage, an unnamed pipeline of
  DeepSpeed's, MoE ranks whose routing sent them different token counts) are never one class,
  whatever the group names say. Peers and group ids are left out: TP peers talk to different
  neighbours over groups of the same shape.

A TP8·PP4 job of 8,192 ranks is 4 classes (one per stage); a ZeRO job's replicas are one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

PIPELINE_DESCS = ("PIPELINE_MODEL_PARALLEL_GROUP",)
"""Group descriptions naming a pipeline group (Megatron's), whose member index is the stage."""


@dataclass(frozen=True, slots=True)
class ShardClass:
    members: tuple[int, ...]
    """Sorted ranks of the class (captured ranks only: the trace's events are theirs)."""
    stage: int | None
    """Pipeline stage (position in a pipeline group), None where no pipeline group is named."""

    @property
    def representative(self) -> int:
        return self.members[0]


def pipeline_stages(groups: Sequence[tuple[Sequence[int], str]]) -> dict[int, int]:
    """Each rank's position in its pipeline group (ranks in none are absent)."""
    out: dict[int, int] = {}
    for ranks, desc in groups:
        if desc in PIPELINE_DESCS and len(ranks) > 1:
            for i, r in enumerate(ranks):
                out[int(r)] = i
    return out


def event_signatures(rows: Sequence[Mapping], group_sizes: Mapping[int, int]) -> dict[int, str]:
    """A digest per rank of its event sequence (kind, op, bytes, group size per event, in order).
    A collective's bytes are the op's (the most any member recorded for it): a broadcast's
    receivers record none of their own, and the TP rank that loads and broadcasts the batch
    is the same shard as its peers."""
    op_bytes: dict[tuple[int, int], int] = {}
    for row in rows:
        if row["kind"] == "collective" and row.get("seq") is not None:
            key = (int(row["group"]), int(row["seq"]))
            op_bytes[key] = max(op_bytes.get(key, 0), int(row["nbytes"]))
    seqs: dict[int, list[tuple[int, str]]] = {}
    for row in rows:
        nbytes = row["nbytes"]
        if row["kind"] == "collective" and row.get("seq") is not None:
            nbytes = op_bytes[(int(row["group"]), int(row["seq"]))]
        sig = f"{row['kind']}:{row['op']}:{nbytes}:{group_sizes.get(int(row['group']), 0)}"
        seqs.setdefault(int(row["rank"]), []).append((int(row["idx"]), sig))
    out = {}
    for r, evs in seqs.items():
        evs.sort()
        out[r] = hashlib.sha256("|".join(s for _, s in evs).encode()).hexdigest()[:16]
    return out


def shard_classes(groups: Sequence[tuple[Sequence[int], str]], ranks: Sequence[int],
                  signatures: Mapping[int, Hashable] | None = None) -> list[ShardClass]:
    """The classes of ``ranks`` (the captured ones), ordered by their first member."""
    stage = pipeline_stages(groups)
    by_key: dict[tuple, list[int]] = {}
    for r in sorted(set(int(r) for r in ranks)):
        key = (stage.get(r), None if signatures is None else signatures.get(r))
        by_key.setdefault(key, []).append(r)
    return sorted((ShardClass(tuple(m), k[0]) for k, m in by_key.items()), key=lambda c: c.members[0])


def classes_of_trace(reader) -> list[ShardClass]:
    """The shard classes of a trace's captured ranks (group structure and event sequences)."""
    m = reader.manifest
    groups = [(tuple(g["ranks"]), g.get("desc") or "") for g in m.groups]
    sizes = {int(g["id"]): len(g["ranks"]) for g in m.groups}
    cols = ["rank", "idx", "kind", "op", "nbytes", "group", "seq"]
    table = reader.events()
    rows = table.select(cols).to_pylist() if hasattr(table, "select") else table.to_pylist()
    return shard_classes(groups, m.ranks_captured, event_signatures(rows, sizes))


def measurement_slices(classes: Sequence[ShardClass], repeats: int, per_slice: int) -> list[list[int]]:
    """Slices (each of distinct ranks, at most ``per_slice``) measuring every class ``repeats``
    times: distinct members first (they are interchangeable), the representative again where a
    class has fewer members than repeats."""
    todo: list[list[int]] = []
    for c in classes:
        todo.append([c.members[i % len(c.members)] for i in range(max(1, repeats))])
    slices: list[list[int]] = []
    while any(todo):
        current: list[int] = []
        added = True
        while added and len(current) < per_slice:
            added = False
            # the classes with the most measurements left first, one rank each per pass: a slice
            # measures several classes at once, and no class is left to run alone at the end
            for queue in sorted(todo, key=len, reverse=True):
                i = next((k for k, r in enumerate(queue) if r not in current), None)
                if i is not None and len(current) < per_slice:
                    current.append(queue.pop(i))
                    added = True
        slices.append(sorted(current))
    return slices
