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

Links that are shared: with a cost model that prices ops as flows (``model.flow`` /
``model.p2p_flow``, as :class:`~prism_launch.predict.cost_model.NcclCostModel` does), every
collective and transfer becomes a flow on the links it crosses
(:mod:`prism_launch.predict.network`), and transfers that overlap in time on one link (a
GPU's NVLink port, its NIC, a leaf uplink) share its bandwidth. Ranks run until all of them
are blocked; then the network advances to its next completion, in time order, and wakes
the ranks waiting on it. Any rank woken at time ``t`` issues work at ``t`` or later, so a
flow never starts before one the network already moved past. A model with only
``collective_time`` / ``p2p_time`` prices every op alone.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prism_launch.predict.network import FlowNetwork

# event codes
COMPUTE_ONLY, COLL, SEND, RECV, WAIT, MARK = range(6)


class CostModel(Protocol):
    """What the replay asks of a cost model (a model may also offer ``flow``/``p2p_flow``)."""

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
    blocked_by_group: dict[int, float] = field(default_factory=dict)
    """Part of ``blocked_s`` spent waiting on collectives, by process-group id."""
    marks: list[tuple[float, float, float, dict[int, float]]] = field(default_factory=list)
    """``(compute_s, blocked_s, bubble_s, blocked_by_group)`` as they stood at each step's end."""
    end: float = 0.0

    def steady_step(self) -> dict:
        """One step's compute, waits and bubble: the mean over the steps after the first
        (all steps when there are fewer than three), as :attr:`Replay.iteration_time_s` takes them."""
        rows, prev = [], (0.0, 0.0, 0.0, {})
        for m in self.marks:
            rows.append((m[0] - prev[0], m[1] - prev[1], m[2] - prev[2],
                         {g: v - prev[3].get(g, 0.0) for g, v in m[3].items()}))
            prev = m
        rows = rows[1:] if len(rows) > 2 else rows
        if not rows:
            return {"compute_s": 0.0, "blocked_s": 0.0, "bubble_s": 0.0, "blocked_by_group": {}}
        k = len(rows)
        groups = {g for r in rows for g in r[3]}
        return {"compute_s": sum(r[0] for r in rows) / k, "blocked_s": sum(r[1] for r in rows) / k,
                "bubble_s": sum(r[2] for r in rows) / k,
                "blocked_by_group": {g: sum(r[3].get(g, 0.0) for r in rows) / k for g in sorted(groups)}}


@dataclass(slots=True)
class Replay:
    world_size: int
    ranks: dict[int, RankResult]
    iteration_times: list[float]
    critical_path: list[dict]
    stragglers: list[dict]
    timelines: dict[int, list[tuple[str, float, float]]]
    issue_times: dict[int, list[float]] | None = None
    """With ``record_issue``: each rank's predicted time of every event, in trace order."""
    flows: int = 0
    """Collectives and transfers priced as flows on shared links (0: the model prices ops alone)."""
    slowed_flows: int = 0
    """Of those, how many another flow on one of their links slowed down."""

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
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        return _graph_from_events(rows, groups, world_size, compute, calibrated)
    finally:
        if enabled:
            gc.enable()


def _graph_from_events(rows, groups, world_size, compute, calibrated) -> Graph:
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_rank[row["rank"]].append(row)
    present = set(by_rank)
    # folded traces hold only captured ranks: a collective completes when its captured
    # members arrive (uncaptured replicas mirror them); its cost is the full group's
    n_present = {gid: sum(1 for r in ranks if r in present) for gid, ranks in groups.items()}
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
                info = (extra.get("kind", row["op"]), coll_bytes[(gid, seq)], groups[gid])
                if n_present[gid] != len(groups[gid]):
                    info += (n_present[gid],)
                out.append((COLL, span, ("c", gid, seq), info))
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


def _intern(graph: Graph) -> tuple[list[list[tuple]], int, dict[int, int]]:
    """Replace tuple keys by dense integer slots (one hash per event, list lookups after).

    Per rank, events become ``(code, span, slot, info)``: COLL slot of its completion, info
    ``(kind, nbytes, members)``; SEND slot of the send's completion, info
    ``(nbytes, src, dst, recv_slot)``; RECV slot of the receive's completion; WAIT the slot
    it waits on, info ``"c"``/``"s"``/``"r"``; MARK info the unit. Also returns the number of
    slots and each collective slot's process-group id.
    """
    ids: dict = {}

    def slot(key) -> int:
        i = ids.get(key)
        if i is None:
            i = ids[key] = len(ids)
        return i

    out = []
    group_of: dict[int, int] = {}
    for r in sorted(graph.ranks):
        evs = []
        for code, span, key, info in graph.ranks[r]:
            if code == COLL:
                sl = slot(key)
                group_of[sl] = key[1]
                evs.append((COLL, span, sl, info))
            elif code == SEND:
                evs.append((SEND, span, slot(("s", key)), (info, key[1], key[2], slot(("r", key)))))
            elif code == RECV:
                evs.append((RECV, span, slot(("r", key)), None))
            elif code == WAIT:
                evs.append((WAIT, span, slot(key if key[0] == "c" else (key[0], key[1])), key[0]))
            else:
                evs.append((MARK, span, -1, key))
        out.append(evs)
    return out, len(ids), group_of


def replay(graph: Graph, model: CostModel, *, timeline_ranks: Sequence[int] = (), record_issue: bool = False,
           comm_on_cores: bool = False) -> Replay:
    """Walk ``graph``; raise ``RuntimeError`` naming the blocked ranks if it deadlocks. With
    ``comm_on_cores`` (a CPU cluster: ``ClusterSpec.comm_on_cores``) a rank pays an asynchronous
    collective's uncontended time (one with other events before its wait) on its own timeline
    right after issuing it: the cores that compute are the ones that move the bytes, so it overlaps
    none of the work before its wait. One waited on at once is priced as always: the span before
    its wait is the op's own handling, which its transfer overlaps."""
    import gc

    # millions of small tuples, none cyclic: the cyclic collector would rescan them all
    # again and again (measured: ~2x of the whole replay at 8,192 ranks)
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(graph, model, timeline_ranks, record_issue, comm_on_cores)
    finally:
        if enabled:
            gc.enable()


def _replay(graph: Graph, model: CostModel, timeline_ranks: Sequence[int], record_issue: bool = False,
            comm_on_cores: bool = False) -> Replay:
    order = sorted(graph.ranks)
    ops, n_slots, group_of = _intern(graph)
    n = len(order)
    index = {r: i for i, r in enumerate(order)}
    keep = {index[r] for r in timeline_ranks if r in index}
    clock = [0.0] * n
    pos = [0] * n
    fresh_at = [True] * n
    results = [RankResult() for _ in range(n)]
    timelines: dict[int, list[tuple[str, float, float]]] = {i: [] for i in keep}
    issue: list[list[float]] | None = [[] for _ in range(n)] if record_issue else None
    done: list = [None] * n_slots       # slot -> completion time
    cause: list = [None] * n_slots      # slot -> (rank index, event position, issue time) that bound it
    msg_arrival: list = [None] * n_slots  # recv slot -> (arrival, sender index, pos, issue time)
    recv_issue: list = [None] * n_slots   # recv slot -> (issue time, receiver index, pos)
    coll: dict = {}                     # slot -> [remaining, max_issue, last_rank, last_pos, arrivals]
    blocked: dict = defaultdict(list)
    delay_caused: dict[int, float] = defaultdict(float)
    binding: list[dict[int, tuple]] = [{} for _ in range(n)]
    queue = deque(range(n))
    cost_cache: dict = {}
    p2p_cache: dict = {}
    flows = hasattr(model, "flow") and hasattr(model, "p2p_flow")
    net = FlowNetwork() if flows else None

    def complete(sl: int, t: float, by) -> None:
        done[sl] = t
        cause[sl] = by
        waiting = blocked.pop(sl, None)
        if waiting:
            queue.extend(waiting)

    def arrived(sl: int, rsl: int, arrive: float, by) -> None:
        """A send's bytes reached its receiver at ``arrive``."""
        msg_arrival[rsl] = (arrive, by[0], by[1], by[2])
        complete(sl, arrive, by)
        rv = recv_issue[rsl]
        if rv is not None:
            complete(rsl, max(rv[0], arrive), by if arrive >= rv[0] else (rv[1], rv[2], rv[0]))

    while True:
        if not queue:
            # every rank is blocked or done: the network moves to its next completion
            nxt = net.pop() if net is not None else None
            if nxt is None:
                break
            t_done, (sl, rsl, by) = nxt
            if rsl < 0:
                complete(sl, t_done, by)
            else:
                arrived(sl, rsl, t_done, by)
            continue
        r = queue.popleft()
        evs = ops[r]
        ne = len(evs)
        res = results[r]
        tl = timelines.get(r)
        p = pos[r]
        t = clock[r]
        fresh = fresh_at[r]
        bind = binding[r]
        iss = issue[r] if issue is not None else None
        while p < ne:
            code, span, sl, info = evs[p]
            if fresh and span > 0:
                if tl is not None:
                    tl.append(("compute", t, t + span))
                t += span
                res.compute_s += span
            if fresh and iss is not None:
                iss.append(t)
            fresh = True
            if code == WAIT:
                end = done[sl]
                if end is None:
                    blocked[sl].append(r)
                    fresh = False
                    break
                if end > t:
                    res.blocked_s += end - t
                    if info == "r":
                        res.bubble_s += end - t
                    elif info == "c":
                        by_group = res.blocked_by_group
                        g = group_of[sl]
                        by_group[g] = by_group.get(g, 0.0) + (end - t)
                    if tl is not None:
                        tl.append(("wait" if info == "c" else "p2p-wait", t, end))
                    bind[p] = (t, end, cause[sl])
                    t = end
            elif code == COLL:
                st = coll.get(sl)
                if st is None:
                    st = coll[sl] = [len(info[2]) if len(info) < 4 else info[3], t, r, p, []]
                st[0] -= 1
                st[4].append(t)
                if t >= st[1]:
                    st[1], st[2], st[3] = t, r, p
                if st[0] == 0:
                    arrivals = st[4]
                    if len(arrivals) > 1:
                        arrivals.sort()
                        delay_caused[st[2]] += arrivals[-1] - arrivals[-2]
                    by = (st[2], st[3], st[1])
                    del coll[sl]
                    if net is None:
                        cost = cost_cache.get(info)
                        if cost is None:
                            cost = cost_cache[info] = model.collective_time(*info[:3])
                        complete(sl, st[1] + cost, by)
                    else:
                        fl = cost_cache.get(info)
                        if fl is None:
                            fl = cost_cache[info] = model.flow(*info[:3])
                        if not fl.links:
                            complete(sl, st[1] + fl.latency_s, by)
                        elif (fl.members_only and p + 1 < ne and evs[p + 1][0] == WAIT and evs[p + 1][2] == sl
                              and len(blocked.get(sl, ())) == len(arrivals) - 1
                              and (end := net.claim(st[1], fl)) is not None):
                            # every member waits on it and nobody else reaches its links
                            complete(sl, end, by)
                        else:
                            net.add(st[1], fl, (sl, -1, by))
                if comm_on_cores and not (p + 1 < ne and evs[p + 1][0] == WAIT and evs[p + 1][2] == sl):
                    # asynchronous (other events before its wait): the transfer takes the rank's cores
                    t = _pay_on_cores(model, cost_cache, info, t, res, group_of[sl], tl)
            elif code == SEND:
                nbytes, src, dst, rsl = info
                pk = (nbytes, src, dst)
                if net is None:
                    cost = p2p_cache.get(pk)
                    if cost is None:
                        cost = p2p_cache[pk] = model.p2p_time(nbytes, src, dst)
                    arrived(sl, rsl, t + cost, (r, p, t))
                else:
                    fl = p2p_cache.get(pk)
                    if fl is None:
                        fl = p2p_cache[pk] = model.p2p_flow(nbytes, src, dst)
                    if fl.links:
                        net.add(t, fl, (sl, rsl, (r, p, t)))
                    else:
                        arrived(sl, rsl, t + fl.latency_s, (r, p, t))
            elif code == RECV:
                recv_issue[sl] = (t, r, p)
                msg = msg_arrival[sl]
                if msg is not None:
                    complete(sl, max(t, msg[0]), (msg[1], msg[2], msg[3]) if msg[0] >= t else (r, p, t))
            else:
                res.step_ends.append(t)
                res.marks.append((res.compute_s, res.blocked_s, res.bubble_s, dict(res.blocked_by_group)))
            p += 1
        pos[r], clock[r], fresh_at[r] = p, t, fresh
        res.end = t

    stuck = [i for i in range(n) if pos[i] < len(ops[i])]
    if stuck:
        i = stuck[0]
        raise RuntimeError(f"replay deadlocked: {len(stuck)} rank(s) blocked, e.g. rank {order[i]} at event "
                           f"{pos[i]} (the trace is incomplete)")

    n_steps = min((len(x.step_ends) for x in results), default=0)
    iteration_times = []
    prev = 0.0
    for k in range(n_steps):
        end = max(x.step_ends[k] for x in results)
        iteration_times.append(end - prev)
        prev = end
    path = _critical_path(ops, results, binding)
    for seg in path:
        seg["rank"] = order[seg["rank"]]
        if "peer" in seg:
            seg["peer"] = order[seg["peer"]]
    return Replay(
        world_size=graph.world_size, ranks={order[i]: results[i] for i in range(n)},
        iteration_times=iteration_times, critical_path=path,
        stragglers=[{"rank": order[i], "delay_caused_s": d} for i, d in
                    sorted(delay_caused.items(), key=lambda kv: -kv[1])[:5] if d > 0],
        timelines={order[i]: v for i, v in timelines.items()},
        issue_times=None if issue is None else {order[i]: issue[i] for i in range(n)},
        flows=net.flows if net is not None else 0,
        slowed_flows=net.contended if net is not None else 0,
    )


def _pay_on_cores(model: CostModel, cache: dict, info: tuple, t: float, res: RankResult, group: int,
                  tl: list | None) -> float:
    """A collective's uncontended time taken from the issuing rank at ``t``, counted as exposed
    communication of its group; returns the rank's clock after it."""
    cost = cache.get(("cores", info))
    if cost is None:
        cost = cache[("cores", info)] = model.collective_time(*info[:3])
    if cost > 0:
        res.blocked_s += cost
        res.blocked_by_group[group] = res.blocked_by_group.get(group, 0.0) + cost
        if tl is not None:
            tl.append(("wait", t, t + cost))
    return t + cost


def _critical_path(ops, results, binding) -> list[dict]:
    """Walk back from the rank that finishes last through the waits that bound it."""
    if not results:
        return []
    r = max(range(len(results)), key=lambda k: results[k].end)
    p = len(ops[r]) - 1
    segments: list[dict] = []
    guard = sum(len(v) for v in ops) + 1
    while p >= 0 and guard > 0:
        guard -= 1
        b = binding[r].get(p)
        if b is not None and b[2] is not None and (b[2][0] != r or b[2][1] < p):
            _start, end, (r2, p2, issue_t) = b
            # the path runs through the peer that issued last (or this rank's own issue, when it
            # was the last member or the op is its own send): its compute up to the issue,
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
