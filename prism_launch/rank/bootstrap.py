"""Per-rank entry point: ``python -m prism_launch.rank.bootstrap [-m] SCRIPT [ARGS]``.

It reads the ``PRISM_*`` variables the launcher set (next to torchrun's ``RANK``,
``WORLD_SIZE`` …), activates what this rank needs — the CPU compatibility layer named
by the config, the prism process group behind the script's own ``init_process_group``
(capture and emulation), the scheduling-unit marker — and then runs the script
unchanged, as ``python SCRIPT`` or ``python -m MODULE`` would. Forked ranks call
:func:`run` directly; spawned ranks come through :func:`main`.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class RankContext:
    """What the launcher told this rank through the environment."""

    mode: str
    rank: int
    world_size: int
    device: str
    compat: tuple[str, ...]
    timeout_s: float

    @classmethod
    def from_env(cls) -> RankContext:
        env = os.environ
        return cls(
            mode=env.get("PRISM_MODE", "real"),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            device=env.get("PRISM_DEVICE", "cpu"),
            compat=tuple(m for m in env.get("PRISM_COMPAT", "").split(",") if m),
            timeout_s=float(env.get("PRISM_TIMEOUT_S", "300")),
        )


def _capture_transport(ctx: RankContext):
    from nccl_ext.capture_transport import CaptureTransport

    def make(rank: int, world_size: int, timeout_s: float):
        return CaptureTransport(os.environ["PRISM_COORD"], bytes.fromhex(os.environ["PRISM_AUTHKEY"]), rank, timeout_s)

    return make


def _discover_transport(ctx: RankContext):
    from nccl_ext.discover import DiscoverTransport

    def make(rank: int, world_size: int, timeout_s: float):
        return DiscoverTransport(os.environ["PRISM_DISCOVER"])

    return make


def physical_group(rank: int, size: int, timeout_s: float):
    """The gloo group of the emulation's physical processes (sandbox ranks, then the assistant)."""
    if size < 2:
        return None, None
    import datetime

    import torch.distributed as dist

    host, port = os.environ["PRISM_STORE"].rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("prism/physical", store), rank, size, timeout), store


def ring_channels(me: int, store, timeout_s: float):
    """The pruned rings' communicators of physical rank ``me`` (``PRISM_RING_BACKEND``: gloo,
    or nccl on this process's current GPU; ``PRISM_RING_TAGS=0``: messages matched by order)."""
    from nccl_ext.pruning import RingChannels, group_factory

    backend = os.environ.get("PRISM_RING_BACKEND", "gloo")
    device = None
    if backend == "nccl":
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    return RingChannels(group_factory(store, me, backend, timeout_s), tags=os.environ.get("PRISM_RING_TAGS", "1") == "1",
                        device=device)


def outlive_interpreter(*objs) -> None:
    """Keep c10d objects (the physical group, its store, the ring groups) alive past interpreter
    teardown: the process's exit releases them, so no c10d destructor (which waits on the
    group's queued work and joins its threads) runs while Python finalizes, as the other
    physical processes close their connections. (The aborts at exit once blamed on these
    objects came from the transport's own threads: ``nccl_ext/helpers.py``.)"""
    import ctypes

    for o in objs:
        if o is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


def _replay_transport(ctx: RankContext):
    from nccl_ext.replay_transport import ReplayTransport
    from prism_launch.rank.replay_source import TraceRecording
    from prism_launch.trace import TraceReader

    def make(rank: int, world_size: int, timeout_s: float):
        env = os.environ
        sandbox = tuple(int(r) for r in env["PRISM_SANDBOX"].split(","))
        assistant = env.get("PRISM_ASSISTANT") == "1"
        physical, store = physical_group(sandbox.index(rank), len(sandbox) + assistant, timeout_s)

        def on_close() -> None:
            if assistant:
                from nccl_ext.assistant import done_key

                store.set(done_key(rank), "1")
        reader = TraceReader(env["PRISM_TRACE_DIR"], verify=False)  # verified once by the launcher
        schedule = None
        if env.get("PRISM_SCHEDULE"):
            import json

            schedule = {int(r): v for r, v in json.loads(Path(env["PRISM_SCHEDULE"]).read_text()).items()}
        recording = TraceRecording(reader, schedule)
        device_path = None
        if env.get("PRISM_DATA_PATH") == "device":
            from nccl_ext.device_path import DevicePath

            device_path = DevicePath(
                rank=rank, sandbox=sandbox, recording=recording, mode=env.get("PRISM_PREFETCH", "stream"),
                pool_bytes=int(env.get("PRISM_POOL_MIB", "512")) << 20, check=env.get("PRISM_CHECK", "1") == "1",
                timeout_s=timeout_s, device_kind="cuda" if str(ctx.device).startswith("cuda") else "cpu",
                workers=int(env.get("PRISM_PREFETCH_THREADS", "4")),
                host_tier_bytes=int(env.get("PRISM_HOST_TIER_BYTES", str(16 << 30))),
                grow=env.get("PRISM_POOL_GROW", "0") == "1", expected_peak=_captured_peak(reader, rank),
                reserve_bytes=int(env.get("PRISM_POOL_RESERVE_BYTES", str(4 << 30))), share=_gpu_sharers(env))
            device_path.prepare()  # plan and fill the host tier while the program builds its model
        rings = None
        if env.get("PRISM_PRUNED") == "1" and store is not None:
            from nccl_ext.pruning import ring_plan

            me = sandbox.index(rank)
            rings = ring_channels(me, store, timeout_s)
            rings.open(ring_plan(recording, sandbox, me, len(sandbox) if assistant else None))
        outlive_interpreter(physical, store, rings)
        return ReplayTransport(
            rank=rank, sandbox=sandbox, recording=recording, timeout_s=timeout_s, device_path=device_path,
            pruned=env.get("PRISM_PRUNED") == "1", rings=rings,
            physical=physical, assistant=len(sandbox) if assistant else None, on_close=on_close, timing=env.get("PRISM_TIMING", "predicted"),
            time_scale=float(env.get("PRISM_TIME_SCALE", "1")), strict=env.get("PRISM_STRICT") == "1",
            check=env.get("PRISM_CHECK", "1") == "1",
            summary_path=Path(env["PRISM_SUMMARY"]) if env.get("PRISM_SUMMARY") else None,
        )

    return make


