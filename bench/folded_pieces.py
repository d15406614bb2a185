"""What a folded all-gather's result costs the coordinator's thread (runs on the CPU).

    python bench/folded_pieces.py [--members 1024] [--captured 4] [--rounds 8]

Megatron's timers all-gather on ``default_pg`` in a 1,024-rank folded capture returns 1,024
small pieces, each one of the captured ranks' contributions again. The coordinator hands a
sandbox rank's result to the trace writer (:class:`~prism_launch.capture.sink.BackgroundSink`)
and sends it back (:func:`nccl_ext.core.wire.send`). This bench times both on the handing thread,
per piece (``record_tensor`` per piece; each piece its own send) and as the coordinator does it
now (one ``record_tensors``; one ``wire.send``, whose repeated pieces travel once), while
another Python thread keeps the interpreter busy as the coordinator's helpers do. Prints the
median and the worst of ``--rounds`` for each.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nccl_ext import wire  # noqa: E402
from nccl_ext.core.ops import Collective, compute  # noqa: E402
from prism_launch.capture.sink import BackgroundSink  # noqa: E402
from prism_launch.trace import TraceWriter  # noqa: E402


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _drain(conn) -> None:
    while True:
        try:
            wire.recv(conn)
        except (EOFError, OSError):
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=1024)
    ap.add_argument("--captured", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    stand_ins = [torch.randn(12) for _ in range(a.captured)]  # a dozen timers each
    result = compute(Collective.ALL_GATHER, [[stand_ins[m % a.captured]] for m in range(a.members)])[-1]
    work = Path(tempfile.mkdtemp(prefix="prism-folded-pieces-"))
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    out, into = Pipe()
    threading.Thread(target=_drain, args=(into,), daemon=True).start()
    times: dict[str, list[float]] = {"record per piece": [], "record as one": [], "send per piece": [], "send as one": []}
    try:
        writer = TraceWriter(work / "trace")
        sink = BackgroundSink(writer)
        busy.start()
        for r in range(a.rounds):
            keys = [f"r/1/{r}/{i}" for i in range(len(result))]
            t0 = time.perf_counter()
            for key, t in zip(keys, result):
                sink.record_tensor(0, key, t)
            times["record per piece"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sink.record_tensors(1, keys, result)
            times["record as one"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for t in result:
                wire.send(out, ("ok", r), [t])
            times["send per piece"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            wire.send(out, ("ok", r), result)
            times["send as one"].append(time.perf_counter() - t0)
        sink.close()
    finally:
        stop.set()
        out.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{a.members}-member folded all-gather, {a.captured} captured ranks, {a.rounds} rounds, one busy Python thread:")
    for what, xs in times.items():
        print(f"  {what:17s} median {1e3 * statistics.median(xs):7.2f} ms, worst {1e3 * max(xs):7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
