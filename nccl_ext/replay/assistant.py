"""The assistant: a physical process that hosts the virtual ranks during emulation.

For every op a sandbox rank will enter (in its recorded order), the assistant sends it one
message carrying the recorded contributions of the virtual members that op needs — or the
recorded payload of a virtual sender — tagged with the sandbox's event index. Messages
stream ahead of the sandbox up to ``window`` ops per sandbox rank (the CPU form of tensor
prefetching): the sandbox finds its peers' data already there and never reads the trace's
tensors itself.

A message is due when the sandbox rank's recorded pace says it enters the op (:class:`Pace`):
the assistant waits for it to be taken until then — the time the rank took in the capture
since the last message it took, :data:`PACE_SLACK` times over, plus ``comm.timeout_s`` — and
then fails naming the rank, the op and how late it is. Before it took any, a rank has
:data:`PACE_SLACK` times ``comm.timeout_s`` from the physical group's forming (its program
builds its model meanwhile).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nccl_ext.core import wire
from nccl_ext.core.errors import CommDeadlineError
from nccl_ext.core.pending import LIMIT_KEY
from nccl_ext.device_path import eligible
from nccl_ext.core.ops import Collective, ReduceKind, contributors
from nccl_ext.core.ranklist import short_ranks
from nccl_ext.pruning.rings import RING_KINDS, RingChannels, ring_of, ring_plan, ring_processes, run_op, uses_ring
from nccl_ext.replay.recording import RecordedOp, Recording


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


def unpack(buf: torch.Tensor, served: list[tuple[int, RecordedOp]], into: list) -> list:
    """Split a message of :func:`_pack` into the served members' contribution tensors (the
    sandbox's side: ``into[m]`` for each served member ``m``)."""
    offset = 0
    for m, rec in served:
        tensors = []
        for shape, dtype in zip(rec.shapes, rec.dtypes):
            dt = wire.dtype_from_name(dtype)
            nbytes = wire.numel(shape) * dt.itemsize
            piece = buf[offset : offset + nbytes]
            if nbytes == 0:
                t = torch.empty(tuple(shape), dtype=dt)
            elif offset % dt.itemsize == 0:
                t = piece.view(dt).reshape(tuple(shape))
            else:  # unaligned for this dtype: copy into a fresh (untracked) buffer
                t = wire.untracked_empty(tuple(shape), dt)
                t.reshape(-1).view(torch.uint8).copy_(piece)
            offset += nbytes
            tensors.append(t)
        into[m] = tensors
    return into


PACE_SLACK = 4.0
"""How many times its recorded time between two ops a sandbox rank may take before the second
one's message is late (its capture's times include the capture's own sharing of GPUs, which
emulation does not have: an emulated rank is seldom slower than its capture)."""


class Pace:
    """When sandbox rank ``rank``'s next messages are due: from the last one it took (when,
    and that op's recorded start), its recorded time to the op since, :data:`PACE_SLACK` times
    over, plus ``timeout_s`` (``comm.timeout_s``); before it took any, ``PACE_SLACK`` times
    ``timeout_s`` from ``start``."""

    def __init__(self, rank: int, timeout_s: float, start: float | None = None):
        self.rank, self.timeout_s = rank, timeout_s
        self.start = time.monotonic() if start is None else start
        self.last: tuple[float, float, str] | None = None
        """(when it was taken, its op's recorded start, what) of the last message taken."""

    def taken(self, t_start: float, what: str) -> None:
        self.last = (time.monotonic(), t_start, what)

    def due(self, t_start: float) -> float:
        if self.last is None:
            return self.start + PACE_SLACK * self.timeout_s
        at, t, _ = self.last
        return at + PACE_SLACK * max(0.0, t_start - t) + self.timeout_s

    def late(self, what: str, t_start: float) -> CommDeadlineError:
        now = time.monotonic()
        if self.last is None:
            since = (f"{now - self.start:.0f} s after the physical group formed, before the rank took any message "
                     f"(it may take {PACE_SLACK:g} x {LIMIT_KEY} to reach its first op)")
        else:
            at, t, prev = self.last
            since = (f"{now - at:.0f} s after it took {prev}; in the capture it reached this op "
                     f"{max(0.0, t_start - t):.1f} s after that one (the assistant allows {PACE_SLACK:g} x that + "
                     f"{LIMIT_KEY})")
        return CommDeadlineError(
            f"deadline exceeded: the assistant: sandbox rank {self.rank} had not taken the recorded data for {what} "
            f"{since}. The rank is stuck (see its log: a wait of its own names what it waits for) or far slower "
            f"than in its capture ({LIMIT_KEY}={self.timeout_s:g}; raise it with {LIMIT_KEY}= if the rank is only "
            "slow)", rank=self.rank)


