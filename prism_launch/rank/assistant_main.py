"""Entry point of the assistant process of an emulation run: ``python -m prism_launch.rank.assistant_main``
(started by the launcher, or called by a forked child), the physical process that hosts the
virtual ranks and serves their recorded data to the sandbox ranks."""

from __future__ import annotations

import json
import os
import sys
import time

from nccl_ext.core.atomic import atomic_write_text
from prism_launch.config.plan import RankPlan


def main() -> int:
    from nccl_ext.replay.assistant import serve
    from prism_launch.rank.replay_source import TraceRecording
    from prism_launch.rank.transports import outlive_interpreter, physical_group, ring_channels
    from prism_launch.trace import TraceReader

    from prism_launch.launch import heartbeat

    heartbeat.start()  # the launcher tells a stopped assistant by it
    plan = RankPlan.from_env()
    e = plan.emulate
    sandbox = e.sandbox
    recording = TraceRecording(TraceReader(e.trace_dir, verify=False))
    if e.pruned and e.ring_backend == "nccl":
        _take_gpu(plan.device_slot(None))
    physical, store = physical_group(plan, len(sandbox), len(sandbox) + 1, plan.timeout_s)
    rings = ring_channels(plan, len(sandbox), store, plan.timeout_s) if e.pruned else None
    outlive_interpreter(physical, store, rings)
    t0 = time.monotonic()
    stats = serve(recording, sandbox, physical, store, window=e.window, device_path=e.data_path == "device",
                  pruned=e.pruned, rings=rings, timeout_s=plan.timeout_s)
    summary = {
        "wall_s": time.monotonic() - t0,
        "ring_ops": stats.ring_ops,
        "ring_groups": rings.created if rings is not None else 0,
        "streams": {str(r): {"messages": s.messages, "bytes": s.bytes, "stalled_s": s.stalled_s}
                    for r, s in stats.streams.items()},
    }
    if e.assistant_summary:
        atomic_write_text(e.assistant_summary, json.dumps(summary, indent=1))
    return 0


def _take_gpu(slot: int) -> None:
    """The assistant's own GPU for NCCL rings: the one after the sandbox ranks' on this node."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if slot >= n:
        raise RuntimeError(
            f"emulate.ring_backend=nccl: the assistant needs a GPU of its own (GPU {slot}), but this node has "
            f"{n} and its sandbox ranks take {min(slot, n)}; use emulate.ring_backend=gloo or fewer sandbox ranks "
            "on this node")
    torch.cuda.set_device(slot)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    code = 1
    try:
        code = record(main)()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported here: os._exit below would swallow it
        import traceback

        traceback.print_exc()
    finally:
        # End like a forked rank does (os._exit, no interpreter teardown): the sandbox ranks
        # close their connections as they exit, and gloo's and the store's C++ threads torn
        # down in static destruction under a closing connection can abort a process whose
        # work is done ("terminate called without an active exception", SIGABRT).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
