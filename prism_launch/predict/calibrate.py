"""Slice calibration: the capture's timings are distorted (many logical ranks share a few
devices), so slices of ``calibrate.slice_size`` ranks are run for real as sandbox ranks
while the rest are replayed from the bare trace. Each slice rank's compute span before
each of its events — measured where it ran uncontended — replaces the bare span. Spans are
durations between a rank's own events, so slices need no clock alignment: the global
replay stitches them together through the graph's dependency edges (collectives and
messages), which is where the calibrated timeline gets its cross-rank alignment.

The calibrated trace is written as a new trace version beside the bare one:
``<trace.dir>/calibrated`` (events and manifest only; tensors stay in the bare trace).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism_launch.modes.launcher import Launcher
    from prism_launch.trace import TraceReader

_CODES = {("collective", None): "c", ("p2p", "send"): "s", ("p2p", "recv"): "r", ("wait", None): "w",
          ("marker", None): "m"}


def calibrated_dir(trace_dir: Path) -> Path:
    return trace_dir / "calibrated"


def _code(row: dict) -> str:
    if row["kind"] == "p2p":
        return _CODES[("p2p", row["op"])]
    return _CODES[(row["kind"], None)]


def calibrate(launcher: Launcher, reader: TraceReader) -> Path:
    """Run the slices, write ``<trace>/calibrated``; returns its path."""
    from prism_launch.config import Measure, Timing
    from prism_launch.trace import TraceWriter

    cfg = launcher.cfg
    ranks = sorted(cfg.calibrate.ranks if cfg.calibrate.ranks is not None else reader.manifest.ranks_captured)
    size = cfg.calibrate.slice_size
    slices = [ranks[i : i + size] for i in range(0, len(ranks), size)]
    rows = reader.events().to_pylist()
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(row["rank"], []).append(row)
    for evs in by_rank.values():
        evs.sort(key=lambda r: r["idx"])

    measured: dict[int, list] = {}
    t0 = time.monotonic()
    saved = (list(cfg.sandbox.ranks), cfg.emulate.timing, cfg.report.dir, cfg.emulate.check_divergence)
    try:
        for i, sl in enumerate(slices):
            print(f"prism-launch: calibrating slice {i + 1}/{len(slices)}: ranks {sl}", file=sys.stderr)
            cfg.sandbox.ranks = sl
            cfg.emulate.timing = Timing.none  # the slice measures its own compute; waits are the replay's job
            cfg.emulate.check_divergence = False  # hashing every contribution would inflate the spans
            cfg.report.dir = str(launcher.trace_dir / "report" / "calibration" / f"slice{i}")
            launcher.emulate(reader, quiet=True)
            for r in sl:
                summary = json.loads((Path(cfg.report.dir) / "sandbox" / f"rank{r}.json").read_text())
                measured[r] = summary["spans"]
    finally:
        cfg.sandbox.ranks, cfg.emulate.timing, cfg.report.dir, cfg.emulate.check_divergence = saved

    use = 1 if cfg.calibrate.measure is Measure.cpu else 2
    replaced, mismatched = 0, []
    for r, spans in measured.items():
        evs = by_rank.get(r, [])
        codes = [_code(e) for e in evs]
        if [s[0] for s in spans] != codes:
            mismatched.append(r)
            continue
        for e, s in zip(evs, spans):
            e["extra"] = json.dumps({**(json.loads(e["extra"]) if e["extra"] else {}),
                                     "bare_cpu_s": e["compute_cpu_s"], "bare_wall_s": e["compute_wall_s"]})
            e["compute_cpu_s"] = e["compute_wall_s"] = float(s[use])
            replaced += 1
    if mismatched:
        print(f"prism-launch: warning: ranks {mismatched} issued a different event sequence than captured; "
              "their bare spans are kept", file=sys.stderr)
    out = calibrated_dir(launcher.trace_dir)
    with TraceWriter(out) as writer:
        writer.add_events(rows)
        m = reader.manifest
        writer.commit(
            fingerprint=m.fingerprint, versions=m.versions, world_size=m.world_size, topology=m.topology,
            groups=m.groups, ranks_captured=m.ranks_captured,
            extra={**m.extra, "calibrated_from": str(launcher.trace_dir), "slices": slices,
                   "slice_size": size, "measure": str(cfg.calibrate.measure), "events_calibrated": replaced,
                   "ranks_mismatched": mismatched, "calibration_wall_s": time.monotonic() - t0},
            allow_missing_tensors=True,
        )
    print(f"prism-launch: calibrated {len(measured) - len(mismatched)} ranks in {len(slices)} slices "
          f"({replaced} spans) in {time.monotonic() - t0:.1f}s -> {out}", file=sys.stderr)
    return out
