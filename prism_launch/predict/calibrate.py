"""Slice calibration: the capture's timings are distorted (many logical ranks share a few
devices), so slices of ``calibrate.slice_size`` ranks are run for real as sandbox ranks
while the rest are replayed from the bare trace. Each slice rank's compute span before
each of its events — measured where it ran uncontended — replaces the bare span. Spans are
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
from dataclasses import dataclass, field

from prism_launch.config import Measure
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


def apply_spans(reader: TraceReader, measured: dict[int, list], measure: Measure) -> Calibrated:
    """Replace each measured rank's compute span before each event by the slice's
    (``measured[rank]``: the sandbox summary's ``spans``, one ``[code, cpu_s, wall_s, device_s]``
    per event; ``device_s`` None where the rank had no device timeline)."""
    rows = reader.events().to_pylist()
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    for evs in by_rank.values():
        evs.sort(key=lambda r: r["idx"])
    def span(s: list) -> float:
        if measure is Measure.cpu:
            return float(s[1])
        if measure is Measure.device and len(s) > 3 and s[3] is not None:
            return float(s[3])
        return float(s[2])

    out = Calibrated(rows=rows)
    for r, spans in measured.items():
        evs = by_rank.get(r, [])
        if [s[0] for s in spans] != [_code(e) for e in evs]:
            out.mismatched.append(r)
            continue
        for e, s in zip(evs, spans):
            e["extra"] = json.dumps({**(json.loads(e["extra"]) if e["extra"] else {}),
                                     "bare_cpu_s": e["compute_cpu_s"], "bare_wall_s": e["compute_wall_s"]})
            e["compute_cpu_s"] = e["compute_wall_s"] = span(s)
            out.replaced += 1
    return out


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
