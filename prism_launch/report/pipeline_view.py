"""What the report's pipeline picture shows: one steady-state iteration of each pipeline
stage (the sandbox rank's pipeline), start-up excluded, its compute cut into forward and
backward micro-batches labelled ``F1``, ``B1``, … and the waits between them (pipeline
bubble: waits on point-to-point receives; exposed communication: waits on collectives).

Micro-batches are found from the stage's point-to-point traffic, whatever the schedule: a
compute block runs between two batches of sends/receives; it starts a forward where the batch
before it received activations (from the previous stage) and a backward where it received
gradients (from the next stage), and it ends a forward where the batch after it sends
activations and a backward where it sends gradients. An edge stage joins two in one block
(the last stage's forward and backward of one micro-batch, ``F3+B3``; the first stage's
backward and next forward, ``B2+F4``). Compute that runs on from a micro-batch without
point-to-point traffic in between (the first stage's last backward into the optimizer) is
drawn as that micro-batch; compute between the last send and the step's end (the optimizer of
a stage that sends last) is drawn unlabelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Block", "StageView", "pipeline_view"]


@dataclass(frozen=True, slots=True)
class Block:
    label: str
    """``F3``, ``B1``, ``F3+B3`` (one block holding both), or ``""`` (no micro-batch known)."""
    t0: float
    t1: float
    segments: tuple[tuple[float, float], ...] = ()
    """The compute intervals of the block (waits inside it, on collectives or receives, left out)."""

    @property
    def label_at(self) -> float:
        """Where the label goes: the middle of the block's longest compute interval."""
        a, b = max(self.segments or ((self.t0, self.t1),), key=lambda s: s[1] - s[0])
        return (a + b) / 2


@dataclass(slots=True)
class StageView:
    rank: int
    stage: int
    blocks: list[Block] = field(default_factory=list)
    """Compute of the iteration, cut at point-to-point traffic."""
    waits: list[tuple[str, float, float]] = field(default_factory=list)
    """``("bubble" | "comm", t0, t1)``: waits on receives and on collectives inside the window."""


def _direction(row: dict, rank: int, prev: int | None, nxt: int | None) -> str | None:
    """``F`` for activations (sent to the next stage, received from the previous), ``B`` for gradients."""
    peer, op = row["peer"], row["op"]
    if op == "send":
        return "F" if peer == nxt else "B" if peer == prev else None
    return "F" if peer == prev else "B" if peer == nxt else None


def _merge(segments: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Back-to-back compute intervals as one."""
    out: list[tuple[float, float]] = []
    for a, b in segments:
        if out and a <= out[-1][1] + 1e-12:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _stage_blocks(evs: list[dict], issue: list[float], spans: list[float], rank: int, prev: int | None,
                  nxt: int | None, window: tuple[float, float]) -> list[Block]:
    """Blocks of compute in ``window``: compute runs (event spans) cut at each batch of p2p events."""
    runs: list[dict] = []  # {t0, t1, recv: set of directions before, send: set after}
    cur: dict | None = None
    pending_recv: set[str] = set()
    for row, t, span in zip(evs, issue, spans):
        lo, hi = window
        if span > 0 and t > lo and t - span < hi:
            if cur is None:
                cur = {"t0": max(lo, t - span), "t1": t, "recv": set(pending_recv), "send": set(), "seg": []}
                pending_recv = set()
            cur["t1"] = min(hi, t)
            cur["seg"].append((max(lo, t - span), min(hi, t)))
        if row["kind"] == "p2p" and lo <= t <= hi:
            d = _direction(row, rank, prev, nxt)
            if row["op"] == "send":
                if cur is not None and d:
                    cur["send"].add(d)
                if cur is not None:
                    runs.append(cur)
                    cur = None
            else:
                if cur is not None:
                    runs.append(cur)
                    cur = None
                if d:
                    pending_recv.add(d)
    if cur is not None:
        runs.append(cur)
    count = {"F": 0, "B": 0}
    out = []
    for run in runs:
        starts = next(iter(run["recv"])) if len(run["recv"]) == 1 else None
        ends = next(iter(run["send"])) if len(run["send"]) == 1 else None
        kinds = [k for k in (starts, ends) if k]
        if len(kinds) == 2 and kinds[0] == kinds[1]:
            kinds = kinds[:1]
        labels = []
        for k in kinds:
            count[k] += 1
            labels.append(f"{k}{count[k]}")
        out.append(Block("+".join(labels), run["t0"], run["t1"], tuple(_merge(run["seg"]))))
    return out


def pipeline_view(pipeline: list[int], rows_by_rank: dict[int, list[dict]], spans_by_rank: dict[int, list[float]],
                  issue_times: dict[int, list[float]], step_ends: dict[int, list[float]],
                  timelines: dict[int, list[tuple[str, float, float]]]) -> tuple[list[StageView], tuple[float, float]]:
    """Each stage's view of one steady-state iteration (the second step, the first after
    start-up; the only one where there is one) and the window drawn (the earliest start and
    the latest end of that step over the stages). ``rows_by_rank``: each rank's events in
    trace order; ``spans_by_rank``: the compute span before each (as replayed);
    ``issue_times``: the replay's issue time of each; ``step_ends``: each rank's step end times."""
    stages = sorted(r for r in pipeline if r in rows_by_rank and r in issue_times)
    if not stages:
        return [], (0.0, 0.0)
    n_steps = min(len(step_ends.get(r) or []) for r in stages)
    if n_steps == 0:
        return [], (0.0, 0.0)
    k = 1 if n_steps > 1 else 0
    starts = [step_ends[r][k - 1] if k else 0.0 for r in stages]
    ends = [step_ends[r][k] for r in stages]
    window = (min(starts), max(ends))
    views = []
    for i, r in enumerate(stages):
        prev = stages[i - 1] if i > 0 else None
        nxt = stages[i + 1] if i + 1 < len(stages) else None
        own = (starts[i], ends[i])
        v = StageView(rank=r, stage=i, blocks=_stage_blocks(rows_by_rank[r], issue_times[r], spans_by_rank[r],
                                                            r, prev, nxt, own))
        for name, t0, t1 in timelines.get(r, []):
            if name != "compute" and t1 > own[0] and t0 < own[1]:
                v.waits.append(("bubble" if name == "p2p-wait" else "comm", max(t0, own[0]), min(t1, own[1])))
        views.append(v)
    return views, window
