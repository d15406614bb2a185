"""What a capture records of its ranks' ops as they come: the groups, which connection is which
rank, one event row per op, and how many ops completed — shared by the coordinator and the
collaborators that handle some of its messages (:mod:`prism_launch.capture.p2p`,
:mod:`prism_launch.capture.synthesized`)."""

from __future__ import annotations

import json
import time
from multiprocessing.connection import Connection

from nccl_ext.core import wire
from prism_launch.capture.ops_state import CaptureError, OpGroup


class EventLog:
    def __init__(self, world_size: int) -> None:
        self.t0 = time.monotonic()
        self.events: list[dict] = []
        self.groups: dict[str, OpGroup] = {}
        self.rank_of: dict[Connection, int] = {}
        self.ops_completed = 0
        self._next_idx = [0] * world_size
        self._ints: dict[tuple[int, str, int], list] = {}
        """(rank, group key, seq) -> the values of a small integer contribution
        (:class:`nccl_ext.core.protocol.Ints`), until the op's own message makes its row."""

    def note_ints(self, rank: int, key: str, seq: int, values: list) -> None:
        self._ints[(rank, key, seq)] = values

    def take_ints(self, rank: int, key: str, seq: int, extra: dict) -> dict:
        """``extra`` with the op's integer values (``"ints"``: one list per tensor) when the rank sent them."""
        values = self._ints.pop((rank, key, seq), None)
        if values is not None:
            extra["ints"] = values
        return extra

    def group(self, key: str) -> OpGroup:
        try:
            return self.groups[key]
        except KeyError:
            raise CaptureError(f"op on unregistered group {key}") from None

    def row(self, rank, unit, kind, op, group, seq, peer, tensors, t_start, t_end, wall, cpu, key, extra) -> dict:
        idx = self._next_idx[rank]
        self._next_idx[rank] = idx + 1
        first = tensors[0] if tensors else None
        row = {
            "rank": rank, "idx": idx, "unit": unit, "kind": kind, "op": op,
            "group": -1 if group is None else group.id, "seq": seq, "peer": peer,
            "dtype": wire.dtype_name(first.dtype) if first is not None else "",
            "shape": list(first.shape) if first is not None else [],
            "nbytes": sum(t.numel() * t.element_size() for t in tensors or ()),
            "t_start": t_start - self.t0, "t_end": t_end - self.t0,
            "compute_wall_s": wall, "compute_cpu_s": cpu, "tensor_key": key,
            "extra": None if extra is None else json.dumps(extra),
        }
        self.events.append(row)
        return row
