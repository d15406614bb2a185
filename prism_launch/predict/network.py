"""Flow-level sharing of links between transfers that overlap in time.

The replay (:mod:`prism_launch.predict.simulate`) turns every priced collective and
point-to-point transfer into a *flow*: after its fixed latency it needs ``work_s`` seconds
of transfer at the rate it would get alone, over a set of links, each with the *demand* the
flow puts on it when running at that rate (1.0: it saturates the link; 0.1: a tenth of it).
While flows overlap, each link's capacity is shared in proportion to demand: a link whose
summed demand ``D`` exceeds 1 runs every flow on it at ``1/D`` of its own rate, and a flow
runs at the slowest share of its links — the flow-level ("fluid") model of ASTRA-sim's
congestion-aware analytical backend and of Phantora, with proportional rather than
max-min fair shares (equal demands give equal shares; one pass, no water-filling).

Rates change only at flow start and end events; the flows whose rate changes are those on
a link whose summed demand is or was above 1, so uncontended traffic costs a heap push and
pop per flow and a load update per link. Completion times are kept in a heap with lazy
invalidation.

A collective over every GPU of an NVLink domain whose members all wait on it
(:attr:`Flow.members_only`; a tensor-parallel all_reduce) is *claimed* instead when its
links are idle: nobody else can reach those ports before its members resume, so it runs
alone and costs no event at all (:meth:`FlowNetwork.claim`).

Causality: :meth:`FlowNetwork.add` may only be called with a start time at or after the
time of the last event :meth:`FlowNetwork.pop` returned; the replay guarantees it, as every
rank that issues work after a completion resumes no earlier than that completion.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Flow", "FlowNetwork"]

_START, _END = 0, 1
_EPS = 1e-12
_OVER = 1.0 + 1e-9


@dataclass(frozen=True, slots=True)
class Flow:
    """A priced transfer as the network sees it (what :meth:`NcclCostModel.flow` returns)."""

    latency_s: float
    """Fixed part, before the transfer starts to move bytes."""
    work_s: float
    """Transfer time at the flow's own rate, with nothing else on its links."""
    links: tuple[tuple[Hashable, float], ...]
    """``(link, demand)`` for every link the flow crosses; a demand above 1 means the link
    alone slows it (an oversubscribed uplink)."""
    members_only: bool = False
    """Only the op's own members can put traffic on its links (a collective over every GPU of
    an NVLink domain: nobody else reaches those ports). When all of them wait on it and its
    links are idle, nothing can overlap it: :meth:`FlowNetwork.claim` prices it alone."""

    @property
    def alone_s(self) -> float:
        """Duration with no other flow on its links."""
        worst = max((d for _, d in self.links), default=0.0)
        return self.latency_s + self.work_s * max(1.0, worst)


class _Active:
    __slots__ = ("links", "left", "rate", "last", "version", "token")

    def __init__(self, links, work, token):
        self.links = links
        self.left = work
        self.rate = 1.0
        self.last = 0.0
        self.version = 0
        self.token = token


class FlowNetwork:
    """Links shared by overlapping flows; :meth:`add` flows, :meth:`pop` completions in time order.

    Only the summed demand of each busy link is kept per link; the flows on a link are found
    by a scan of the active flows, which happens only when a link is (or was) over capacity,
    so traffic that does not contend pays two dictionary updates per link and flow."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._load: dict = {}     # link -> summed demand of the active flows on it
        self._users: dict = {}    # link -> flows added and not yet finished on it
        self._free_at: dict = {}  # link -> when the last flow on it finished (or a claim ends)
        self._active: set = set()  # flows moving bytes, for the scan after a link got crowded
        self.flows = 0
        self.contended = 0
        """Flows whose rate was lowered at least once by another flow (a statistic)."""

    def add(self, start: float, flow: Flow, token) -> None:
        """Start ``flow`` at ``start`` (its latency runs first); :meth:`pop` returns ``token``
        when its bytes have arrived."""
        if start < self.now - 1e-9:
            raise RuntimeError(f"flow added at {start!r} before the network's time {self.now!r} (replay order broken)")
        self._seq += 1
        self.flows += 1
        users = self._users
        for link, _d in flow.links:
            users[link] = users.get(link, 0) + 1
        act = _Active(flow.links, flow.work_s, token)
        heapq.heappush(self._heap, (max(start, self.now) + flow.latency_s, self._seq, _START, act, 0))

    def claim(self, start: float, flow: Flow) -> float | None:
        """Price a :attr:`Flow.members_only` flow whose members all wait on it: if no flow is on
        its links at ``start`` or later, reserve them until it ends and return that end (it
        runs alone: nothing else can start on them before its members resume); else None
        (:meth:`add` it)."""
        users, free = self._users, self._free_at
        for link, _d in flow.links:
            if users.get(link) or free.get(link, 0.0) > start:
                return None
        end = start + flow.alone_s
        for link, _d in flow.links:
            free[link] = end
        self.flows += 1
        return end

    def pending(self) -> bool:
        return bool(self._heap)

    def pop(self) -> tuple[float, object] | None:
        """Advance to the next completion; return ``(time, token)``, or None when no flow is left."""
        heap = self._heap
        load = self._load
        while heap:
            t, _seq, what, act, version = heapq.heappop(heap)
            self.now = t
            if what == _START:
                crowded = None
                rate = 1.0
                for link, d in act.links:
                    lo = load.get(link, 0.0) + d
                    load[link] = lo
                    if lo > _OVER:
                        if crowded is None:
                            crowded = set()
                        crowded.add(link)
                        if 1.0 / lo < rate:
                            rate = 1.0 / lo
                act.last = t
                act.rate = rate
                if rate < 1.0:
                    self.contended += 1
                self._active.add(act)
                self._seq += 1
                heapq.heappush(heap, (t + act.left / rate, self._seq, _END, act, 0))
                if crowded:
                    self._rerate(crowded, t, skip=act)
                continue
            if version != act.version:
                continue  # superseded by a rate change
            self._active.discard(act)
            crowded = None
            users, free = self._users, self._free_at
            for link, d in act.links:
                users[link] -= 1
                if free.get(link, 0.0) < t:
                    free[link] = t
                before = load[link]
                lo = before - d
                if lo > _EPS:
                    load[link] = lo
                else:
                    del load[link]
                if before > _OVER:
                    if crowded is None:
                        crowded = set()
                    crowded.add(link)
            if crowded:
                self._rerate(crowded, t, skip=None)
            return t, act.token
        return None

    # ---------------------------------------------------------------- internals

    def _rate(self, links: Sequence[tuple[Hashable, float]]) -> float:
        load = self._load
        r = 1.0
        for link, _d in links:
            lo = load[link]
            if lo > _OVER and 1.0 / lo < r:
                r = 1.0 / lo
        return r

    def _rerate(self, crowded: set, t: float, skip) -> None:
        for other in list(self._active):
            if other is skip or crowded.isdisjoint(link for link, _ in other.links):
                continue
            rate = self._rate(other.links)
            if abs(rate - other.rate) <= 1e-12:
                continue
            other.left = max(0.0, other.left - other.rate * (t - other.last))
            other.last = t
            if rate < other.rate:
                self.contended += 1
            other.rate = rate
            other.version += 1
            self._seq += 1
            heapq.heappush(self._heap, (t + other.left / rate, self._seq, _END, other, other.version))
