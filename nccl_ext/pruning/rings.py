"""Communication pruning with compensation: a group's collective run over a physical ring
that keeps only the live (sandbox) members and one **edge** virtual rank per run of virtual
members between them; every other virtual member leaves the collective and the edge carries
its data (the **compensation**), so each result equals the full group's bit for bit.

Members are folded in group-rank order (the order :func:`nccl_ext.core.ops.fold` defines for
capture and replay). The ring, in that order::

    [wrap edge] -> live a -> [edge of arc a..b] -> live b -> ... -> live z -> back to [wrap edge]

The *wrap edge* stands for the members before the first live one (the leading arc) and after
the last (the trailing arc) — one arc across the ring's seam. Reductions pass an accumulator
around the ring once, chunk by chunk (pipelined): it starts at the wrap edge as the leading
arc's fold — precomputed from the recorded contributions, exact because a fold from the first
member is just that prefix — each live member combines its tensor, each inner edge applies its
arc's recorded contributions one by one (a pre-summed arc would be exact only in real
arithmetic: float addition is not associative), and the wrap edge applies the trailing arc.
An all-reduce then forwards the result around the ring; a reduce-scatter folds only the
chunks live members receive (chunks of pruned members are never reduced) and hands each to
its owner; an all-gather circulates every node's block (an edge's block is its arc's recorded
pieces) around the ring.

Nodes talk over a ``torch.distributed`` process group of the ring's physical processes (gloo
over host memory, or NCCL between GPUs): live members are sandbox processes, edges are hosted
by an assistant process (one process may host several edges). :class:`RingChannels` gives each
logical group that runs rings its own communicator, created at startup from the trace's plan
(:func:`ring_plan`; group reduction: no other group gets one). The algorithms keep NCCL's matching rule — a
pair's messages match in the order they are issued, tags aside — as long as each process
issues one communicator's ops from one thread at a time (:class:`SerialWorker`); with
``tags=False`` gloo matches by that order alone too, which is how the CPU tests check it.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nccl_ext.core.ops import ReduceKind, fold
from nccl_ext.core.errors import CommDeadlineError, PeerClosedError, first_line
from nccl_ext.core.pending import LIMIT_KEY
from nccl_ext.core.ranklist import short_ranks

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Node:
    """One position of the physical ring."""

    phys: int
    """Physical rank (in the process group the ring runs on) of the process playing it."""
    live: int | None = None
    """The live member this node is (None: an edge)."""
    arc: tuple[int, ...] = ()
    """An inner edge's virtual members, in fold order."""
    leading: tuple[int, ...] = ()
    """The wrap edge's members before the first live member."""
    trailing: tuple[int, ...] = ()
    """The wrap edge's members after the last live member."""

    @property
    def members(self) -> tuple[int, ...]:
        return (self.live,) if self.live is not None else self.leading + self.arc + self.trailing


@dataclass(frozen=True, slots=True)
class PrunedRing:
    n: int
    nodes: tuple[Node, ...]

    @classmethod
    def plan(cls, n: int, live: Sequence[int], phys_of_live: Callable[[int], int], edge_host: int) -> PrunedRing:
        """The ring of group size ``n`` whose live members are ``live`` (group ranks); edges are
        hosted by physical rank ``edge_host``."""
        live = sorted(set(live))
        if not live or live[0] < 0 or live[-1] >= n:
            raise ValueError(f"live members {live} are not group ranks of a group of {n}")
        nodes: list[Node] = []
        leading, trailing = tuple(range(live[0])), tuple(range(live[-1] + 1, n))
        if leading or trailing:
            nodes.append(Node(edge_host, leading=leading, trailing=trailing))
        for a, b in zip(live, live[1:] + [None]):
            nodes.append(Node(phys_of_live(a), live=a))
            if b is not None and b > a + 1:
                nodes.append(Node(edge_host, arc=tuple(range(a + 1, b))))
        return cls(n, tuple(nodes))

    @property
    def pruned(self) -> int:
        """Virtual members that take no part in the physical ring (edges aside)."""
        return sum(len(x.members) - 1 for x in self.nodes if x.live is None)

    def index(self, *, live: int | None = None, phys: int | None = None) -> list[int]:
        """Positions of the node of live member ``live``, or of every node played by ``phys``."""
        if live is not None:
            return [i for i, x in enumerate(self.nodes) if x.live == live]
        return [i for i, x in enumerate(self.nodes) if x.phys == phys]

    def chain(self) -> list[tuple[int, str]]:
        """The reduction's steps around the ring: (node position, part) with part "leading",
        "live", "arc" or "trailing", in fold order."""
        steps = []
        for i, x in enumerate(self.nodes):
            if x.live is not None:
                steps.append((i, "live"))
            elif x.arc:
                steps.append((i, "arc"))
            elif x.leading:
                steps.append((i, "leading"))
        if self.nodes[0].trailing:
            steps.append((0, "trailing"))
        return steps


