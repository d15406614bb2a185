"""Slice calibration: the capture's timings are distorted (many logical ranks share a few
devices), so slices of ``calibrate.slice_size`` ranks are run for real as sandbox ranks
while the rest are replayed from the bare trace. Each slice rank's compute span before
each of its events — measured where it ran uncontended — replaces the bare span. Ranks of
one shard class (:mod:`prism_launch.predict.shard_classes`: TP peers of a stage,
data-parallel replicas) are interchangeable: by default one class member is measured
``calibrate.repeats`` times and every member gets the per-event median over its runs and,
where the steady steps repeat the same events, over those steps too, scaled to the median
(run, step) total (a sum of medians undercounts skewed noise). Spans are
durations between a rank's own events, so slices need no clock alignment: the global
replay stitches them together through the graph's dependency edges (collectives and
messages), which is where the calibrated timeline gets its cross-rank alignment.

The calibrated trace is written as a new trace version beside the bare one:
``<trace.dir>/calibrated`` (events and manifest only; tensors stay in the bare trace). This
module owns the graph side (which spans replace which); running the slices is the
calibrate mode's (:mod:`prism_launch.modes.calibrate`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from prism_launch.config import Measure
from prism_launch.predict.shard_classes import ShardClass
from prism_launch.trace import TraceLayout, TraceReader, TraceWriter

_CODES = {("collective", None): "c", ("p2p", "send"): "s", ("p2p", "recv"): "r", ("wait", None): "w",
          ("marker", None): "m"}


def _code(row: dict) -> str:
    if row["kind"] == "p2p":
        return _CODES[("p2p", row["op"])]
    return _CODES[(row["kind"], None)]


def slices(ranks: list[int], size: int) -> list[list[int]]:
    """The calibration slices: ``ranks`` sorted, in runs of ``size``."""
    ranks = sorted(ranks)
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


@dataclass(slots=True)
class Calibrated:
    rows: list[dict]
    """Every event of the bare trace, the measured ranks' compute spans replaced."""
    replaced: int = 0
    mismatched: list[int] = field(default_factory=list)
    """Ranks whose slice run issued a different event sequence (their bare spans are kept)."""
    classes: list[dict] = field(default_factory=list)
    """Per shard class: its members, the ranks measured, how many measurements the median took."""


def _span_of(s: list, measure: Measure) -> float:
    if measure is Measure.cpu:
        return float(s[1])
    if measure is Measure.device and len(s) > 3 and s[3] is not None:
        return float(s[3])
    return float(s[2])


def _steady_start(evs: list[dict]) -> int:
    """Index of a rank's first event after its first step marker: where its steady steps begin
    (0 when the trace marks no steps)."""
    for i, e in enumerate(evs):
        if e["kind"] == "marker" and e["op"] == "step":
            return i + 1
    return 0


def _steady_scale(median: list[float], runs: list[list[float]], start: int) -> float:
    """The factor that makes the per-event medians of the steady steps sum to the median run's
    steady total. Span noise is skewed (a late kernel, a slow launch: never an early one), and
    runs are slow at different events, so the sum of per-event medians falls under every run's
    total; a step pays all of its spans. One run: 1."""
    if len(runs) < 2:
        return 1.0
    total = sum(median[start:])
    want = statistics.median(sum(run[start:]) for run in runs)
    return want / total if total > 0 else 1.0


def _full_steps(evs: list[dict]) -> list[tuple[int, int]]:
    """``(start, end)`` of each full steady step of a rank's events: from just after one step
    marker through the next, the marker included."""
    marks = [i for i, e in enumerate(evs) if e["kind"] == "marker" and e["op"] == "step"]
    return [(a + 1, b + 1) for a, b in zip(marks, marks[1:])]


def _steady_steps(evs: list[dict]) -> list[tuple[int, int]]:
    """The full steady steps (:func:`_full_steps`) that issue the event sequence (kind, op, bytes)
    most of them issue, when two or more do; otherwise none. A step that differs (torchtitan's
    first steady step adds a barrier) keeps its own spans."""
    steps = _full_steps(evs)
    shapes = [tuple((evs[i]["kind"], evs[i]["op"], evs[i].get("nbytes")) for i in range(a, b)) for a, b in steps]
    if not shapes:
        return []
    counts = {x: shapes.count(x) for x in shapes}
    best = max(counts.values())
    if best < 2:
        return []
    common = next(x for x in reversed(shapes) if counts[x] == best)  # a tie: the later steps' shape
    return [st for st, x in zip(steps, shapes) if x == common]


def _pool_steps(median: list[float], runs: list[list[float]], steps: list[tuple[int, int]],
                skip: int = 0) -> tuple[list[float], float]:
    """Steady steps that issue the same events are the same work: each event's span becomes the
    median over every run and every steady step, scaled so a step sums to the median of all the
    (run, step) totals. A slow step (a host hiccup, a late kernel) is then one sample among
    many, not the whole of the prediction, even from one run. The first ``skip`` steady steps
    give no sample (every step still gets the pooled spans). Returns the spans and the scale."""
    samples = [run[a:b] for run in runs for a, b in steps[skip:]]
    pooled = [statistics.median(col) for col in zip(*samples)]
    total = sum(pooled)
    want = statistics.median(sum(x) for x in samples)
    scale = want / total if total > 0 else 1.0
    out = list(median)
    for a, b in steps:
        out[a:b] = [v * scale for v in pooled]
    return out, scale