_NO_CLOCK = __import__("datetime").timedelta(days=365)
"""A posted send's own wait (gloo's send works have no future, and a timed-out gloo wait closes
the connection): it ends when the sandbox takes the message or its connection closes; the
deadline is :meth:`_Sent.wait`'s, which fails the assistant (its process ends, this daemon
thread with it)."""


def awaited(assistant: int, virtual: list[int], idx: int) -> str:
    """What a sandbox op waits for from the assistant (named when it misses its deadline)."""
    few = short_ranks(virtual)
    return (f"the assistant (physical rank {assistant}; its log is under <log-dir>/<world size>) to send "
            f"virtual rank(s) {few}' recorded data for this rank's op #{idx}")


def done_key(rank: int) -> str:
    """Store key a sandbox rank sets when its program has ended."""
    return f"prism/done/{rank}"


class _Sent:
    """A posted send, waited on by its own thread (gloo send works have no future, and a
    timed-out gloo wait closes the connection, so that wait itself carries no clock: it ends
    when the sandbox takes the message, or with an error when the sandbox's process ends and
    its connection closes); :meth:`wait` carries the deadline (the rank's :class:`Pace`)."""

    def __init__(self, work, buf: torch.Tensor, what: str, t_start: float = 0.0):
        self.buf, self.what, self.t_start = buf, what, t_start
        self.finished = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(work,), daemon=True, name="prism-assistant-send").start()

    def _run(self, work) -> None:
        try:
            work.wait(_NO_CLOCK)
        except BaseException as e:  # noqa: BLE001
            self.error = e
        self.finished.set()

    def wait(self, rank: int, sandbox_done: Callable[[], bool], pace: Pace | None = None) -> None:
        """Until the sandbox took the message; fail fast if it ended without taking it, and
        by the message's due time (``pace``) if it is still running without taking it."""
        ended = RuntimeError(
            f"sandbox rank {rank} ended without taking the recorded data for {self.what}; "
            "its program diverged from the trace (capture again with mode=capture)"
        )
        due = pace.due(self.t_start) if pace is not None else None
        while not self.finished.wait(0.05):
            if sandbox_done():
                if self.finished.wait(0.5):
                    break
                raise ended
            if due is not None and time.monotonic() > due:
                raise pace.late(self.what, self.t_start)
        if self.error is not None:
            if sandbox_done():  # the sandbox's exit closed the connection under this send
                raise ended from self.error
            raise self.error
        if pace is not None:
            pace.taken(self.t_start, self.what)


def _stream(recording: Recording, sandbox: tuple[int, ...], rank: int, physical: dist.ProcessGroup,
            window: int, stats: StreamStats, sandbox_done: Callable[[], bool], device_path: bool = False,
            pruned: bool = False, pace: Pace | None = None) -> None:
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
            inflight.pop(0).wait(rank, sandbox_done, pace)
            stats.stalled_s += time.monotonic() - t0
        what = f"op #{op.idx} ({op.op} on group {gid} seq {seq}, step {op.unit})"
        inflight.append(_Sent(physical.send([buf], dst, op.idx), buf, what, op.t_start))
        stats.messages += 1
        stats.bytes += buf.numel()
    for sent in inflight:
        sent.wait(rank, sandbox_done, pace)


