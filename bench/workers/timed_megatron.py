"""The bundled Megatron recipe, unchanged, with ``initialize_model_parallel`` timed and this
process's memory recorded (for ``bench/scale.py``).

    python bench/workers/timed_megatron.py --bench-out DIR [recipe args]

Writes ``DIR/rank<R>.json``: init_s (``init_process_group`` through ``initialize_model_parallel``),
model_parallel_s (``initialize_model_parallel`` alone), new_group calls, VmRSS before/after init
and VmHWM at exit.
"""

import json
import os
import sys
import time
from pathlib import Path


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


argv = sys.argv[1:]
out = None
if "--bench-out" in argv:
    i = argv.index("--bench-out")
    out = Path(argv[i + 1])
    del argv[i : i + 2]
info: dict = {"rank": int(os.environ.get("RANK", 0)), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
              "rss_start_mb": _status_mb("VmRSS")}

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

_init = parallel_state.initialize_model_parallel
_init_pg = dist.init_process_group  # prism-launch's, installed before the script runs
_started: list[float] = []


def timed_init_process_group(*a, **k):
    info["rss_before_init_mb"] = _status_mb("VmRSS")
    _started.append(time.perf_counter())
    return _init_pg(*a, **k)


def timed_init(*a, **k):
    info.setdefault("rss_before_init_mb", _status_mb("VmRSS"))
    t0 = time.perf_counter()
    result = _init(*a, **k)
    t1 = time.perf_counter()
    info["model_parallel_s"] = t1 - t0
    info["init_s"] = t1 - (_started[0] if _started else t0)
    info["rss_after_init_mb"] = _status_mb("VmRSS")
    try:
        from nccl_ext.frontend import install

        world = install.current_world()
        if world is not None:
            info["new_group_calls"] = world.registry.created
            info["groups_materialised"] = world.registry.materialised
    except ImportError:
        pass
    return result


parallel_state.initialize_model_parallel = timed_init
dist.init_process_group = timed_init_process_group


def _write() -> None:
    info["hwm_mb"] = _status_mb("VmHWM")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{info['rank']}.json").write_text(json.dumps(info))


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import megatron_gpt  # noqa: E402

try:
    megatron_gpt.main(argv)
finally:
    _write()