_TRACKER: list = []


def _start_memory(ctx: RankContext):
    """Allocator-level memory accounting for this rank (and the target's cap when asked)."""
    if os.environ.get("PRISM_MEMORY", "1") != "1":
        return None
    from prism_launch.rank.memory import MemoryTracker, set_memory_limit

    tracker = MemoryTracker(ctx.device)
    tracker.start()
    limit = int(os.environ.get("PRISM_MEMORY_LIMIT", "0"))
    if limit > 0:
        set_memory_limit(ctx.device, limit)
    _TRACKER.append(tracker)
    return tracker


def _finish_memory() -> None:
    from nccl_ext import install

    world = install.current_world()
    if _TRACKER and world is not None:
        tracker = _TRACKER.pop()
        tracker.stop()
        world.transport.report_memory(tracker.summary())


def finish() -> None:
    """End a capture or emulation rank whose program returned: its memory figures into its
    summary, then its transport closed — the transport's threads joined while Python can still
    run them (``nccl_ext/helpers.py``)."""
    from nccl_ext import install

    try:
        _finish_memory()
    finally:
        install.close()


def activate(ctx: RankContext) -> None:
    """Prepare this process to be logical rank ``ctx.rank``; idempotent per process."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    if ctx.device == "cuda" and ctx.mode != "real":
        from prism_launch.launch import devices

        devices.install()
    if ctx.device == "cpu":
        for name in ctx.compat:
            importlib.import_module(name).install()
    if ctx.mode == "real":
        tracker = _start_memory(ctx) if os.environ.get("PRISM_MEMORY_OUT") else None
        if tracker is not None:
            from nccl_ext import install

            install.install_step_marker(lambda: tracker.mark_unit(len(tracker.samples)))
    if ctx.mode in ("capture", "emulate"):
        from nccl_ext import install

        if os.environ.get("PRISM_DISCOVER"):
            make = _discover_transport(ctx)
        else:
            make = _capture_transport(ctx) if ctx.mode == "capture" else _replay_transport(ctx)
        install.install(rank=ctx.rank, world_size=ctx.world_size, make_transport=make, timeout_s=ctx.timeout_s)
        tracker = _start_memory(ctx)

        def on_step() -> None:
            world = install.current_world()
            if world is not None and world.step_boundary() and tracker is not None:
                tracker.mark_unit(len(tracker.samples))

        install.install_step_marker(on_step)


def run(script: str, args: list[str], *, module: bool = False) -> int:
    """Activate from the environment and run ``script`` as ``__main__``; returns the exit code."""
    ctx = RankContext.from_env()
    activate(ctx)
    if os.environ.get("PRISM_LOCAL_RANK_ARG") == "1":  # as the deepspeed launcher passes it
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    sys.argv = [script, *args]
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(script).resolve().parent))
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        if ctx.mode == "real" and _TRACKER and os.environ.get("PRISM_MEMORY_OUT"):
            import json

            tracker = _TRACKER.pop()
            tracker.stop()
            from nccl_ext.atomic import atomic_write_text

            atomic_write_text(os.environ["PRISM_MEMORY_OUT"], json.dumps(tracker.summary()))
        if ctx.mode in ("capture", "emulate"):
            finish()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = False
    if argv and argv[0] in ("-m", "--module"):
        module = True
        argv = argv[1:]
    if not argv:
        print("usage: python -m prism_launch.rank.bootstrap [-m] SCRIPT [ARGS]", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:], module=module)


def _gpu_sharers(env) -> int:
    """How many of this node's processes the launcher put on this process's GPU (slots are
    dealt round-robin over the GPUs present)."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return 1
    slot, slots = int(env.get("PRISM_DEVICE_SLOT", "0")), int(env.get("PRISM_DEVICE_SLOTS", "1"))
    return max(1, sum(1 for j in range(slots) if j % n == slot % n))


def _captured_peak(reader, rank: int) -> int | None:
    """The capture's peak memory of ``rank`` (the largest captured rank's when the rank was
    folded into another), or None when the trace has no memory record."""
    if "memory.json" not in reader.json_files():
        return None
    peaks = {int(r): m.get("peak_bytes") for r, m in reader.read_json("memory.json").items()}
    peaks = {r: p for r, p in peaks.items() if p is not None}
    if not peaks:
        return None
    return int(peaks.get(rank, max(peaks.values())))


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