def serve(recording: Recording, sandbox: tuple[int, ...], physical: dist.ProcessGroup, store, *,
          window: int = 32, device_path: bool = False, pruned: bool = False, rings: RingChannels | None = None,
          grace_s: float = 10.0, timeout_s: float | None = None) -> AssistantStats:
    """Stream every sandbox rank's virtual payloads and play the edges of every pruned ring;
    returns when all were taken and played.

    The assistant is a server: it waits as long as its sandbox ranks run (their own waits
    carry the deadlines, ``comm.timeout_s``; a sandbox that stops communicating fails by them
    and ends) and fails fast when a sandbox rank ends without taking a message, when its
    connection closes, when a rank still running has not taken a message by its due time
    (:class:`Pace`, from ``timeout_s``: ``comm.timeout_s``; None: no due times), or when every
    sandbox rank has ended ``grace_s`` ago with a ring op not played (each ring op has its own
    deadline, the rings' ``timeout_s``). The first failed stream or ring fails the whole run at
    once (the other streams' threads are daemons; the assistant's process ends without
    interpreter teardown).
    """
    stats = AssistantStats({r: StreamStats() for r in sandbox})
    errors: list[BaseException] = []

    changed = threading.Event()
    """Set when a stream or a ring player ends or fails: the caller looks again."""

    def run(rank: int) -> None:
        try:
            _stream(recording, sandbox, rank, physical, window, stats.streams[rank],
                    lambda: store.check([done_key(rank)]), device_path, pruned,
                    Pace(rank, timeout_s) if timeout_s is not None else None)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            # a deadline names the assistant and the rank already, and keeps its type
            errors.append(e if isinstance(e, CommDeadlineError) else
                          RuntimeError(f"assistant stream to sandbox rank {rank} failed: {e}"))
        finally:
            changed.set()

    threads = [threading.Thread(target=run, args=(r,), name=f"prism-assistant-{r}", daemon=True) for r in sandbox]
    players: list[_RingPlayer] = []

    def ended() -> bool:
        return store.check([done_key(r) for r in sandbox])

    if pruned:
        if rings is None:
            raise ValueError("serve(pruned=True) needs the rings' channels")
        plan = ring_plan(recording, sandbox, len(sandbox), len(sandbox))
        rings.open(plan)
        players = [_RingPlayer(recording, sandbox, gid, ops, rings, errors, stats, ended, changed, grace_s)
                   for gid, ops in sorted(ring_ops(recording, sandbox, plan).items())]
    for t in threads:
        t.start()
    ended_at: float | None = None
    while not errors:
        streaming = any(t.is_alive() for t in threads)
        playing = [p for p in players if p.thread.is_alive()]
        if not streaming and not playing:
            break
        if not streaming:  # the sandboxes took every message: the rings have grace_s past their end
            if ended_at is None and ended():
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > grace_s:
                raise _unplayed(playing)
        changed.wait(0.05)  # a thread ended, or look at the store again
        changed.clear()
    if errors:
        raise errors[0]
    return stats


def ended_within(ended: Callable[[], bool], grace_s: float) -> bool:
    """Whether every sandbox rank ends within ``grace_s``: the first one to end closes the
    connections a ring op waits on while the others may still be on their way out."""
    due = time.monotonic() + grace_s
    while not ended():
        if time.monotonic() > due:
            return False
        time.sleep(0.05)
    return True


def _unplayed(left: list[_RingPlayer]) -> RuntimeError:
    return RuntimeError(
        f"the sandbox ranks ended with {len(left)} pruned ring(s) not played to the end (group {left[0].gid} at "
        f"seq {left[0].at}, {left[0].kind_at}); their program diverged from the trace (capture again with "
        "mode=capture)")