def compensation(kind: ReduceKind, recorded: Sequence[torch.Tensor]) -> torch.Tensor:
    """The leading arc's contribution: its members' recorded tensors folded in order (what a
    fold over the whole group holds after them), without AVG's final division."""
    return fold(ReduceKind.SUM if kind is ReduceKind.AVG else kind, list(recorded))


def ring_processes(ring: PrunedRing) -> tuple[int, ...]:
    """The physical ranks a ring runs on, in rank order (its communicator's members)."""
    return tuple(sorted({x.phys for x in ring.nodes}))


class RingChannels:
    """One communicator per logical group that runs pruned rings, over the ring's physical
    processes. :meth:`open` creates a process's planned groups one after another in group-id
    order before the program's ops (every member of a group creates it, and gloo connects
    its members then: creating them in one global order cannot deadlock, and one at a time
    keeps a process from connecting two groups at once — two gloo groups of the same
    processes connecting concurrently in one process were seen to stall for good);
    :meth:`get` creates an unplanned group on first use."""

    def __init__(self, make: Callable[[int, tuple[int, ...]], dist.ProcessGroup], *, tags: bool = True,
                 device: torch.device | None = None, timeout_s: float | None = None):
        self._make = make
        self.tags = tags
        """Match messages by tag too (gloo); False: by issue order only, as NCCL does."""
        self.timeout_s = timeout_s
        """Deadline of one ring op's waits (``comm.timeout_s``); None: the communicators' own."""
        self.device = device
        """Where ring tensors live (a GPU for NCCL); None: host memory."""
        self._groups: dict[int, tuple[dist.ProcessGroup, dict[int, int]]] = {}
        self._lock = threading.Lock()
        self.created = 0

    def open(self, plan: dict[int, tuple[int, ...]]) -> None:
        """Create the groups of ``plan`` (group id -> its ring's physical ranks), in id order."""
        for gid in sorted(plan):
            self.get(gid, plan[gid])

    def get(self, gid: int, phys: Sequence[int]) -> tuple[dist.ProcessGroup, dict[int, int]]:
        """Logical group ``gid``'s communicator over physical ranks ``phys`` and a map physical
        rank -> rank in it."""
        with self._lock:
            hit = self._groups.get(gid)
        if hit is None:
            phys = tuple(sorted(phys))
            hit = (self._make(gid, phys), {p: i for i, p in enumerate(phys)})
            with self._lock:
                self._groups[gid] = hit
                self.created += 1
        return hit


