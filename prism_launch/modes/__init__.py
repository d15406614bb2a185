"""Mode runners: ``real``, ``capture``, ``calibrate``, ``emulate``, and ``auto``, which
composes them. Each takes the :class:`~prism_launch.modes.context.RunContext` (the resolved
config, the program, the trace and report layouts, the launch agent) and nothing else."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from prism_launch.launch.args import LaunchArgs
from prism_launch.config import Mode, PrismConfig
from prism_launch.errors import TraceMismatchError
from prism_launch.modes.context import RunContext
from prism_launch.trace import TraceMissingError


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
    out), calibrate when asked (``calibrate.in_auto``) and not done yet, then emulate."""
    from prism_launch.modes.calibrate import calibrate
    from prism_launch.modes.capture import capture
    from prism_launch.modes.emulate import emulate, open_trace

    try:
        reader = open_trace(ctx)
    except (TraceMissingError, TraceMismatchError) as e:
        print(f"prism-launch: {'no trace yet' if isinstance(e, TraceMissingError) else e}; capturing "
              f"{ctx.topo.world_size} logical ranks into {ctx.trace.root}", file=sys.stderr)
        capture(ctx)
        reader = open_trace(ctx)
    missing = [r for r in ctx.cfg.sandbox.ranks if r not in reader.manifest.ranks_captured]
    if missing:
        print(f"prism-launch: sandbox ranks {missing} are outside the folded capture in {ctx.trace.root}; "
              "capturing again around them", file=sys.stderr)
        capture(ctx)
        reader = open_trace(ctx)
    if ctx.cfg.calibrate.in_auto and not ctx.trace.calibrated.exists():
        calibrate(ctx, reader)
    return emulate(ctx, reader)


def run(cfg: PrismConfig, args: LaunchArgs) -> RunOutcome:
    """One prism-launch invocation of a resolved, validated config."""
    from prism_launch.modes.calibrate import calibrate
    from prism_launch.modes.capture import capture
    from prism_launch.modes.emulate import emulate, open_trace

    ctx = RunContext.build(cfg, args)
    mode = cfg.mode
    if mode is Mode.real:
        return RunOutcome(mode, None, None, real(ctx))
    if mode is Mode.capture:
        return RunOutcome(mode, ctx.trace.root, None, capture(ctx))
    if mode is Mode.calibrate:
        calibrate(ctx, open_trace(ctx))
        return RunOutcome(mode, ctx.trace.root, None, ctx.trace.root)
    if mode is Mode.emulate:
        return RunOutcome(mode, ctx.trace.root, ctx.report.root, emulate(ctx, open_trace(ctx)))
    return RunOutcome(mode, ctx.trace.root, ctx.report.root, auto(ctx))
