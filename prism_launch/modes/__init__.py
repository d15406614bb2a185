"""Mode runners: ``real``, ``capture``, ``calibrate``, ``emulate``, and ``auto``, which
composes them. Each takes the :class:`~prism_launch.modes.context.RunContext` (the resolved
config, the program, the trace and report layouts, the launch agent) and nothing else.

Before any rank starts, :func:`preflight` checks that every directory the run writes can be
written and that the trace's file system has room; a capture holds the trace directory's lock
exclusive, an emulation or a calibration holds it shared (and the report's, or the calibrated
trace's, exclusive) (:class:`~prism_launch.trace.lock.DirLock`), so a second writer on the same
directory, or a capture under running ranks, is refused naming the holder instead of colliding.
Under the trace's lock a run first puts back a trace a killed capture left set aside and
removes the staging directories of captures that are gone (:func:`claim_trace`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from prism_launch.launch.args import LaunchArgs
from prism_launch.config import Mode, PrismConfig
from prism_launch.errors import RunFailedError, TraceMismatchError
from prism_launch.launch.progress import phase
from prism_launch.modes.context import RunContext
from prism_launch.trace import TraceMissingError
from prism_launch.trace.durable import cleanup_stale_partials, recover_interrupted_swap
from prism_launch.trace.lock import DirLock
from prism_launch.trace.space import require_space, require_writable


@dataclass(frozen=True, slots=True)
class RunOutcome:
    mode: Mode
    trace_dir: Path | None
    report_dir: Path | None
    log_dir: Path


def real(ctx: RunContext) -> Path:
    """Every rank physical over the real backend, like torchrun (with memory figures)."""
    from dataclasses import replace

    log_dir = ctx.log_dir(Mode.real)
    plan = ctx.base_plan(Mode.real, list(range(ctx.topo.world_size)))
    if ctx.cfg.memory.track:
        plan = replace(plan, memory_dir=str(log_dir))
    return ctx.agent.run(plan, log_dir=log_dir, fresh_port=True)


def auto(ctx: RunContext) -> Path:
    """Capture when no matching trace exists (or around sandbox ranks a folded capture left
    out), calibrate when asked (``calibrate.in_auto``, the default on CUDA, whatever the
    capture's payload policy: ``payload=none`` traces too) and not done yet, then emulate. On
    CUDA a trace is never replayed uncalibrated from host time: with ``calibrate.in_auto=false``
    the run is refused up front unless ``replay.compute`` names a host clock."""
    from prism_launch.modes.emulate import open_trace

    reader, why = None, None
    try:
        with claim_trace(ctx, write=False):  # a trace a stopped capture set aside is put back first
            reader = open_trace(ctx)
    except (TraceMissingError, TraceMismatchError) as e:
        why = "no trace yet" if isinstance(e, TraceMissingError) else str(e)
    # capture outside the except clause: ranks forked inside it would chain every error of the
    # program to the "No PrismTrace" that started the capture
    if reader is None:
        print(f"prism-launch: {why}; capturing {ctx.topo.world_size} logical ranks into {ctx.trace.root}",
              file=sys.stderr)
        auto_capture(ctx)
        reader = open_trace(ctx)
    missing = [r for r in ctx.cfg.sandbox.ranks if r not in reader.manifest.ranks_captured]
    if missing:
        print(f"prism-launch: sandbox ranks {missing} are outside the folded capture in {ctx.trace.root}; "
              "capturing again around them", file=sys.stderr)
        auto_capture(ctx)
        reader = open_trace(ctx)
    calibrating = ctx.cfg.calibrate.in_auto and not ctx.trace.calibrated.exists()
    if ctx.cfg.on_cuda and not calibrating and not ctx.trace.calibrated.exists():
        # refused before any rank runs: the replay would otherwise stop after the emulation
        from prism_launch.predict.compute_source import select

        select(ctx.cfg, reader, ctx.trace)
    from prism_launch.modes.emulate import trace_scope, uncovered

    if uncovered(ctx, reader) or (calibrating and trace_scope(reader) is not None):
        print(f"prism-launch: the trace in {ctx.trace.root} holds payloads for sandbox ranks {trace_scope(reader)} "
              f"only (capture.payload=exact); capturing again for sandbox ranks {list(ctx.cfg.sandbox.ranks)}"
              + (" and calibration" if calibrating else ""), file=sys.stderr)
        auto_capture(ctx)
        reader = open_trace(ctx)
    if calibrating:
        locked_calibration(ctx)
    return locked_emulation(ctx)


def auto_capture(ctx: RunContext) -> None:
    """The capture step of ``auto``: a failure is the program's (or the disk's), named as such."""
    from prism_launch.modes.capture import capture

    try:
        locked_capture(ctx)
    except RunFailedError as e:
        raise RunFailedError(f"{e}\n(mode=auto: the capture failed, so no trace was written to {ctx.trace.root} "
                             "and nothing was emulated; fix the error above and run again)") from None


def claim_trace(ctx: RunContext, *, write: bool) -> DirLock:
    """The trace's lock (``write``: exclusive, for a capture; else shared, for a run replaying
    it), taken, after which what a killed capture left is put right: a trace it set aside
    between its two renames is put back, and (``write``) its staging directories are removed."""
    lock = DirLock(ctx.trace.root, setting="trace.dir", shared=not write).acquire()
    try:
        back = recover_interrupted_swap(ctx.trace.root)
        if back is not None:
            print(f"prism-launch: {ctx.trace.root} was missing (a capture was stopped while replacing it); "
                  f"put back the previous trace from {back.name}", file=sys.stderr)
        if write:
            for gone in cleanup_stale_partials(ctx.trace.root.parent, name=ctx.trace.root.name):
                print(f"prism-launch: removed {gone}, left by a capture that was stopped", file=sys.stderr)
    except BaseException:
        lock.release()
        raise
    return lock


def locked_capture(ctx: RunContext) -> Path:
    from prism_launch.modes.capture import capture

    with claim_trace(ctx, write=True):
        return capture(ctx)


def locked_emulation(ctx: RunContext) -> Path:
    """Emulate holding the trace's lock shared (and the report's), the trace opened under it
    (verification is remembered: opening it again costs little)."""
    from prism_launch.modes.emulate import emulate, open_trace

    # node 0 writes the report; another physical node only its ranks' summaries (report/node<k>)
    with claim_trace(ctx, write=False), \
            DirLock(ctx.report.summaries(ctx.cfg.physical.node_rank).parent, setting="report.dir"), \
            phase(f"emulating sandbox ranks {list(ctx.cfg.sandbox.ranks)} of {ctx.topo.world_size}",
                  setting=ctx.cfg.launch.progress):
        return emulate(ctx, open_trace(ctx))


def locked_calibration(ctx: RunContext) -> None:
    from prism_launch.modes.calibrate import calibrate
    from prism_launch.modes.emulate import open_trace

    with claim_trace(ctx, write=False), DirLock(ctx.trace.calibrated.root, setting="trace.dir"):
        calibrate(ctx, open_trace(ctx))


def preflight(ctx: RunContext) -> None:
    """What can be known to fail before any rank starts: a directory the run must write that
    cannot be written, a trace file system with no room left."""
    mode = ctx.cfg.mode
    if ctx.log_root is not None:
        require_writable(ctx.log_root, setting="--log-dir")
    if mode in (Mode.capture, Mode.calibrate) or (mode is Mode.auto and not ctx.trace.exists()):
        require_writable(ctx.trace.root, setting="trace.dir")
        require_space(ctx.trace.root.parent, 0)
    if mode in (Mode.emulate, Mode.auto) and ctx.cfg.physical.node_rank == 0:
        require_writable(ctx.report.root, setting="report.dir")


def run(cfg: PrismConfig, args: LaunchArgs) -> RunOutcome:
    """One prism-launch invocation of a resolved, validated config."""
    ctx = RunContext.build(cfg, args)
    preflight(ctx)
    mode = cfg.mode
    if mode is Mode.real:
        return RunOutcome(mode, None, None, real(ctx))
    if mode is Mode.capture:
        return RunOutcome(mode, ctx.trace.root, None, locked_capture(ctx))
    if mode is Mode.calibrate:
        locked_calibration(ctx)
        return RunOutcome(mode, ctx.trace.root, None, ctx.trace.root)
    if mode is Mode.emulate:
        return RunOutcome(mode, ctx.trace.root, ctx.report.root, locked_emulation(ctx))
    return RunOutcome(mode, ctx.trace.root, ctx.report.root, auto(ctx))
