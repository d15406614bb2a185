"""A capture's point-to-point traffic: sends matched to receives per channel (group, source,
destination, tag) in order, a send's tensor delivered with the receive's answer or read where
the sender staged it; traffic to a rank a folded capture does not run is refused by name."""

from __future__ import annotations

import time
from collections import deque

import torch

from nccl_ext.core import protocol, wire
from nccl_ext.core.protocol import Ok, Recv, Send, XRecv, XSend
from nccl_ext.exchange.ipc import is_device_location
from prism_launch.capture.events import EventLog
from prism_launch.capture.notes import TraceNotes
from prism_launch.capture.ops_state import CaptureDeadlineError, CaptureError, OpGroup, Reads, describe
from prism_launch.capture.slots import SlotScheduler
from prism_launch.capture.staged import StagedResults


class PointToPoint:
    """Matches sends to receives. Given the capture's ``log`` (groups, ranks, rows), the trace's
    ``scope`` and ``fold`` plan, its ``notes``, the ``staged`` data (sends read where they lie),
    the coordinator's pending ``reads`` of staged regions (shared: a receive adds one), the
    slot ``scheduler`` and the coordinator's ``busy_s``."""

    def __init__(self, log: EventLog, scope: frozenset[int] | None, fold, notes: TraceNotes,
                 staged: StagedResults, reads: dict, scheduler: SlotScheduler, busy_s: dict) -> None:
        self._log = log
        self.scope = scope
        self.fold = fold
        self._notes = notes
        self._staged = staged
        self._reads = reads
        self.scheduler = scheduler
        self.busy_s = busy_s
        self._sends: dict[tuple[str, int, int, int], deque] = {}
        self._recvs: dict[tuple[str, int, int, int], deque] = {}

    def on_send(self, conn, m: Send | XSend, tensor, staged: tuple | None = None) -> None:
        """A send: its tensor came over the connection, or (``staged``: the sender's op id and
        the location) lies in the sender's arena until the receiver has read it."""
        _op_id, key, dst, tag, seq, unit, t, wall, cpu = m[:9]
        src = self._log.rank_of[conn]
        group = self._log.group(key)
        self._check_p2p_peer(src, dst, group, "send to")
        tkey = f"p/{group.id}/{src}/{dst}/{tag}/{seq}"
        extra = {"tag": tag, "kind": "send", "n": 1, "shapes": [list(tensor.shape)],
                 "dtypes": [wire.dtype_name(tensor.dtype)], "digests": []}
        # a sandbox-scoped trace stores what a sandbox rank receives from a virtual one
        if not (self.scope is None or (dst in self.scope and src not in self.scope)):
            tkey = None
        row = self._log.row(src, unit, "p2p", "send", group, seq, dst, [tensor], t, t, wall, cpu, tkey, None)
        # its digest, a sandbox rank's statistics, the kept copy: after the receiver has it
        note = (self._notes.note_send, (src, row, extra, tensor, tkey, staged is not None))
        if staged is not None and is_device_location(staged[1]):
            staged = (conn, *staged, note)  # taken once the receiver has read it
        else:
            self._notes.defer(*note)
            if staged is not None:
                staged = (conn, *staged)
        chan = (key, src, dst, tag)
        waiting = self._recvs.get(chan)
        if waiting:
            self._deliver(waiting.popleft(), seq, tensor, src, staged)
        else:
            self._sends.setdefault(chan, deque()).append((seq, tensor, staged))

    def on_xsend(self, conn, m: XSend) -> None:
        op_id, location = m.op_id, (self._log.rank_of[conn], *m.location)
        src, dst = location[0], m.dst
        reads = self.scope is None or src in self.scope or dst in self.scope
        tensor = self._staged.located(location, reads, f"send from rank {src} to rank {dst} (seq {m.seq})")[0]
        self.on_send(conn, m, tensor, (op_id, location))

    def on_recv(self, conn, m: Recv) -> None:
        op_id, key, src, tag, seq, unit, t, wall, cpu = m
        dst = self._log.rank_of[conn]
        group = self._log.group(key)
        self._check_p2p_peer(dst, src, group, "receive from")
        row = self._log.row(dst, unit, "p2p", "recv", group, seq, src, None, t, t, wall, cpu, None,
                        {"tag": tag, "kind": "recv"})
        self.scheduler.issued(dst, op_id)
        waiter = (op_id, conn, row, seq, dst, time.monotonic())
        chan = (key, src, dst, tag)
        queued = self._sends.get(chan)
        if queued:
            send_seq, tensor, staged = queued.popleft()
            self._deliver(waiter, send_seq, tensor, src, staged)
        else:
            self._recvs.setdefault(chan, deque()).append(waiter)

    def _check_p2p_peer(self, rank: int, peer: int, group: OpGroup, verb: str) -> None:
        if self.fold is not None and not self.fold.is_captured(peer):
            raise CaptureError(
                f"folded capture: rank {rank} wants to {verb} rank {peer} on group {describe(group.ranks)} "
                f"({group.desc or group.key}), but rank {peer} is not in the captured set "
                f"{describe(tuple(self.fold.captured))}: point-to-point traffic crosses data-parallel replicas. "
                "Capture without folding (capture.fold=false) or name the group's pattern differently in "
                "capture.replicated_groups"
            )

    def _deliver(self, waiter, send_seq: int, tensor: torch.Tensor, src: int, staged: tuple | None = None) -> None:
        """Answer a receive: with the tensor, or with where the sender staged it (``staged``: the
        sender's connection, op id, location; the sender frees the region once it is read)."""
        op_id, conn, row, seq, dst, _ = waiter
        if seq != send_seq:
            raise CaptureError(f"p2p order mismatch: rank {dst} recv #{seq} from rank {src} matched send #{send_seq}")
        row["t_end"] = time.monotonic() - self._log.t0
        row["dtype"], row["shape"] = wire.dtype_name(tensor.dtype), list(tensor.shape)
        row["nbytes"] = tensor.numel() * tensor.element_size()
        t0 = time.perf_counter()
        if staged is None:
            wire.send(conn, protocol.encode(Ok(op_id)), [tensor])
        else:
            owner, send_id, location, *notes = staged
            self._reads[(dst, op_id)] = Reads(1, [(owner, send_id)], notes)
            wire.send(conn, protocol.encode(XRecv(op_id, location)))
        self.busy_s["reply"] += time.perf_counter() - t0
        self.scheduler.answered(dst, op_id)
        self._log.ops_completed += 1

    def check_deadlines(self, now: float, timeout_s: float) -> None:
        """Raise :class:`CaptureDeadlineError` for a receive that waited past ``timeout_s``."""
        for (key, src, dst, tag), waiters in self._recvs.items():
            for _op, _conn, _row, seq, _dst, t in waiters:
                if now - t > timeout_s:
                    g = self._log.groups[key]
                    raise CaptureDeadlineError(
                        f"recv (seq {seq}, tag {tag}) on group {describe(g.ranks)} ({g.desc or key}): "
                        f"rank {dst} waited {now - t:.1f}s for a send from rank {src} that never came "
                        f"(deadline {timeout_s:g}s)"
                    )

    def waiting(self) -> bool:
        """Whether a receive is still waiting for its send."""
        return any(self._recvs.values())
