"""The bundled Megatron recipe, unchanged, with ``initialize_model_parallel`` timed and this
process's memory recorded (for ``bench/scale.py``).

    python bench/workers/timed_megatron.py --bench-out DIR [recipe args]

Writes ``DIR/rank<R>.json``: init_s, new_group calls, VmRSS before/after init and VmHWM at exit.
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

from megatron.core import parallel_state  # noqa: E402

_init = parallel_state.initialize_model_parallel


def timed_init(*a, **k):
    info["rss_before_init_mb"] = _status_mb("VmRSS")
    t0 = time.perf_counter()
    result = _init(*a, **k)
    info["init_s"] = time.perf_counter() - t0
    info["rss_after_init_mb"] = _status_mb("VmRSS")
    try:
        from nccl_ext import install

        world = install.current_world()
        if world is not None:
            info["new_group_calls"] = world.registry.created
            info["groups_materialised"] = world.registry.materialised
    except ImportError:
        pass
    return result


parallel_state.initialize_model_parallel = timed_init


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
