"""The assistant: a physical process that hosts the virtual ranks during emulation.

For every op a sandbox rank will enter (in its recorded order), the assistant sends it one
message carrying the recorded contributions of the virtual members that op needs — or the
recorded payload of a virtual sender — tagged with the sandbox's event index. Messages
stream ahead of the sandbox up to ``window`` ops per sandbox rank (the CPU form of tensor
prefetching): the sandbox finds its peers' data already there and never reads the trace's
tensors itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nccl_ext import wire
from nccl_ext.device_path import eligible
from nccl_ext.ops import Collective, contributors
from nccl_ext.pruning import CONTROL_TAG, decode, ring_of, run_op, uses_ring
from nccl_ext.replay_transport import Recording


@dataclass(slots=True)
class StreamStats:
    messages: int = 0
    bytes: int = 0
    stalled_s: float = 0.0
    """Time spent waiting for the sandbox to take messages (window full)."""


@dataclass(slots=True)
class AssistantStats:
    streams: dict[int, StreamStats] = field(default_factory=dict)
    ring_ops: int = 0
    """Pruned-ring collectives whose edges this assistant played."""


_READ_LOCK = threading.Lock()


def _payload(recording: Recording, sandbox: tuple[int, ...], rank: int, op, gid: int, seq: int, peer: int,
             tag: int, device_path: bool = False, pruned: bool = False) -> list[torch.Tensor]:
    """Recorded tensors sandbox ``rank`` needs from virtual ranks for one of its ops (none for
    the ops the sandbox's device data path stages itself)."""
    if device_path and op.kind:
        if eligible(sandbox, rank, peer=peer) if op.kind in ("send", "recv") else \
                eligible(sandbox, rank, recording.group_ranks(gid)):
            return []
    if op.kind == "recv":
        if peer in sandbox:
            return []
        _rec, load = recording.sent(gid, peer, rank, tag, seq)
        return [load()]
    if op.kind == "send" or not op.kind or recording.folded(gid):
        return []  # folded groups: the sandbox uses the recorded result, no peer data needed
    if pruned and uses_ring(op.kind, recording.group_ranks(gid), sandbox, False):
        return []  # played on the pruned ring (the edges' data goes there)
    ranks = recording.group_ranks(gid)
    out: list[torch.Tensor] = []
    for m in contributors(Collective(op.kind), len(ranks), op.root):
        r = ranks[m]
        if r != rank and r not in sandbox:
            out.extend(recording.contribution(r, gid, seq))
    return out


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    parts = [torch.frombuffer(bytearray(wire.tensor_bytes(t)), dtype=torch.uint8) for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


_FOREVER = __import__("datetime").timedelta(days=365)


def done_key(rank: int) -> str:
    """Store key a sandbox rank sets when its program has ended."""
    return f"prism/done/{rank}"


class _Sent:
    """A posted send, waited on by its own thread (gloo send works have no future, and a
    timed-out gloo wait closes the connection, so the wait itself carries no deadline)."""

    def __init__(self, work, buf: torch.Tensor, what: str):
        self.buf, self.what = buf, what
        self.finished = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(work,), daemon=True, name="prism-assistant-send").start()

    def _run(self, work) -> None:
        try:
            work.wait(_FOREVER)
        except BaseException as e:  # noqa: BLE001
            self.error = e
        self.finished.set()

    def wait(self, rank: int, sandbox_done: Callable[[], bool]) -> None:
        """Until the sandbox took the message; fail fast if it ended without taking it."""
        ended = RuntimeError(
            f"sandbox rank {rank} ended without taking the recorded data for {self.what}; "
            "its program diverged from the trace (capture again with mode=capture)"
        )
        while not self.finished.wait(0.05):
            if sandbox_done():
                if self.finished.wait(0.5):
                    break
                raise ended
        if self.error is not None:
            if sandbox_done():  # the sandbox's exit closed the connection under this send
                raise ended from self.error
            raise self.error


def _stream(recording: Recording, sandbox: tuple[int, ...], rank: int, physical: dist.ProcessGroup,
            window: int, stats: StreamStats, sandbox_done: Callable[[], bool], device_path: bool = False,
            pruned: bool = False) -> None:
    dst = sandbox.index(rank)
    inflight: list[_Sent] = []
    for op, gid, seq, peer, tag in recording.ops_of(rank):
        with _READ_LOCK:
            tensors = _payload(recording, sandbox, rank, op, gid, seq, peer, tag, device_path, pruned)
        if not tensors:
            continue
        buf = _pack(tensors)
        if buf.numel() == 0:
            continue
        if len(inflight) >= window:
            t0 = time.monotonic()
            inflight.pop(0).wait(rank, sandbox_done)
            stats.stalled_s += time.monotonic() - t0
        what = f"op #{op.idx} ({op.op} on group {gid} seq {seq}, step {op.unit})"
        inflight.append(_Sent(physical.send([buf], dst, op.idx), buf, what))
        stats.messages += 1
        stats.bytes += buf.numel()
    for sent in inflight:
        sent.wait(rank, sandbox_done)


def serve(recording: Recording, sandbox: tuple[int, ...], physical: dist.ProcessGroup, store, *,
          window: int = 32, device_path: bool = False, pruned: bool = False) -> AssistantStats:
    """Stream every sandbox rank's virtual payloads; returns when all were taken.

    The assistant is a server: it waits as long as its sandbox ranks run (their own waits
    carry the deadlines) and fails fast when a sandbox rank ends without taking a message.
    One failed stream fails the whole run.
    """
    stats = AssistantStats({r: StreamStats() for r in sandbox})
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            _stream(recording, sandbox, rank, physical, window, stats.streams[rank],
                    lambda: store.check([done_key(rank)]), device_path, pruned)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(RuntimeError(f"assistant stream to sandbox rank {rank} failed: {e}"))

    threads = [threading.Thread(target=run, args=(r,), name=f"prism-assistant-{r}", daemon=True) for r in sandbox]
    edges: list[threading.Thread] = []
    if pruned:
        threading.Thread(target=_control_loop, args=(recording, sandbox, physical, edges, errors, stats),
                         name="prism-assistant-rings", daemon=True).start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if pruned:  # rings may still run after the last streamed message: serve until every sandbox ended
        while not store.check([done_key(r) for r in sandbox]) and not errors:
            time.sleep(0.05)
        for t in list(edges):
            t.join()
    if errors:
        raise errors[0]
    return stats


def _control_loop(recording: Recording, sandbox: tuple[int, ...], physical: dist.ProcessGroup,
                  edges: list[threading.Thread], errors: list, stats: AssistantStats) -> None:
    """Play the edges of every pruned ring a sandbox rank starts (one thread per op)."""
    me = len(sandbox)
    while True:
        ctrl = torch.empty(5, dtype=torch.int64)
        try:
            physical.recv_anysource([ctrl], CONTROL_TAG).wait(_FOREVER)
        except BaseException:  # noqa: BLE001 - the sandboxes went away: nothing left to play
            return
        gid, seq, kind, reduce, k = decode(ctrl)

        def edge(gid=gid, seq=seq, kind=kind, reduce=reduce, k=k) -> None:
            try:
                ranks = recording.group_ranks(gid)
                cache: dict[int, list[torch.Tensor]] = {}

                def pieces(m: int) -> list[torch.Tensor]:
                    if m not in cache:
                        with _READ_LOCK:
                            cache[m] = recording.contribution(ranks[m], gid, seq)
                    return cache[m]

                run_op(ring_of(ranks, sandbox, me), physical, me, gid, seq, kind, reduce, pieces, k)
                stats.ring_ops += 1
            except BaseException as e:  # noqa: BLE001 - re-raised by serve()
                errors.append(RuntimeError(f"assistant: pruned ring of group {gid} seq {seq} failed: {e}"))

        t = threading.Thread(target=edge, name=f"prism-assistant-ring-{gid}-{seq}", daemon=True)
        t.start()
        edges.append(t)