def group_factory(store, me: int, backend: str, timeout_s: float) -> Callable[[int, tuple[int, ...]], dist.ProcessGroup]:
    """Makes the ring communicator of a logical group, for physical rank ``me``, rendezvousing
    through ``store`` under the group's own prefix."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)

    def make(gid: int, phys: tuple[int, ...]) -> dist.ProcessGroup:
        prefixed = dist.PrefixStore(f"prism/ring/{gid}", store)
        rank, size = phys.index(me), len(phys)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        if backend != "gloo":
            raise ValueError(f"ring backend {backend!r}: expected gloo or nccl")
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    return make


class SerialWorker:
    """Runs jobs one at a time, in submission order, on its own daemon thread: the one thread
    that issues a communicator's ops in a process. :meth:`close` ends the thread after the
    jobs already submitted (before Python finalizes: ``nccl_ext/core/threads.py``)."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self, deadline_s: float) -> bool:
        """Let the submitted jobs finish and end the thread; False if it still runs after
        ``deadline_s``."""
        self._jobs.put(None)
        self._thread.join(deadline_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
            del job  # the job's tensors go now, not at the next job


class _Links:
    """Point-to-point between ring positions; positions played by the same process hand over
    in memory. Every wait ends by ``deadline`` (monotonic; None: the communicator's own
    timeout), past which it raises naming the op (``what``) and the position it waited for."""

    def __init__(self, ring: PrunedRing, pg: dist.ProcessGroup, local: dict[int, int], tag: int | None,
                 deadline: float | None = None, what: str = ""):
        self.ring, self.pg, self.local, self.tag = ring, pg, local, tag
        self.deadline, self.what = deadline, what or "pruned-ring op"
        self._t0 = time.monotonic()
        self.works: list = []
        self._mem: dict[tuple[int, int], torch.Tensor] = {}

    def send(self, src: int, dst: int, key: int, t: torch.Tensor) -> None:
        if self.ring.nodes[src].phys == self.ring.nodes[dst].phys:
            self._mem[(dst, key)] = t.clone()
            return
        self.works.append(self.pg.send([t.contiguous()], self.local[self.ring.nodes[dst].phys],
                                       self._tag(src, dst, key)))

    def recv(self, src: int, dst: int, key: int, like: torch.Tensor) -> torch.Tensor:
        if self.ring.nodes[src].phys == self.ring.nodes[dst].phys:
            return self._mem.pop((dst, key))
        buf = torch.empty_like(like)
        self._wait(self.pg.recv([buf], self.local[self.ring.nodes[src].phys], self._tag(src, dst, key)),
                   f"the message from {self._position(src)}")
        return buf

    def _position(self, pos: int) -> str:
        node = self.ring.nodes[pos]
        who = f"live member {node.live}" if node.live is not None else \
            f"the edge of virtual members {short_ranks(node.members)}"
        return f"ring position {pos} ({who} of the group, physical rank {node.phys})"

    def _wait(self, work, of: str) -> None:
        try:
            if self.deadline is None:
                done = work.wait()
            else:
                done = work.wait(datetime.timedelta(seconds=max(self.deadline - time.monotonic(), 1e-3)))
            error = None if done is not False else "the wait returned unfinished"
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise their own error types
            error = first_line(e)
        if error is None:
            return
        waited = time.monotonic() - self._t0
        late = self.deadline is None or time.monotonic() >= self.deadline
        cls = CommDeadlineError if late else PeerClosedError
        raise cls(f"{self.what}: pruned ring: waiting {waited:.1f} s for {of} failed: {error}"
                  + (f" (deadline {LIMIT_KEY}; raise it with {LIMIT_KEY}= if the peer is only slow)" if late else
                     " (the peer's process ended or closed the connection: see its log)"))

    def _tag(self, src: int, dst: int, key: int) -> int:
        if self.tag is None:  # match by issue order only (NCCL's rule)
            return 0
        return (self.tag * 1_000_003 + (src * 65_537 + dst) * 4099 + key) & 0x3FFFFFFF

    def drain(self) -> None:
        for w in self.works:
            self._wait(w, "a send of this position to be taken")
        self.works.clear()


def _combine(kind: ReduceKind, acc: torch.Tensor, t: torch.Tensor) -> None:
    """One step of :func:`nccl_ext.core.ops.fold`, in place."""
    fold(kind if kind is not ReduceKind.AVG else ReduceKind.SUM, [acc, t], out=acc)


def _reduce_chunks(ring: PrunedRing, links: _Links, mine: list[int], kind: ReduceKind, like: torch.Tensor,
                   data: Callable[[int, int], torch.Tensor], key: int) -> torch.Tensor | None:
    """Fold one tensor around the ring in fold order, chunk by chunk; returns the folded tensor
    at the node of the last step (None elsewhere). ``data(member, chunk)`` is a member's chunk."""
    flat_numel = like.numel()
    step = max(1, _CHUNK_BYTES // max(1, like.element_size()))
    chunks = [(s, min(flat_numel, s + step)) for s in range(0, flat_numel, step)] or [(0, 0)]
    steps = ring.chain()
    out = None
    for c, (s, e) in enumerate(chunks):
        acc = None
        for k, (pos, part) in enumerate(steps):
            if pos not in mine:
                continue
            node = ring.nodes[pos]
            if k > 0:
                prev = steps[k - 1][0]
                acc = links.recv(prev, pos, key * 4096 + c * 2 + (part == "trailing"), like.reshape(-1)[s:e])
            members = {"live": (node.live,), "arc": node.arc, "leading": node.leading, "trailing": node.trailing}[part]
            if part == "leading":  # the precomputed compensation starts the fold
                acc = compensation(kind, [data(m, c).reshape(-1)[s:e] for m in members]).clone()
            else:
                for m in members:
                    t = data(m, c).reshape(-1)[s:e]
                    if acc is None:
                        acc = t.clone()
                    else:
                        _combine(kind, acc, t)
            if k + 1 < len(steps):
                links.send(pos, steps[k + 1][0], key * 4096 + c * 2 + (steps[k + 1][1] == "trailing"), acc)
            else:
                if out is None:
                    out = torch.empty(flat_numel, dtype=like.dtype, device=like.device)
                out[s:e] = acc
    if out is not None and kind is ReduceKind.AVG:
        if out.is_floating_point() or out.is_complex():
            out.div_(ring.n)
        else:
            out.div_(ring.n, rounding_mode="floor")
    return out.reshape(like.shape) if out is not None else None


def all_reduce(ring: PrunedRing, pg: dist.ProcessGroup, local: dict[int, int], phys: int, kind: ReduceKind,
               data: Callable[[int], torch.Tensor], like: torch.Tensor, tag: int | None = 0, *,
               deadline: float | None = None, what: str = "") -> dict[int, torch.Tensor]:
    """Run this process's nodes of an all-reduce; ``data(member)`` gives a live member's tensor
    or an edge's recorded one. Returns {live member played here: result}. Every wait ends by
    ``deadline`` (``time.monotonic()``; None: the communicator's timeout), ``what`` names the op."""
    links = _Links(ring, pg, local, tag, deadline, what)
    mine = ring.index(phys=phys)
    last = ring.chain()[-1][0]
    folded = _reduce_chunks(ring, links, mine, kind, like, lambda m, c: data(m), key=0)
    # forward the result around the ring from the node that finished the fold
    order = [(last + i) % len(ring.nodes) for i in range(len(ring.nodes))]
    results: dict[int, torch.Tensor] = {}
    value = folded
    for i, pos in enumerate(order):
        if pos not in mine:
            continue
        if i > 0:
            value = links.recv(order[i - 1], pos, 1 << 20, like)
        if i + 1 < len(order):
            links.send(pos, order[i + 1], 1 << 20, value)
        if ring.nodes[pos].live is not None:
            results[ring.nodes[pos].live] = value
    links.drain()
    return results


def reduce_scatter(ring: PrunedRing, pg: dist.ProcessGroup, local: dict[int, int], phys: int, kind: ReduceKind,
                   data: Callable[[int, int], torch.Tensor], like: torch.Tensor, tag: int | None = 0, *,
                   deadline: float | None = None, what: str = "") -> dict[int, torch.Tensor]:
    """Each live member's chunk (``data(member, chunk)``: a member's ``chunk``-th input chunk),
    folded around the ring; chunks addressed to pruned members are never reduced. Returns
    {live member played here: its chunk's result}. ``deadline``, ``what``: as :func:`all_reduce`'s."""
    links = _Links(ring, pg, local, tag, deadline, what)
    mine = ring.index(phys=phys)
    last = ring.chain()[-1][0]
    results: dict[int, torch.Tensor] = {}
    for node in ring.nodes:
        j = node.live
        if j is None:
            continue
        owner = ring.index(live=j)[0]
        folded = _reduce_chunks(ring, links, mine, kind, like, lambda m, c, j=j: data(m, j), key=1 + j)
        if last in mine and owner != last:
            links.send(last, owner, (1 << 21) + j, folded)
        if owner in mine:
            results[j] = folded if owner == last else links.recv(last, owner, (1 << 21) + j, like)
    links.drain()
    return results


def all_gather(ring: PrunedRing, pg: dist.ProcessGroup, local: dict[int, int], phys: int,
               data: Callable[[int], torch.Tensor], like: torch.Tensor, tag: int | None = 0, *,
               deadline: float | None = None, what: str = "") -> dict[int, list[torch.Tensor]]:
    """Every node's block (a live member's tensor, an edge's members' recorded tensors)
    circulates the ring once. Returns {live member played here: all members' tensors in order}.
    ``deadline``, ``what``: as :func:`all_reduce`'s."""
    links = _Links(ring, pg, local, tag, deadline, what)
    p = len(ring.nodes)
    mine = ring.index(phys=phys)
    held: dict[int, dict[int, dict[int, torch.Tensor]]] = {
        pos: {pos: {m: data(m) for m in ring.nodes[pos].members}} for pos in mine}
    for s in range(p - 1):
        for pos in mine:  # send the block received last round (own block first)
            block_of = (pos - s) % p
            block = held[pos][block_of]
            links.send(pos, (pos + 1) % p, (block_of << 8) + s,
                       torch.stack([block[m] for m in ring.nodes[block_of].members]))
        for pos in mine:
            src = (pos - 1) % p
            block_of = (src - s) % p
            members = ring.nodes[block_of].members
            stacked = links.recv(src, pos, (block_of << 8) + s,
                                 torch.empty((len(members), *like.shape), dtype=like.dtype, device=like.device))
            held[pos][block_of] = {m: stacked[i] for i, m in enumerate(members)}
    links.drain()
    results = {}
    for pos in mine:
        if ring.nodes[pos].live is not None:
            every = {m: t for blk in held[pos].values() for m, t in blk.items()}
            results[ring.nodes[pos].live] = [every[m] for m in range(ring.n)]
    return results


# -- emulation: sandbox ranks and the assistant run rings for groups with several sandbox members

RING_KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def uses_ring(kind: str, ranks: Sequence[int], sandbox: Sequence[int], folded: bool) -> bool:
    """Whether an op goes over a pruned ring in emulation: a ring collective, not folded, on a
    group with at least two sandbox members (a lone sandbox's ops take the device/host path)."""
    return kind in RING_KINDS and not folded and sum(r in sandbox for r in ranks) >= 2


def ring_plan(recording, sandbox: Sequence[int], me: int, assistant: int | None) -> dict[int, tuple[int, ...]]:
    """The ring groups physical rank ``me`` belongs to (group id -> its ring's physical ranks):
    the groups on which the trace has collectives that run over pruned rings (sandbox positions
    are physical ranks 0.., ``assistant`` the edges' host; without one only all-sandbox groups
    run rings). ``recording``: a :class:`nccl_ext.replay.recording.Recording`."""
    plan: dict[int, tuple[int, ...]] = {}
    for rank in sandbox:
        for op, gid, _seq, _peer, _tag in recording.ops_of(rank):
            if gid in plan or op.kind not in RING_KINDS:
                continue
            ranks = recording.group_ranks(gid)
            if not uses_ring(op.kind, ranks, sandbox, recording.folded(gid)):
                continue
            if assistant is None and not all(r in sandbox for r in ranks):
                continue
            phys = ring_processes(ring_of(ranks, sandbox, -1 if assistant is None else assistant))
            if me in phys:
                plan[gid] = phys
    return plan


def ring_of(ranks: Sequence[int], sandbox: Sequence[int], assistant: int) -> PrunedRing:
    """The ring of a logical group in emulation: physical ranks are sandbox positions, edges on
    the assistant."""
    live = [m for m, r in enumerate(ranks) if r in sandbox]
    return PrunedRing.plan(len(ranks), live, lambda m: list(sandbox).index(ranks[m]), edge_host=assistant)


def _op_tag(gid: int, seq: int, piece: int) -> int:
    return (gid * 1_000_033 + seq * 131 + piece) & 0xFFFFF


def run_op(ring: PrunedRing, pg: dist.ProcessGroup, local: dict[int, int], phys: int, gid: int, seq: int,
           kind: str, reduce: ReduceKind | None, pieces: Callable[[int], list[torch.Tensor]], k: int,
           tags: bool = True, *, deadline: float | None = None, what: str = "") -> dict[int, list[torch.Tensor]]:
    """Run this process's nodes of one emulated collective over ``pg`` (``local``: physical
    rank -> rank in it); ``pieces(member)`` is a member's contribution (live or recorded),
    ``k`` its length. Returns {live member here: result list} in the layout of
    :func:`nccl_ext.core.ops.compute`. ``tags=False``: messages carry no tag (matched by order).
    Every wait ends by ``deadline`` (``time.monotonic()``; None: the communicator's timeout);
    ``what`` names the op in the error (default: its kind, group id and seq)."""
    n, out = ring.n, {}
    limits = {"deadline": deadline, "what": what or f"pruned-ring {kind} on group {gid} seq {seq}"}

    def tag(piece: int) -> int | None:
        return _op_tag(gid, seq, piece) if tags else None

    if kind == "all_reduce":
        for i in range(k):
            got = all_reduce(ring, pg, local, phys, reduce, lambda m: pieces(m)[i], pieces(_any(ring, phys))[i],
                             tag=tag(i), **limits)
            for m, t in got.items():
                out.setdefault(m, []).append(t)
    elif kind == "reduce_scatter":
        for i in range(k // n):
            got = reduce_scatter(ring, pg, local, phys, reduce, lambda m, j: pieces(m)[i * n + j],
                                 pieces(_any(ring, phys))[i * n], tag=tag(i), **limits)
            for m, t in got.items():
                out.setdefault(m, []).append(t)
    else:
        per_member: dict[int, list[list[torch.Tensor]]] = {}
        for i in range(k):
            got = all_gather(ring, pg, local, phys, lambda m: pieces(m)[i], pieces(_any(ring, phys))[i],
                             tag=tag(i), **limits)
            for m, ts in got.items():
                per_member.setdefault(m, []).append(ts)
        out = {m: [rows[i][j] for i in range(k) for j in range(n)] for m, rows in per_member.items()}
    return out


def _any(ring: PrunedRing, phys: int) -> int:
    """A member whose tensors this process has (for buffer shapes)."""
    return ring.nodes[ring.index(phys=phys)[0]].members[0]

