"""A PrismTrace seen through the :class:`nccl_ext.replay.transport.Recording` interface.

A folded trace (``fold.json``) holds only the captured ranks; an uncaptured member of a
group is answered by its captured stand-in (:meth:`prism_launch.capture.fold.FoldPlan.sources`),
exactly as the capture coordinator filled it in, and collectives on such groups carry
their recorded results (``r/<group>/<seq>/<i>``).
"""

from __future__ import annotations

import json

import torch

from nccl_ext.replay.transport import RecordedOp
from prism_launch.trace import TraceLayout, TraceReader


class TraceRecording:
    """Indexes a trace's events by (rank, group, seq) for O(1) lookups during replay."""

    def __init__(self, reader: TraceReader, schedule: dict[int, list[float]] | None = None):
        """``schedule``: per rank, the predicted time of each event (by trace index); it
        replaces the capture's wall-clock ``t_start`` of the ops."""
        from prism_launch.trace.fold import FoldPlan

        self.reader = reader
        fold = TraceLayout.FOLD
        self.fold = FoldPlan.from_dict(reader.read_json(fold)) if fold in reader.json_files() else None
        self._sources: dict[int, dict[int, int] | None] = {}
        self._present: dict[int, tuple[int, ...]] = {}
        self._gids = {g["key"]: int(g["id"]) for g in reader.manifest.groups}
        self._ranks = {int(g["id"]): tuple(g["ranks"]) for g in reader.manifest.groups}
        self._coll: dict[tuple[int, int, int], RecordedOp] = {}
        self._sent: dict[tuple[int, int, int, int, int], tuple[RecordedOp, str]] = {}
        self._recv: dict[tuple[int, int, int, int, int], RecordedOp] = {}
        self._ops: dict[int, list[tuple[RecordedOp, int, int, int, int]]] = {}
        table = reader.events()
        cols = {name: table.column(name).to_pylist() for name in
                ("rank", "idx", "unit", "kind", "op", "group", "seq", "peer", "t_start", "t_end", "tensor_key",
                 "extra")}
        for i in range(table.num_rows):
            kind = cols["kind"][i]
            if kind not in ("collective", "p2p"):
                continue
            extra = json.loads(cols["extra"][i]) if cols["extra"][i] else {}
            rank, gid, seq, peer = cols["rank"][i], cols["group"][i], cols["seq"][i], cols["peer"][i]
            tag = int(extra.get("tag", 0))
            t_start = cols["t_start"][i]
            if schedule is not None:
                times = schedule.get(rank)
                if times is not None and cols["idx"][i] < len(times):
                    t_start = times[cols["idx"][i]]
            rec = RecordedOp(
                op=cols["op"][i], unit=cols["unit"][i], t_start=t_start, t_end=cols["t_end"][i],
                n_tensors=int(extra.get("n", 1)),
                shapes=tuple(tuple(s) for s in extra.get("shapes", ())),
                dtypes=tuple(extra.get("dtypes", ())),
                idx=cols["idx"][i], kind=extra.get("kind", ""), root=extra.get("root"), reduce=extra.get("reduce"),
                digests=tuple(extra.get("digests", ())),
                stats=tuple(tuple(x) for x in extra.get("stats", ())),
            )
            self._ops.setdefault(rank, []).append((rec, gid, seq, peer, tag))
            if kind == "collective":
                self._coll[(rank, gid, seq)] = rec
            elif cols["op"][i] == "send":
                self._sent[(gid, rank, peer, tag, seq)] = (rec, cols["tensor_key"][i])
            else:
                self._recv[(rank, gid, peer, tag, seq)] = rec
        for ops in self._ops.values():
            ops.sort(key=lambda o: o[0].idx)

    def _map(self, group_id: int) -> dict[int, int] | None:
        """member -> captured stand-in for a folded group; None when every member was captured."""
        m = self._sources.get(group_id, False)
        if m is False:
            m = None
            if self.fold is not None:
                ranks = self._ranks[group_id]
                src = self.fold.sources(ranks)
                if src is not None and src != ranks:
                    m = dict(zip(ranks, src))
            self._sources[group_id] = m
        return m

    def _source(self, rank: int, group_id: int) -> int:
        """The captured rank whose recording stands in for ``rank`` in this group."""
        if self.fold is None or self.fold.is_captured(rank):
            return rank
        m = self._map(group_id)
        return rank if m is None else m[rank]

    def captured_members(self, group_id: int) -> tuple[int, ...]:
        """Members of a group that were captured (every stand-in is one of them)."""
        hit = self._present.get(group_id)
        if hit is None:
            ranks = self._ranks[group_id]
            hit = self._present[group_id] = ranks if self.fold is None else tuple(
                r for r in ranks if self.fold.is_captured(r))
        return hit

    def folded(self, group_id: int) -> bool:
        """Whether the group has members that were not captured (its results are recorded)."""
        return self.fold is not None and self._map(group_id) is not None

    def piece(self, rank: int, group_id: int, seq: int, i: int) -> torch.Tensor:
        """Piece ``i`` of ``rank``'s recorded contribution, as a view of the trace file's pages."""
        return self.reader.tensor_view(self._source(rank, group_id), f"c/{group_id}/{seq}/{i}")

    def payload(self, group_id: int, src: int, dst: int, tag: int, seq: int) -> torch.Tensor:
        """A recorded send's payload, as a view of the trace file's pages."""
        return self.reader.tensor_view(src, self._sent[(group_id, src, dst, tag, seq)][1])

    def result_meta(self, rank: int, group_id: int, seq: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of a folded collective's recorded result for ``rank`` (nothing read)."""
        out, i = [], 0
        while self.reader.has_tensor(rank, f"r/{group_id}/{seq}/{i}"):
            out.append(self.reader.tensor_meta(rank, f"r/{group_id}/{seq}/{i}"))
            i += 1
        return out

    def result_piece(self, rank: int, group_id: int, seq: int, i: int) -> torch.Tensor:
        return self.reader.tensor_view(rank, f"r/{group_id}/{seq}/{i}")

    def result(self, rank: int, group_id: int, seq: int) -> list[torch.Tensor]:
        """A folded collective's recorded result for captured ``rank``."""
        out, i = [], 0
        while self.reader.has_tensor(rank, f"r/{group_id}/{seq}/{i}"):
            out.append(self.reader.tensor(rank, f"r/{group_id}/{seq}/{i}"))
            i += 1
        return out

    def group_id(self, key: str) -> int | None:
        return self._gids.get(key)

    def group_ranks(self, group_id: int) -> tuple[int, ...]:
        return self._ranks[group_id]

    def ops_of(self, rank: int):
        return self._ops.get(rank, [])

    def collective(self, rank: int, group_id: int, seq: int) -> RecordedOp | None:
        return self._coll.get((self._source(rank, group_id), group_id, seq))

    def contribution(self, rank: int, group_id: int, seq: int) -> list[torch.Tensor]:
        source = self._source(rank, group_id)
        rec = self._coll[(source, group_id, seq)]
        if rec.n_tensors and not self.reader.has_tensor(source, f"c/{group_id}/{seq}/0"):
            scope = (self.reader.manifest.extra or {}).get("payload_ranks")
            raise KeyError(
                f"the trace holds no tensors of rank {rank}'s contribution to group {group_id} seq {seq}"
                + (f": it was recorded for sandbox ranks {scope} (capture.payload=exact keeps only what they "
                   "consume); capture again for these sandbox ranks, or with capture.payload=full" if scope else ""))
        return [self.reader.tensor(source, f"c/{group_id}/{seq}/{i}") for i in range(rec.n_tensors)]

    def stored(self, rank: int, group_id: int, seq: int) -> bool:
        source = self._source(rank, group_id)
        rec = self._coll.get((source, group_id, seq))
        return rec is not None and (not rec.n_tensors or self.reader.has_tensor(source, f"c/{group_id}/{seq}/0"))

    def sent(self, group_id: int, src: int, dst: int, tag: int, seq: int):
        hit = self._sent.get((group_id, src, dst, tag, seq))
        if hit is None:
            return None
        rec, key = hit
        return rec, (None if key is None else (lambda: self.reader.tensor(src, key)))

    def received(self, rank: int, group_id: int, src: int, tag: int, seq: int) -> RecordedOp | None:
        return self._recv.get((rank, group_id, src, tag, seq))
