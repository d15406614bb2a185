"""``mode=capture``: every logical rank (or a folded capture's representatives) runs against
the capture coordinator, context-switched over the devices present, into a PrismTrace."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from prism_launch.config import Mode, Park
from prism_launch.config.plan import CapturePlan
from prism_launch.errors import RunFailedError
from prism_launch.launch.logs import parse_rank_log
from prism_launch.modes.context import RunContext
from prism_launch.trace import RankLogs, TraceLayout, TraceWriter
from prism_launch.trace import fingerprint as fp
from prism_launch.trace.fold import FoldPlan


def discover_groups(ctx: RunContext) -> list[tuple[list[int], str]]:
    """Run one logical rank up to its first communication op; return every ``new_group``
    call it made (rank list, description) — the whole world's group layout."""
    out_dir = Path(tempfile.mkdtemp(prefix="prism-discover-"))
    out = out_dir / "groups.json"
    rank = ctx.cfg.sandbox.ranks[0]
    plan = replace(ctx.base_plan(Mode.capture, [rank]), capture=CapturePlan(discover_file=str(out)))
    try:
        ctx.agent.run(plan, log_dir=out_dir / "logs")
    except RunFailedError as e:  # its logs stay for the user to read
        raise RunFailedError(f"group discovery for the folded capture failed (capture.fold=false skips it): {e}") from None
    if not out.exists():
        raise RunFailedError(f"group discovery: rank {rank} ended without reporting its groups; logs in {out_dir}")
    groups = [(list(r), d) for r, d in json.loads(out.read_text())["groups"]]
    shutil.rmtree(out_dir, ignore_errors=True)
    return groups


def fold_plan(ctx: RunContext) -> FoldPlan:
    from prism_launch.capture.fold import plan

    ws = ctx.topo.world_size
    if not ctx.cfg.capture.fold:
        return FoldPlan.identity(ws)
    t0 = time.monotonic()
    groups = discover_groups(ctx)
    p = plan(groups, ctx.cfg.sandbox.ranks, ws, ctx.cfg.capture.replicated_groups)
    print(f"prism-launch: folded capture: {len(p.captured)} of {ws} logical ranks closed under the "
          f"model-parallel groups of sandbox ranks {list(ctx.cfg.sandbox.ranks)} "
          f"({len(groups)} new_group calls, {time.monotonic() - t0:.1f}s)", file=sys.stderr)
    return p


def parker(ctx: RunContext, slots: int | None):
    cap = ctx.cfg.capture
    if cap.park is Park.none:
        return None
    from prism_launch.launch.parking import CudaCheckpointParker

    return CudaCheckpointParker(cap.resident or slots or 1)


def capture(ctx: RunContext) -> Path:
    """Record the trace into ``ctx.trace``; returns the capture's log directory."""
    from prism_launch.capture.coordinator import CaptureError, Coordinator

    ws = ctx.topo.world_size
    fold = fold_plan(ctx)
    ranks = list(fold.captured)
    slots = ctx.cfg.capture.slots or None  # 0: no limit
    park = parker(ctx, slots)
    sock_dir = Path(tempfile.mkdtemp(prefix="prism-coord-"))
    authkey = os.urandom(16)
    coord = Coordinator(str(sock_dir / "coord.sock"), authkey, ws, ctx.cfg.comm.timeout_s, slots=slots,
                        parker=park, fold=fold if fold.folded else None)
    plan = replace(ctx.base_plan(Mode.capture, ranks), capture=CapturePlan(
        coordinator=coord.address, authkey=authkey.hex(), captured=tuple(ranks) if fold.folded else None))
    t0 = time.monotonic()
    try:
        try:
            log_dir = ctx.agent.run(plan, log_dir=ctx.log_dir(Mode.capture), on_tick=lambda: coord.pump(0.02),
                                    on_start=coord.start)
        except CaptureError as e:
            raise RunFailedError(f"capture failed: {e}") from None
        for _ in range(50):  # drain what ranks sent right before exiting
            coord.pump(0.01)
        left = coord.unfinished()
        if left:
            raise RunFailedError(f"capture incomplete: {left}")
    finally:
        coord.close()
        for p in sock_dir.iterdir():
            p.unlink(missing_ok=True)
        sock_dir.rmdir()
    wall = time.monotonic() - t0
    steps = {r: parse_rank_log(RankLogs(log_dir).stdout(r), ctx.cfg.report) for r in ranks}
    sched = coord.scheduler
    stats = {"wall_s": wall, "slots": slots, "max_running": sched.max_running, "resumes": sched.switches,
             "extra_slots": sched.extra, "parking": park.stats.to_dict() if park is not None else None,
             "ranks": len(ranks), "folded": fold.folded}
    program = ctx.program
    with TraceWriter(ctx.trace.root) as writer:
        writer.add_events(coord.events)
        for r in ranks:
            if coord.tensors[r]:
                writer.add_tensors(r, coord.tensors[r])
        writer.write_json(TraceLayout.STEPS, {str(r): s for r, s in steps.items()})
        writer.write_json(TraceLayout.MEMORY, {str(r): m for r, m in coord.memory.items()})
        writer.write_json(TraceLayout.CAPTURE, stats)
        if fold.folded:
            writer.write_json(TraceLayout.FOLD, {**fold.to_dict(), "approximated_groups": coord.approximated_groups})
        from prism_launch.modes.context import program_config

        writer.commit(
            fingerprint=ctx.fingerprint, versions=fp.versions(), world_size=ws, topology=ctx.topo.to_dict(),
            groups=coord.groups(), ranks_captured=ranks,
            extra={"script": program.script, "script_args": list(program.args), "module": program.module,
                   "program_config": program_config(ctx.cfg), "capture_wall_s": wall,
                   "ops": coord.ops_completed, "log_dir": str(log_dir), "capture": stats},
        )
    nbytes = sum(t.numel() * t.element_size() for d in coord.tensors for t in d.values())
    what = f"{len(ranks)} of {ws} logical ranks (folded)" if fold.folded else f"{ws} logical ranks"
    print(f"prism-launch: captured {what}, {coord.ops_completed} ops, {len(coord.events)} events, "
          f"{nbytes / 2**20:.1f} MiB of tensors in {wall:.1f}s ({slots or 'unlimited'} slots, "
          f"{sched.switches} resumes) -> {ctx.trace.root}", file=sys.stderr)
    return log_dir
