"""Per-rank entry point: ``python -m prism_launch.rank.bootstrap [-m] SCRIPT [ARGS]``.

It loads the rank plan the launcher handed this process (:mod:`prism_launch.config.plan`;
next to torchrun's ``RANK``, ``WORLD_SIZE`` …), activates what this rank needs — the CPU
compatibility layers, the prism process group behind the script's own
``init_process_group`` (capture and emulation), the scheduling-unit marker, memory
accounting — and then runs the script unchanged, as ``python SCRIPT`` or ``python -m
MODULE`` would. Forked ranks call :func:`run` directly; spawned ranks come through
:func:`main`; ``--no-python`` ranks through ``_hook/sitecustomize.py``.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from pathlib import Path

from prism_launch.config.plan import RankPlan
from prism_launch.rank import transports
from prism_launch.trace.layout import RankLogs

_TRACKER: list = []
_FLOPS: list = []  # a capture rank's StepFlops (prism_launch.rank.flops)
_KERNELS: list = []  # a calibration slice rank's StepKernels (prism_launch.rank.kernels)


def logical_rank() -> tuple[int, int]:
    """This process's logical rank and world size, from torchrun's own variables."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _start_memory(plan: RankPlan):
    """Allocator-level memory accounting for this rank (and the target's cap when asked)."""
    if not plan.memory_track:
        return None
    from prism_launch.rank.memory import MemoryTracker, configure_cpu_hook, set_memory_limit

    configure_cpu_hook(enabled=plan.memory_cpu_hook, cache_dir=plan.memory_cache_dir)
    tracker = MemoryTracker(plan.device)
    tracker.start()
    if plan.memory_limit_bytes > 0:
        set_memory_limit(plan.device, plan.memory_limit_bytes)
    _TRACKER.append(tracker)
    return tracker


def _finish_memory() -> None:
    from nccl_ext.frontend import install

    world = install.current_world()
    summary = None
    if _TRACKER and world is not None:
        tracker = _TRACKER.pop()
        tracker.stop()
        summary = tracker.summary()
    if _FLOPS and world is not None:  # the rank's summary carries its counted step and its device
        from prism_launch.rank.flops import device_info

        flops, device = _FLOPS.pop()
        summary = {**(summary or {}), "model_flops": flops.summary(), "device": device_info(device)}
    if _KERNELS and world is not None:
        summary = {**(summary or {}), "kernels": _KERNELS.pop().summary()}
    if summary is not None:
        world.transport.report_memory(summary)


def finish() -> None:
    """End a capture or emulation rank whose program returned: its memory figures into its
    summary, then its transport closed — the transport's threads joined while Python can still
    run them (``nccl_ext/core/threads.py``)."""
    from nccl_ext.frontend import install

    try:
        _finish_memory()
    finally:
        install.close()


def _write_real_memory(plan: RankPlan, rank: int) -> None:
    if plan.mode != "real" or not _TRACKER or plan.memory_dir is None:
        return
    path = RankLogs(plan.memory_dir).memory(rank)
    import json

    from nccl_ext.core.atomic import atomic_write_text

    tracker = _TRACKER.pop()
    tracker.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(tracker.summary()))


def activate(plan: RankPlan) -> None:
    """Prepare this process to be its logical rank; idempotent per process."""
    import torch

    rank, world_size = logical_rank()
    if plan.mode in ("capture", "emulate"):  # the launcher tells a stopped rank by it
        from prism_launch.launch import heartbeat

        heartbeat.start()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    compat = [importlib.import_module(name) for name in plan.compat]
    cp = plan.capture
    if (plan.device == "cuda" and plan.mode == "capture" and cp is not None and not cp.discover_file
            and cp.gpu_waits and cp.gpu_exchange_bytes > 0):
        from nccl_ext.exchange import device_flags

        device_flags.prepare_context()  # before the CUDA context: waits on the GPU need a queue of their own
    if plan.device == "cuda" and plan.mode != "real":
        from prism_launch.launch import devices

        # the TorchFunctionMode that maps explicit ``cuda:N`` in torch calls costs Python on every
        # torch call: only for recipes whose integration says they name devices so (DeepSpeed's)
        explicit = any(getattr(m, "EXPLICIT_CUDA_INDICES", False) for m in compat)
        devices.install(plan.device_slot(rank), mode=None if explicit else False)
    for module in compat:
        module.install()
    if plan.mode == "real":
        tracker = _start_memory(plan) if plan.memory_dir else None
        if tracker is not None:
            from nccl_ext.frontend import install

            install.install_step_marker(lambda: tracker.mark_unit(len(tracker.samples)))
    if plan.mode in ("capture", "emulate"):
        from nccl_ext.frontend import install

        if plan.capture is not None and plan.capture.discover_file:
            make = transports.discover(plan)
        else:
            make = transports.capture(plan) if plan.mode == "capture" else transports.replay(plan)
        kernels = None
        if plan.emulate is not None and plan.emulate.kernel_profile:
            from prism_launch.rank.kernels import StepKernels

            kernels = StepKernels(plan.device)
            _KERNELS.append(kernels)
            make = _profiled(make, kernels)
        install.install(rank=rank, world_size=world_size, make_transport=make, timeout_s=plan.timeout_s,
                        subgroups=plan.subgroups,
                        restrict_objects=plan.emulate is not None and not plan.emulate.trusted_objects)
        tracker = _start_memory(plan)
        flops = None
        if plan.mode == "capture" and not (plan.capture is not None and plan.capture.discover_file):
            from prism_launch.rank.flops import StepFlops

            flops = StepFlops()
            _FLOPS.append((flops, plan.device))
            for name in plan.probes:
                importlib.import_module(name).install()

        def on_step() -> None:
            if flops is not None:
                flops.on_step()
            if kernels is not None:
                kernels.on_step()
            world = install.current_world()
            if world is not None and world.step_boundary() and tracker is not None:
                tracker.mark_unit(len(tracker.samples))

        install.install_step_marker(on_step)


def _profiled(make, kernels):
    """``make`` (the transport factory), starting ``kernels``' profiler once the process group
    exists: by then the program has picked its device."""

    def make_and_profile(*args, **kwargs):
        transport = make(*args, **kwargs)
        kernels.start()
        return transport

    return make_and_profile


def run(script: str, args: list[str], *, module: bool = False) -> int:
    """Activate from the rank plan and run ``script`` as ``__main__``; returns the exit code."""
    plan = RankPlan.from_env()
    activate(plan)
    rank, _ = logical_rank()
    if plan.local_rank_arg:  # as the deepspeed launcher passes it
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
        _write_real_memory(plan, rank)
        if plan.mode in ("capture", "emulate"):
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


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
