"""``mode=calibrate``: slices of captured ranks run for real as sandbox ranks against the
bare trace, one slice after another; their measured compute spans become the calibrated
trace (:mod:`prism_launch.predict.calibrate`): by default one member of each shard class
(:mod:`prism_launch.predict.shard_classes`), repeated, the median for the whole class. Each
slice runs under its own config value —
its sandbox ranks, no virtual lateness, no divergence hashing, its own report directory."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from prism_launch.config import Timing
from prism_launch.config.root import devices_present
from prism_launch.launch.progress import phase
from prism_launch.modes.context import RunContext
from prism_launch.modes.emulate import emulate
from prism_launch.predict.calibrate import apply_spans, slices, steady_step_span, write_calibrated
from prism_launch.predict.gpu_scaling import mix_from_kernels
from prism_launch.predict.shard_classes import ShardClass, classes_of_trace, measurement_slices
from prism_launch.trace import TraceLayout, TraceReader


def slice_context(ctx: RunContext, ranks: list[int], index: int) -> RunContext:
    cfg = ctx.cfg
    report = ctx.trace.default_report.calibration_slice(index)
    sliced = replace(
        cfg, sandbox=replace(cfg.sandbox, ranks=list(ranks)),
        # the slice measures its own compute; waits are the replay's job, and hashing every
        # contribution would inflate the spans
        emulate=replace(cfg.emulate, timing=Timing.none, check_divergence=False),
        report=replace(cfg.report, dir=str(report.root)),
    )
    return ctx.with_config(sliced, report=report, profile_kernels=bool(cfg.calibrate.kernel_mix))


def class_mixes(classes: list[ShardClass], kernels: dict[int, list]) -> dict:
    """Each shard class's kernel mix from its measured members' profiled first steady steps (their kernel
    times summed over runs; :mod:`prism_launch.rank.kernels`), for the manifest: ``kernel_mixes``
    (one entry per class: its members, the FLOP-bound, memory-bound and communication shares of its
    kernel time, the kernel time of one profiled step (``step_kernel_s``: the runs' mean), the
    longest kernels) and ``kernel_mix_errors`` (runs that listed none, and why)."""
    mixes, errors = [], []
    for c in classes:
        times: dict[str, float] = {}
        activity, listed = None, 0
        for r in c.members:
            for run in kernels.get(r, []):
                if not run or "error" in run:
                    errors.append({"rank": r, "error": (run or {}).get("error", "no kernels in the rank's summary")})
                    continue
                activity, listed = run.get("activity"), listed + 1
                for name, seconds in run["kernels"]:
                    times[name] = times.get(name, 0.0) + seconds
                times[""] = times.get("", 0.0) + run.get("others_s", 0.0)  # beyond the longest: no class
        if not any(times.values()):
            continue
        mix = mix_from_kernels(times.items())
        top = sorted(((k, v) for k, v in times.items() if k), key=lambda kv: -kv[1])[:8]
        mixes.append({"members": list(c.members), "compute": mix.compute, "memory": mix.memory, "comm": mix.comm,
                      "kernel_s": sum(times.values()), "step_kernel_s": sum(times.values()) / listed,
                      "activity": activity, "longest": [[k, v] for k, v in top]})
    return {"kernel_mixes": mixes, "kernel_mix_errors": errors}


def busy_shares(mixes: list[dict], rows: list[dict]) -> None:
    """Give each class's mix (in place) ``steady_step_s``, the calibrated compute of one steady step
    of its first member, and ``busy_share``, the share of it the GPU spent in the profiled step's
    kernels (communication kernels aside): the rest is the GPU waiting on its host (launches, the
    program's Python), time another GPU does not change."""
    for mix in mixes:
        span = steady_step_span(rows, mix["members"][0])
        if span and span > 0 and mix.get("step_kernel_s"):
            mix["steady_step_s"] = span
            mix["busy_share"] = min(1.0, mix["step_kernel_s"] * (1.0 - mix["comm"]) / span)


def calibrate(ctx: RunContext, reader: TraceReader) -> TraceLayout:
    """Run the slices, write ``<trace>/calibrated``; returns its layout. By default one member of
    every shard class is measured ``calibrate.repeats`` times (distinct members where the class
    has them) and the class gets the per-event median; ``calibrate.ranks`` measures those ranks
    each for itself, once."""
    cal = ctx.cfg.calibrate
    devices = devices_present(ctx.cfg.on_cuda)
    kind = "GPU" if ctx.cfg.on_cuda else "CPU core"
    per_slice = min(cal.slice_size, devices)
    if per_slice < cal.slice_size:
        print(f"prism-launch: calibrate.slice_size={cal.slice_size} but this machine has {devices} {kind}(s): "
              f"slices of {per_slice}, so no two ranks of a slice share a device", file=sys.stderr)
    if cal.ranks is not None:
        classes, repeats = None, 1
        todo = slices(cal.ranks, per_slice)
    else:
        classes, repeats = classes_of_trace(reader), cal.repeats
        todo = measurement_slices(classes, repeats, per_slice)
        print(f"prism-launch: {len(reader.manifest.ranks_captured)} captured ranks form {len(classes)} shard "
              f"class(es) (same stage, same shapes); measuring each {repeats} time(s) in {len(todo)} slice(s)",
              file=sys.stderr)
    from prism_launch.errors import PrismError
    from prism_launch.modes.emulate import uncovered

    for ranks in todo:
        refused = uncovered(ctx, reader, ranks, " (calibration runs its slices as sandbox ranks)")
        if refused:
            raise PrismError(refused)
    measured: dict[int, list] = {}
    kernels: dict[int, list] = {}
    t0 = time.monotonic()
    with phase("calibrating", total=len(todo), setting=ctx.cfg.launch.progress) as bar:
        for i, ranks in enumerate(todo):
            print(f"prism-launch: calibrating slice {i + 1}/{len(todo)}: ranks {ranks}", file=sys.stderr)
            bar.update(completed=i, info=f"slice {i + 1}/{len(todo)}: ranks {ranks}")
            sliced = slice_context(ctx, ranks, i)
            emulate(sliced, reader, quiet=True)
            for r in ranks:
                summary = json.loads(sliced.report.summary(r).read_text())
                measured.setdefault(r, []).append(summary["spans"])
                if sliced.profile_kernels:
                    kernels.setdefault(r, []).append((summary.get("memory") or {}).get("kernels"))
    mixes = class_mixes(classes or [ShardClass((r,), None) for r in sorted(measured)], kernels) if kernels else {}
    if mixes.get("kernel_mix_errors"):
        first = mixes["kernel_mix_errors"][0]
        print(f"prism-launch: warning: calibrate.kernel_mix: {len(mixes['kernel_mix_errors'])} slice run(s) listed no "
              f"kernels (rank {first['rank']}: {first['error']}); their classes scale by counted FLOPs or the default "
              "mix instead", file=sys.stderr)
    result = apply_spans(reader, measured, cal.measure, classes, profiled_steps=1 if kernels else 0)
    busy_shares(mixes.get("kernel_mixes") or [], result.rows)
    if result.mismatched:
        print(f"prism-launch: warning: ranks {result.mismatched} issued a different event sequence than captured; "
              "their bare spans are kept", file=sys.stderr)
    out = write_calibrated(reader, ctx.trace, result, {
        "slices": todo, "slice_size": cal.slice_size, "ranks_per_slice": per_slice, "devices": devices,
        "device": str(ctx.cfg.device), "method": f"one rank per {kind}", "measure": str(cal.measure),
        "by_class": classes is not None, "shard_classes": result.classes, "repeats": repeats,
        "calibration_wall_s": time.monotonic() - t0,
        **mixes})
    print(f"prism-launch: calibrated {result.replaced} spans of "
          f"{len(reader.manifest.ranks_captured) - len(result.mismatched)} ranks"
          + (f" ({len(classes)} shard classes, {repeats} measurement(s) each, median)" if classes is not None else "")
          + f" in {len(todo)} slices in {time.monotonic() - t0:.1f}s -> {out.root}", file=sys.stderr)
    return out
