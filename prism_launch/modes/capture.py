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

from nccl_ext.exchange.arena import claim_directory, release_directory
from prism_launch.config import Mode, Park, Payload
from prism_launch.config.plan import CapturePlan
from prism_launch.errors import GpuWaitsStalledError, PrismError, RunFailedError, reads_out_of_memory
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
    from prism_launch.launch.progress import phase

    try:
        with phase(f"discovering the group layout (rank {rank} up to its first communication op)",
                   setting=ctx.cfg.launch.progress):
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
    cap = ctx.cfg.capture
    tp_sample = cap.tp_sample if cap.payload is Payload.none else None
    p = plan(groups, ctx.cfg.sandbox.ranks, ws, cap.replicated_groups, ep_sample=cap.ep_sample, tp_sample=tp_sample)
    tp = f"; TP positions {p.tp_positions} of each tensor-parallel group (capture.tp_sample)" if p.tp_positions else ""
    print(f"prism-launch: folded capture: {len(p.captured)} of {ws} logical ranks closed under the "
          f"model-parallel groups of sandbox ranks {list(ctx.cfg.sandbox.ranks)}{tp} "
          f"({len(groups)} new_group calls, {time.monotonic() - t0:.1f}s)", file=sys.stderr)
    return p


def parker(ctx: RunContext, slots: int | None):
    cap = ctx.cfg.capture
    if cap.park is Park.none:
        return None
    from prism_launch.launch.parking import CudaCheckpointParker

    return CudaCheckpointParker(cap.resident or slots or 1)


def payload_budget(ctx: RunContext) -> tuple[int, str]:
    """``payload=auto``'s limit on an exact trace's tensors, and what set it: the configured
    cap or the free space where the trace is written (less 10%). The launcher's memory sets
    none: tensors are spilled to disk as they are recorded."""
    cap = int(ctx.cfg.capture.payload_budget_gib * 2**30)
    where = ctx.trace.root.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    disk = int(shutil.disk_usage(where).free * 0.9)
    return min([(cap, f"capture.payload_budget_gib={ctx.cfg.capture.payload_budget_gib:g}"),
                (disk, f"the free space at {where}")])


EXCHANGE_BYTES_PER_RANK = 64 << 20
"""Room the shared-memory exchange wants per captured rank (an arena starts at 4 MiB and doubles
when a contribution does not fit)."""


COORDINATOR_DIR_PREFIX = "prism-coord-"
"""The coordinator's socket directory under the temporary directory: one a killed launcher left
is removed by the next capture (:func:`~nccl_ext.exchange.arena.claim_directory`)."""
COORDINATOR_SOCKET = "coord.sock"
UNIX_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
"""The longest path a Unix socket binds to (``sun_path`` less its terminating NUL)."""


def coordinator_base(temp: str | None = None) -> str:
    """Where the coordinator's socket directory goes: the temporary directory (``TMPDIR``), or
    ``/tmp`` when the socket's path under it would be too long for a Unix socket (a deep
    ``TMPDIR``: a test runner's, a job scheduler's per-job directory)."""
    temp = temp or tempfile.gettempdir()

    def fits(base: str) -> bool:
        name = os.path.join(base, COORDINATOR_DIR_PREFIX + "x" * 8, COORDINATOR_SOCKET)  # mkdtemp adds 8
        return len(os.fsencode(name)) <= UNIX_PATH_MAX

    if fits(temp):
        return temp
    if fits("/tmp") and os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK):
        return "/tmp"
    raise PrismError(f"the capture coordinator's socket path under the temporary directory {temp!r} would "
                     f"be longer than a Unix socket allows ({UNIX_PATH_MAX} bytes) and /tmp is not usable: "
                     "set TMPDIR to a shorter, writable directory")


def exchange_dir(fallback: Path, ranks: int) -> str | None:
    """A new directory for the shared-memory exchange: under ``/dev/shm`` (memory, not disk) when
    it has room for ``ranks`` arenas, else under ``fallback``'s file system when that has; None
    (every op through the coordinator, with a note) when neither has."""
    need = ranks * EXCHANGE_BYTES_PER_RANK
    for base in (Path("/dev/shm"), fallback):
        try:
            st = os.statvfs(base)
        except OSError:
            continue
        if os.access(base, os.W_OK) and st.f_bavail * st.f_frsize >= need:
            return claim_directory(base)
    print(f"prism-launch: capture.exchange: neither /dev/shm nor {fallback} has {need / 2**30:.1f} GiB free for "
          f"{ranks} ranks' arenas; every op goes through the coordinator", file=sys.stderr)
    return None


