"""Global replay: a discrete-event walk of every logical rank's recorded graph.

Each rank is a sequence of events from the trace: compute spans (the time before each
event), op issues (collective, send, recv — non-blocking), waits (the rank blocks until
the op completes) and step markers. A collective completes when its last member has
issued it plus the network model's time for it on the target cluster; a recv completes
when the matching send's data has arrived. The walk yields each rank's timeline, the
iteration time, the critical path, exposed communication, pipeline bubbles and
stragglers.

The engine is O(events): ranks run until they block on a wait whose op is not complete;
the op's completion wakes them.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

# event codes
COMPUTE_ONLY, COLL, SEND, RECV, WAIT, MARK = range(6)


class CostModel(Protocol):
    def collective_time(self, kind: str, nbytes: int, ranks: Sequence[int]) -> float: ...

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float: ...


@dataclass(slots=True)
class Graph:
    """Per-rank event lists: ``(code, compute_s, key, info)``.

    key: COLL ``("c", gid, seq)``, SEND/RECV ``(gid, src, dst, tag, seq)``, WAIT the key it waits on
    (``("c", gid, seq)``, ``("s", chan)`` or ``("r", chan)``), MARK the unit number.
    info: COLL ``(kind, nbytes, ranks)``, SEND ``nbytes``.
    """

    ranks: dict[int, list[tuple]]
    world_size: int


@dataclass(slots=True)
class RankResult:
    step_ends: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    blocked_s: float = 0.0
    """Time spent waiting on ops (exposed communication + waiting for peers)."""
    bubble_s: float = 0.0
    """Part of ``blocked_s`` spent waiting on point-to-point receives (pipeline bubbles)."""
    end: float = 0.0


@dataclass(slots=True)
class Replay:
    world_size: int
    ranks: dict[int, RankResult]
    iteration_times: list[float]
    critical_path: list[dict]
    stragglers: list[dict]
    timelines: dict[int, list[tuple[str, float, float]]]

    @property
    def iteration_time_s(self) -> float:
        """Steady-state iteration time: the median step after the first (warm-up) one."""
        its = self.iteration_times[1:] if len(self.iteration_times) > 2 else self.iteration_times
        return statistics.median(its) if its else 0.0

    def rank_iteration_time(self, rank: int) -> float:
        ends = self.ranks[rank].step_ends
        d = [b - a for a, b in zip(ends, ends[1:])]
        return statistics.median(d) if d else (ends[0] if ends else 0.0)


def graph_from_events(rows: list[dict], groups: dict[int, tuple[int, ...]], world_size: int,
                      compute: str = "cpu", calibrated: dict[tuple[int, int], float] | None = None) -> Graph:
    """Build a :class:`Graph` from trace event rows (``TraceReader.events().to_pylist()``)."""
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_rank[row["rank"]].append(row)
    coll_bytes: dict[tuple[int, int], int] = defaultdict(int)
    for row in rows:
        if row["kind"] == "collective":
            key = (row["group"], row["seq"])
            coll_bytes[key] = max(coll_bytes[key], row["nbytes"])
    ranks: dict[int, list[tuple]] = {}
    for rank, evs in by_rank.items():
        evs.sort(key=lambda r: r["idx"])
        out = []
        for row in evs:
            span = row["compute_cpu_s"] if compute == "cpu" else row["compute_wall_s"]
            if calibrated is not None:
                span = calibrated.get((rank, row["idx"]), span)
            extra = json.loads(row["extra"]) if row["extra"] else {}
            gid, seq = row["group"], row["seq"]
            kind = row["kind"]
            if kind == "collective":
                out.append((COLL, span, ("c", gid, seq), (extra.get("kind", row["op"]), coll_bytes[(gid, seq)], groups[gid])))
            elif kind == "p2p" and row["op"] == "send":
                out.append((SEND, span, (gid, rank, row["peer"], extra.get("tag", 0), seq), row["nbytes"]))
            elif kind == "p2p":
                out.append((RECV, span, (gid, row["peer"], rank, extra.get("tag", 0), seq), None))
            elif kind == "wait":
                ref = extra.get("ref")
                if ref == "c":
                    key = ("c", gid, seq)
                elif ref == "s":
                    key = ("s", (gid, rank, row["peer"], extra.get("tag", 0), seq))
                else:
                    key = ("r", (gid, row["peer"], rank, extra.get("tag", 0), seq))
                out.append((WAIT, span, key, None))
            elif kind == "marker":
                out.append((MARK, span, row["unit"], None))
        ranks[rank] = out
    return Graph(ranks=ranks, world_size=world_size)


def replay(graph: Graph, model: CostModel, *, timeline_ranks: Sequence[int] = ()) -> Replay:
    """Walk ``graph``; raise ``RuntimeError`` naming the blocked ranks if it deadlocks."""
    keep = set(timeline_ranks)
    ops = graph.ranks
    clock = {r: 0.0 for r in ops}
    pos = {r: 0 for r in ops}
    pending_compute = {r: True for r in ops}
    results = {r: RankResult() for r in ops}
    timelines: dict[int, list[tuple[str, float, float]]] = {r: [] for r in keep}
    done: dict = {}             # op key -> completion time
    cause: dict = {}            # op key -> (rank, event position) whose issue bound the completion
    issued: dict = {}           # key -> (issue time, rank, pos)  (sends/recvs)
    coll: dict = {}             # ("c", gid, seq) -> [remaining, max_issue, last_rank, last_pos, lateness per rank]
    blocked: dict = defaultdict(list)
    delay_caused: dict[int, float] = defaultdict(float)
    # per-rank binding info for the critical path: pos -> (start, end, bound_by)
    binding: dict[int, dict[int, tuple[float, float, tuple | None]]] = {r: {} for r in ops}
    queue = deque(sorted(ops))
    cost_cache: dict = {}

    def coll_cost(kind, nbytes, members) -> float:
        key = (kind, nbytes, members)
        c = cost_cache.get(key)
        if c is None:
            c = cost_cache[key] = model.collective_time(kind, nbytes, members)
        return c

    def complete(key, t, by) -> None:
        done[key] = t
        cause[key] = by
        for r in blocked.pop(key, ()):
            queue.append(r)

    p2p_cache: dict = {}
    while queue:
        r = queue.popleft()
        evs = ops[r]
        n = len(evs)
        res = results[r]
        tl = timelines.get(r)
        p = pos[r]
        t = clock[r]
        fresh = pending_compute[r]
        bind = binding[r]
        while p < n:
            code, span, key, info = evs[p]
            if fresh:
                if span > 0:
                    if tl is not None:
                        tl.append(("compute", t, t + span))
                    t += span
                    res.compute_s += span
            fresh = True
            if code == WAIT:
                end = done.get(key)
                if end is None:
                    blocked[key].append(r)
                    fresh = False
                    break
                if end > t:
                    res.blocked_s += end - t
                    if key[0] == "r":
                        res.bubble_s += end - t
                    if tl is not None:
                        tl.append(("wait" if key[0] == "c" else "p2p-wait", t, end))
                    bind[p] = (t, end, cause.get(key))
                    t = end
            elif code == COLL:
                st = coll.get(key)
                if st is None:
                    st = coll[key] = [len(info[2]), t, r, p, []]
                st[0] -= 1
                st[4].append(t)
                if t >= st[1]:
                    st[1], st[2], st[3] = t, r, p
                if st[0] == 0:
                    arrivals = st[4]
                    if len(arrivals) > 1:
                        arrivals.sort()
                        delay_caused[st[2]] += arrivals[-1] - arrivals[-2]
                    complete(key, st[1] + coll_cost(*info), (st[2], st[3], st[1]))
                    del coll[key]
            elif code == SEND:
                pk = (info, key[1], key[2])
                cost = p2p_cache.get(pk)
                if cost is None:
                    cost = p2p_cache[pk] = model.p2p_time(info, key[1], key[2])
                arrive = t + cost
                issued[("m", key)] = (arrive, r, p, t)
                complete(("s", key), arrive, (r, p, t))
                rv = issued.get(("rv", key))
                if rv is not None:
                    complete(("r", key), max(rv[0], arrive), (r, p, t) if arrive >= rv[0] else (rv[1], rv[2], rv[0]))
            elif code == RECV:
                issued[("rv", key)] = (t, r, p)
                msg = issued.get(("m", key))
                if msg is not None:
                    complete(("r", key), max(t, msg[0]), (msg[1], msg[2], msg[3]) if msg[0] >= t else (r, p, t))
            elif code == MARK:
                res.step_ends.append(t)
            p += 1
        pos[r], clock[r], pending_compute[r] = p, t, fresh
        res.end = t

    stuck = [r for r in ops if pos[r] < len(ops[r])]
    if stuck:
        r = stuck[0]
        raise RuntimeError(f"replay deadlocked: {len(stuck)} rank(s) blocked, e.g. rank {r} at event "
                           f"{pos[r]} waiting on {ops[r][pos[r]][2]} (the trace is incomplete)")

    n_steps = min((len(x.step_ends) for x in results.values()), default=0)
    iteration_times = []
    prev = 0.0
    for k in range(n_steps):
        end = max(x.step_ends[k] for x in results.values())
        iteration_times.append(end - prev)
        prev = end
    return Replay(
        world_size=graph.world_size, ranks=results, iteration_times=iteration_times,
        critical_path=_critical_path(ops, results, binding),
        stragglers=[{"rank": r, "delay_caused_s": d} for r, d in
                    sorted(delay_caused.items(), key=lambda kv: -kv[1])[:5] if d > 0],
        timelines=timelines,
    )


def _critical_path(ops, results, binding) -> list[dict]:
    """Walk back from the rank that finishes last through the waits that bound it."""
    if not results:
        return []
    r = max(results, key=lambda k: results[k].end)
    p = len(ops[r]) - 1
    segments: list[dict] = []
    guard = sum(len(v) for v in ops.values()) + 1
    while p >= 0 and guard > 0:
        guard -= 1
        b = binding[r].get(p)
        if b is not None and b[2] is not None and b[2][0] != r:
            _start, end, (r2, p2, issue_t) = b
            # the path runs through the peer that issued last: its compute up to the issue,
            # then the communication until this rank's wait ended
            segments.append({"rank": r, "kind": "comm", "event": p, "peer": r2, "s": end - issue_t})
            r, p = r2, p2
            continue
        code, span, _key, _info = ops[r][p]
        if span > 0:
            if segments and segments[-1]["rank"] == r and segments[-1]["kind"] == "compute":
                segments[-1]["s"] += span
                segments[-1]["event"] = p
            else:
                segments.append({"rank": r, "kind": "compute", "event": p, "s": span})
        p -= 1
    segments.reverse()
    return segments