def apply_spans(reader: TraceReader, measured: dict[int, list[list]], measure: Measure,
                classes: Sequence[ShardClass] | None = None, profiled_steps: int = 0) -> Calibrated:
    """Replace compute spans by measured ones. ``measured[rank]``: the slice runs of ``rank``,
    each the sandbox summary's ``spans`` (one ``[code, cpu_s, wall_s, device_s]`` per event;
    ``device_s`` None where the rank had no device timeline). With ``classes``, each class's
    measurements (of any of its members) give every member the per-event median; without,
    each measured rank gets the median of its own runs. Where two or more full steady steps
    issue the same events, every run's steady steps are pooled (:func:`_pool_steps`); otherwise,
    with two or more runs, the steady steps' medians are scaled to sum to the median run's
    steady total (:func:`_steady_scale`). ``profiled_steps``: the first steady steps of every run
    were traced by a profiler (``calibrate.kernel_mix``, :mod:`prism_launch.rank.kernels`); they give
    the pool no sample where two or more other steady steps remain."""
    rows = reader.events().to_pylist()
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    for evs in by_rank.values():
        evs.sort(key=lambda r: r["idx"])
    if classes is None:
        classes = [ShardClass((r,), None) for r in sorted(measured)]

    out = Calibrated(rows=rows)
    for c in classes:
        runs, bad = [], set()
        for r in c.members:
            codes = [_code(e) for e in by_rank.get(r, [])]
            for spans in measured.get(r, []):
                if [s[0] for s in spans] == codes:
                    runs.append([_span_of(s, measure) for s in spans])
                else:
                    bad.add(r)
        out.mismatched.extend(sorted(bad))
        out.classes.append({"members": len(c.members), "representative": c.representative, "stage": c.stage,
                            "measured_ranks": sorted(r for r in c.members if r in measured),
                            "measurements": len(runs)})
        if not runs:
            continue
        median = [statistics.median(col) for col in zip(*runs)]
        rep = by_rank.get(c.members[0], []) if c.members else []
        steps = _steady_steps(rep) if len(rep) == len(median) else []
        if steps:
            # the profiled steps (the first full ones) give no sample, where they are among those pooled
            profiled = set(_full_steps(rep)[:profiled_steps])
            lead = next((k for k, st in enumerate(steps) if st not in profiled), len(steps))
            skip = lead if len(steps) - lead >= 2 else 0
            median, scale = _pool_steps(median, runs, steps, skip)
            out.classes[-1]["steady_steps_pooled"] = (len(steps) - skip) * len(runs)
            if skip:
                out.classes[-1]["profiled_steps_left_out"] = skip
        else:
            steady = _steady_start(rep)
            scale = _steady_scale(median, runs, steady)
            median = median[:steady] + [m * scale for m in median[steady:]]
        out.classes[-1]["steady_scale"] = scale
        for r in c.members:
            evs = by_rank.get(r, [])
            if len(evs) != len(median) or r in bad:
                if r not in bad and r not in out.mismatched:
                    out.mismatched.append(r)
                continue
            for e, span in zip(evs, median):
                e["extra"] = json.dumps({**(json.loads(e["extra"]) if e["extra"] else {}),
                                         "bare_cpu_s": e["compute_cpu_s"], "bare_wall_s": e["compute_wall_s"]})
                e["compute_cpu_s"] = e["compute_wall_s"] = span
                out.replaced += 1
    out.mismatched.sort()
    return out


def steady_step_span(rows: list[dict], rank: int) -> float | None:
    """The median total of ``rank``'s compute spans over its full steady steps (``rows``: a
    calibrated trace's events); None where the rank has fewer than two identical steady steps."""
    evs = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["idx"])
    steps = _steady_steps(evs)
    if not steps:
        return None
    return statistics.median(sum(e["compute_wall_s"] or 0.0 for e in evs[a:b]) for a, b in steps)


def write_calibrated(reader: TraceReader, trace: TraceLayout, calibrated: Calibrated, extra: dict) -> TraceLayout:
    """Commit the calibrated version beside the bare trace; returns its layout."""
    out = trace.calibrated
    with TraceWriter(out.root) as writer:
        writer.add_events(calibrated.rows)
        m = reader.manifest
        writer.commit(
            fingerprint=m.fingerprint, versions=m.versions, world_size=m.world_size, topology=m.topology,
            groups=m.groups, ranks_captured=m.ranks_captured,
            extra={**m.extra, "calibrated_from": str(trace.root), "events_calibrated": calibrated.replaced,
                   "ranks_mismatched": calibrated.mismatched, **extra},
            allow_missing_tensors=True,
        )
    return out