RingOp = tuple[int, str, ReduceKind | None, int]
"""(seq, collective kind, reduction, contribution pieces) of a pruned-ring op."""


def ring_ops(recording: Recording, sandbox: tuple[int, ...], plan: dict[int, tuple[int, ...]]) -> dict[int, list[RingOp]]:
    """Per group of the assistant's ring plan (:func:`nccl_ext.pruning.rings.ring_plan`: the groups
    whose rings have edges), the collectives the sandbox ranks run over it, in the group's
    order — what the assistant plays, in the order every live member issues them."""
    out: dict[int, dict[int, RingOp]] = {gid: {} for gid in plan}
    for rank in sandbox:
        for op, gid, seq, _peer, _tag in recording.ops_of(rank):
            if gid in plan and op.kind in RING_KINDS and seq not in out[gid]:
                out[gid][seq] = (seq, op.kind, ReduceKind(op.reduce) if op.reduce else None, op.n_tensors)
    return {gid: [ops[q] for q in sorted(ops)] for gid, ops in out.items() if ops}


class _RingPlayer:
    """Plays the edges of one logical group's pruned-ring ops, in order, on its own thread and
    the group's own communicator."""

    def __init__(self, recording: Recording, sandbox: tuple[int, ...], gid: int, ops: list[RingOp],
                 rings: RingChannels, errors: list, stats: AssistantStats, ended: Callable[[], bool],
                 changed: threading.Event, grace_s: float = 10.0):
        self.gid, self.at, self.kind_at = gid, ops[0][0], ops[0][1]
        self._ended = ended
        self._grace_s = grace_s
        self._changed = changed
        self.thread = threading.Thread(target=self._run, args=(recording, sandbox, ops, rings, errors, stats),
                                       name=f"prism-assistant-ring-{gid}", daemon=True)
        self.thread.start()

    def _run(self, recording, sandbox, ops, rings: RingChannels, errors: list, stats: AssistantStats) -> None:
        me, gid = len(sandbox), self.gid
        ranks = recording.group_ranks(gid)
        ring = ring_of(ranks, sandbox, me)
        try:
            if rings.device is not None:  # a thread starts on GPU 0: work on the assistant's GPU
                torch.cuda.set_device(rings.device)
            pg, local = rings.get(gid, ring_processes(ring))
            for seq, kind, reduce, k in ops:
                self.at, self.kind_at = seq, kind
                cache: dict[int, list[torch.Tensor]] = {}

                def pieces(m: int, seq=seq) -> list[torch.Tensor]:
                    if m not in cache:
                        with _READ_LOCK:
                            got = recording.contribution(ranks[m], gid, seq)
                        cache[m] = [t.to(rings.device) for t in got] if rings.device is not None else got
                    return cache[m]

                # the deadline counts from the op's start: the sandbox members enter it after their
                # compute since the previous one, as a real collective's members would
                deadline = None if rings.timeout_s is None else time.monotonic() + rings.timeout_s
                run_op(ring, pg, local, me, gid, seq, kind, reduce, pieces, k, tags=rings.tags, deadline=deadline,
                       what=f"assistant: group {gid} (ranks {short_ranks(ranks)}) "
                            f"{kind} seq {seq}")
                if rings.device is not None:
                    torch.cuda.current_stream().synchronize()
                with _READ_LOCK:
                    stats.ring_ops += 1
        except BaseException as e:  # noqa: BLE001 - re-raised by serve()
            # the sandboxes' exit closed the connections under this op
            if ended_within(self._ended, self._grace_s):
                errors.append(_unplayed([self]))
            else:
                errors.append(RuntimeError(f"assistant: pruned ring of group {gid} seq {self.at} ({self.kind_at}) "
                                           f"failed: {e}"))
        finally:
            self._changed.set()
