"""How fast the capture's trace writer takes tensors: ``--mib`` of distinct float tensors of
``--each-mib`` handed to :class:`~prism_launch.capture.sink.BackgroundSink` in front of a
:class:`~prism_launch.trace.TraceWriter` (content addresses, spill files, their sums), as the
coordinator hands them over. Prints MB/s, the seconds the handing side waited for room, and
the same with the addresses taken on the writer's thread alone (``ADDRESS_THREADS=1``).

    python bench/writer_throughput.py [--mib 1024] [--each-mib 16] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import prism_launch.capture.sink as sink_mod  # noqa: E402
from prism_launch.trace import TraceWriter  # noqa: E402


def run(mib: int, each_mib: int, where: str, threads: int) -> tuple[float, float]:
    sink_mod.ADDRESS_THREADS = threads
    n = max(1, mib // each_mib)
    tensors = [torch.randn(each_mib << 18) for _ in range(n)]  # float32: each_mib MiB
    d = Path(tempfile.mkdtemp(dir=where, prefix="prism-writer-bench-"))
    try:
        with TraceWriter(d / "t") as w:
            sink = sink_mod.BackgroundSink(w)
            t0 = time.perf_counter()
            for i, t in enumerate(tensors):
                sink.record_tensor(0, f"k{i}", t)
            sink.close()
            dt = time.perf_counter() - t0
            w.add_events([{"rank": 0, "idx": 0, "unit": 0, "kind": "marker", "op": "step", "group": -1, "seq": -1,
                           "peer": -1, "t_start": 0.0, "t_end": 0.0}])
            w.commit(fingerprint={"f": "1"}, versions={}, world_size=1, topology={}, groups=[], ranks_captured=[0])
        return n * each_mib * (1 << 20) / dt / 1e6, sink.waited_s
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--each-mib", type=int, default=16)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    default = sink_mod.ADDRESS_THREADS
    for threads in (1, default):
        mbs, waited = run(a.mib, a.each_mib, a.dir, threads)
        print(f"address threads {threads}: {a.mib} MiB in {a.each_mib} MiB tensors -> {mbs:.0f} MB/s "
              f"(the handing side waited {waited:.2f} s for room)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