def _peak_rss() -> int | None:
    """The launcher's own peak resident memory so far (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def admission(ctx: RunContext, ranks: list[int]):
    """Admission by device memory for a capture on CUDA with more than one slot (None
    otherwise: one rank at a time needs none)."""
    from prism_launch.capture.slots import MemoryAdmission, free_gpu_memory

    if not ctx.cfg.on_cuda or (ctx.cfg.capture.slots or 0) == 1:
        return None
    free = free_gpu_memory()
    if not free:
        return None
    order = {r: i for i, r in enumerate(ranks)}
    return MemoryAdmission([int(f * 0.92) for f in free], lambda r: order.get(r, 0), free=free_gpu_memory,
                           fraction=0.92)


def auto_policies(ctx: RunContext) -> list[str]:
    """What ``capture.payload=auto`` tries, in order: the sandbox-scoped ``exact`` first when the
    trace's only reader is this run's emulation of its sandbox ranks (``mode=auto`` without
    calibration), else ``full`` first (a later run may emulate other sandbox ranks or calibrate
    every captured rank); ``none`` last."""
    if ctx.cfg.mode is Mode.auto and not ctx.cfg.calibrate.in_auto:
        return ["exact", "none"]
    return ["full", "exact", "none"]


_MEANS = {"exact": "only the tensors sandbox ranks {ranks} consume",
          "none": "no tensor payloads; results synthesized on each rank's device"}


def capture(ctx: RunContext) -> Path:
    """Record the trace into ``ctx.trace``; returns the capture's log directory. With
    ``capture.payload=auto`` a capture that passes its budget records again with the next
    policy of :func:`auto_policies`, and says so."""
    from prism_launch.capture.coordinator import PayloadBudgetError

    policy = ctx.cfg.capture.payload
    fold = fold_plan(ctx)
    if policy is not Payload.auto:
        return _capture_waits(ctx, fold, str(policy), None)
    budget, why = payload_budget(ctx)
    todo = auto_policies(ctx)
    for payload, then in zip(todo, todo[1:]):
        try:
            return _capture_waits(ctx, fold, payload, budget)
        except PayloadBudgetError as e:
            means = _MEANS[then].format(ranks=list(ctx.cfg.sandbox.ranks))
            print(f"prism-launch: capture.payload=auto: {e}, past the budget set by {why} "
                  f"({budget / 2**30:.2f} GiB); recording again with payload={then} ({means})", file=sys.stderr)
    return _capture_waits(ctx, fold, "none", None)


def gpu_waits(ctx: RunContext, payload: str) -> tuple[bool, bool]:
    """Whether the captured ranks wait on the GPU (``capture.gpu_waits``; only on CUDA, with the
    GPU exchange, for a payload that exchanges contributions), and whether that was chosen for
    the user (the setting unset); the launcher says which and why."""
    if not (ctx.cfg.on_cuda and ctx.cfg.capture.gpu_exchange_mib > 0 and payload != "none"):
        return False, False
    from prism_launch.config import registry

    on, why = registry.choose_gpu_waits(ctx.cfg.capture.gpu_waits, list(ctx.program.args))
    print(f"prism-launch: waits on the GPU {'on' if on else 'off'} ({why})", file=sys.stderr, flush=True)
    return on, ctx.cfg.capture.gpu_waits is None


def _capture_waits(ctx: RunContext, fold: FoldPlan, payload: str, budget: int | None) -> Path:
    """:func:`_capture`; where waits on the GPU were chosen for the user and a rank's stopped,
    once more without them, saying so."""
    on, chosen = gpu_waits(ctx, payload)
    try:
        return _capture(ctx, fold, payload, budget, on)
    except GpuWaitsStalledError as e:
        if not chosen:
            raise
        print(f"prism-launch: {e}; capturing again without waits on the GPU (capture.gpu_waits=false "
              "starts so)", file=sys.stderr, flush=True)
    return _capture(ctx, fold, payload, budget, False)


def _capture(ctx: RunContext, fold: FoldPlan, payload: str, budget: int | None, waits: bool = False) -> Path:
    ranks = list(fold.captured)
    slots = ctx.cfg.capture.slots or None  # 0: no limit
    park = parker(ctx, slots)
    admit = admission(ctx, ranks)
    spill = int(ctx.cfg.capture.spill_mib * 2**20)
    with TraceWriter(ctx.trace.root, spill_bytes=spill) as writer:
        return _record(ctx, fold, payload, budget, writer, ranks, slots, park, admit, spill, waits)


def _failure(coord, error: RunFailedError) -> RunFailedError:
    """``error``, or — where a rank said its waits on the GPU stopped — a
    :class:`GpuWaitsStalledError` that names it (the rank's word may still be on its way)."""
    for _ in range(20):
        if coord.gpu_waits_stalled:
            break
        try:
            coord.pump(0.01)
        except Exception:  # noqa: BLE001 - the capture's own failure is the one to report
            break
    if not coord.gpu_waits_stalled:
        return error
    rank, what = coord.gpu_waits_stalled[0]
    return GpuWaitsStalledError(f"{error} (rank {rank}'s waits on the GPU stopped: {what})")


def out_of_memory(error: RunFailedError, ctx: RunContext, ranks: list[int], admit, park) -> RunFailedError:
    """``error``, with what to do where a captured rank ran out of GPU memory: how many ranks
    were on the device at once and why, and the settings that put fewer there."""
    text = str(error)
    if not ctx.cfg.on_cuda or not reads_out_of_memory(text):
        return error
    alone = len(ranks) == 1 or (admit is not None and admit.max_admitted <= 1 and not admit.forced)
    if alone:
        return RunFailedError(
            f"{text}\nprism-launch: a captured rank ran out of GPU memory with no other captured rank on the "
            "device: one rank of this job does not fit this GPU. Capture on a GPU with more memory, or change the "
            "job (a smaller micro-batch, more activation recompute, more sharding of its model or optimizer)")
    where = ""
    if admit is not None:
        forced = (f", {admit.forced} of them started past the GPU's free memory because every rank on it "
                  "waited on a peer that had not started") if admit.forced else ""
        where = f" up to {admit.max_admitted} were on the device at once{forced};"
    parked = ("capture.resident=K (fewer ranks' memory on the device; the rest parked in host memory)"
              if park is not None else "capture.park=cuda_checkpoint capture.resident=K (parked ranks' GPU "
              "memory moves to host memory)")
    return RunFailedError(
        f"{text}\nprism-launch: a captured rank ran out of GPU memory: {len(ranks)} rank(s) are captured;{where} "
        f"each holds its own model shard, optimizer state and activations. Capture fewer ranks "
        f"(capture.ep_sample=1 or capture.tp_sample=1 for folded MoE or tensor-parallel jobs, or fewer "
        f"sandbox.ranks), or set {parked}")


def _record(ctx: RunContext, fold: FoldPlan, payload: str, budget: int | None, writer: TraceWriter,
            ranks: list[int], slots: int | None, park, admit, spill: int, waits: bool) -> Path:
    """Run the captured ranks against a coordinator that streams their tensors into ``writer``,
    then commit it (an exception leaves the writer to discard its staging directory)."""
    from prism_launch.capture.coordinator import CaptureError, Coordinator, PayloadBudgetError
    from prism_launch.capture.sink import BackgroundSink

    ws = ctx.topo.world_size
    sink = BackgroundSink(writer, stall_s=ctx.cfg.comm.timeout_s)
    sock_dir = Path(claim_directory(coordinator_base(), prefix=COORDINATOR_DIR_PREFIX))
    authkey = os.urandom(16)
    exchange = exchange_dir(sock_dir, len(ranks)) if payload != "none" and ctx.cfg.capture.exchange else None
    scope = tuple(ctx.cfg.sandbox.ranks) if payload == "exact" else None
    try:
        coord = Coordinator(str(sock_dir / COORDINATOR_SOCKET), authkey, ws, ctx.cfg.comm.timeout_s, slots=slots,
                            parker=park, fold=fold if fold.folded else None, payload=payload, budget_bytes=budget,
                            admission=admit, sink=sink, scope=scope, exchange=exchange)
    except BaseException:
        if exchange is not None:  # nothing else will remove it
            release_directory(exchange)
        release_directory(str(sock_dir))
        raise
    plan = replace(ctx.base_plan(Mode.capture, ranks), capture=CapturePlan(
        coordinator=coord.address, authkey=authkey.hex(), captured=tuple(ranks) if fold.folded else None,
        payload=payload, carry_bytes=ctx.cfg.capture.carry_bytes, exchange=exchange,
        switch_interval_us=ctx.cfg.capture.switch_interval_us,
        gpu_exchange_bytes=ctx.cfg.capture.gpu_exchange_mib << 20, gpu_waits=waits,
        fold_exchange=ctx.cfg.capture.fold_exchange,
        scope=scope))
    from prism_launch.capture.monitor import CaptureMonitor

    monitor = CaptureMonitor(coord, ctx.trace.root, ranks=len(ranks), setting=ctx.cfg.launch.progress,
                             # exact/full: the next spill file may hold up to spill_mib; none records no tensors
                             still_to_write=lambda: max(writer.tensor_stats()["pending_bytes"],
                                                        spill if payload != "none" else 0))
    t0 = time.monotonic()
    switch = sys.getswitchinterval()
    if ctx.cfg.capture.switch_interval_us:
        sys.setswitchinterval(ctx.cfg.capture.switch_interval_us * 1e-6)
    try:
        try:
            log_dir = ctx.agent.run(plan, log_dir=ctx.log_dir(Mode.capture),
                                    on_tick=lambda: (coord.pump(0.02), monitor.tick()), on_start=coord.start)
        except PayloadBudgetError:
            raise
        except CaptureError as e:
            raise _failure(coord, RunFailedError(f"capture failed: {e}")) from None
        except RunFailedError as e:
            raise _failure(coord, out_of_memory(e, ctx, ranks, admit, park)) from None
        for _ in range(50):  # drain what ranks sent right before exiting
            coord.pump(0.01)
        coord.drain(wait=True)
        left = coord.unfinished()
        if left:
            raise RunFailedError(f"capture incomplete: {left}")
        sink.close()
    finally:
        sys.setswitchinterval(switch)
        sink.close(discard=True)  # after a failure: drop what still waits (the writer is discarded)
        monitor.close()
        coord.close()
        if exchange is not None:
            release_directory(exchange)
        release_directory(str(sock_dir))
    wall = time.monotonic() - t0
    steps = {r: parse_rank_log(RankLogs(log_dir).stdout(r), ctx.cfg.report) for r in ranks}
    sched = coord.scheduler
    tensors = writer.tensor_stats()
    stats = {"wall_s": wall, "slots": slots, "max_running": sched.max_running, "resumes": sched.switches,
             "parking_off_after_s": None if sched.unparked_at is None else round(sched.unparked_at - coord.t0, 3),
             "extra_slots": sched.extra, "parking": park.stats.to_dict() if park is not None else None,
             "ranks": len(ranks), "folded": fold.folded, "payload": payload,
             "admission": admit.to_dict() if admit is not None else None,
             "launcher_peak_rss_bytes": _peak_rss(), "tensor_bytes": coord.bytes_recorded,
             "tensor_bytes_stored": tensors["stored_bytes"], "tensor_bytes_peak_pending": tensors["peak_pending_bytes"],
             "coordinator_busy_s": {k: round(v, 3) for k, v in coord.busy_s.items()}, "coordinator_lags": coord.lags.to_dict(),
             "rank_busy_s": {str(r): v for r, v in sorted(coord.rank_busy_s.items())},
             "writer_busy_s": round(sink.busy_s, 3), "coordinator_waited_for_writer_s": round(sink.waited_s, 3)}
    program = ctx.program
    writer.add_events(coord.events)
    writer.write_json(TraceLayout.STEPS, {str(r): s for r, s in steps.items()})
    writer.write_json(TraceLayout.MEMORY, {str(r): m for r, m in coord.memory.items()})
    writer.write_json(TraceLayout.CAPTURE, stats)
    if fold.folded:
        writer.write_json(TraceLayout.FOLD, {**fold.to_dict(), "approximated_groups": coord.approximated_groups,
                                             "ep_fold": coord.ep_fold.synthesized})
    from prism_launch.modes.context import program_config
    from prism_launch.rank.flops import measuring_device

    writer.commit(
        fingerprint=ctx.fingerprint, versions=fp.versions(), world_size=ws, topology=ctx.topo.to_dict(),
        groups=coord.groups(), ranks_captured=ranks,
        extra={"script": program.script, "script_args": list(program.args), "module": program.module,
               "program_config": program_config(ctx.cfg), "capture_wall_s": wall,
               "ops": coord.ops_completed, "log_dir": str(log_dir), "capture": stats, "payload": payload,
               "carry_bytes": ctx.cfg.capture.carry_bytes,
               "measuring_device": measuring_device(coord.memory, str(ctx.cfg.device)),
               # the sandbox ranks an exact trace is for (it stores only what they consume)
               "payload_ranks": sorted(set(ctx.cfg.sandbox.ranks)) if payload == "exact" else None},
    )
    what = f"{len(ranks)} of {ws} logical ranks (folded)" if fold.folded else f"{ws} logical ranks"
    stored = (f" ({tensors['stored_bytes'] / 2**20:.1f} MiB stored, identical ones once)"
              if tensors["logical_bytes"] else "")
    print(f"prism-launch: captured {what}, payload {payload}, {coord.ops_completed} ops, {len(coord.events)} events, "
          f"{tensors['logical_bytes'] / 2**20:.1f} MiB of tensors{stored} in {wall:.1f}s "
          f"({slots or 'unlimited'} slots, {sched.switches} resumes) -> {ctx.trace.root}", file=sys.stderr)
    return log_dir
