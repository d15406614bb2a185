"""What a CUDA stream waiting on a flag (``capture.gpu_waits``, :mod:`nccl_ext.exchange.device_flags`)
survives: each case runs in a process of its own under a deadline. The program's stream waits
for a flag, then the case's call X runs, then the fold's stream writes the flag — on the same
thread after X ("queuer": X must not wait for the device) or from another thread 1 s after X
began ("main": X may wait for the device, but must not keep the other thread from queuing).

    source .mlm/activate.sh && python bench/gpu_waits_probe.py [--lazy] [--cases none,first_mm,...]

Prints one line per case and side: how long X took, or HUNG. ``--lazy`` keeps the driver's lazy
kernel loading (the captured ranks' context loads every kernel up front). Exits non-zero where a
case hung or failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("none", "first_kernel", "first_mm", "host_register", "host_unregister", "malloc", "empty_cache",
         "pinned_alloc", "ipc_event", "event_record", "new_stream_mm", "item", "h2d_blocking", "d2h_nonblocking")
WAITING = {"item", "h2d_blocking"}
"""Calls that wait for the device (for the program's stream: on the "main" side only)."""
DEADLINE_S = 30.0
"""Seconds a case's call X and the flag's write get, counted once the process is set up."""
SETUP_S = 300.0
"""Seconds a case's process gets to make its context (every kernel loaded up front: 13 s alone on
the H200, longer with many cases at once) and reach the wait."""


def _call(case: str, x):
    """The case's call X (and what it needs made before the wait)."""
    import ctypes

    import torch

    cudart = torch.cuda.cudart()
    keep: dict = {}
    if case in ("host_register", "host_unregister"):
        m = keep["m"] = mmap.mmap(-1, 64 << 20)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if case == "host_unregister":
            assert int(cudart.cudaHostRegister(ptr, 64 << 20, 1)) == 0
            return lambda: cudart.cudaHostUnregister(ptr), keep
        return lambda: cudart.cudaHostRegister(ptr, 64 << 20, 1), keep
    if case == "malloc":
        return lambda: keep.setdefault("a", torch.empty(1 << 30, dtype=torch.uint8, device="cuda")), keep
    if case == "empty_cache":
        torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # freed at once: a cached block to release
        return torch.cuda.empty_cache, keep
    if case == "pinned_alloc":
        return lambda: keep.setdefault("p", torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)), keep
    if case == "ipc_event":
        return lambda: torch.cuda.Event(interprocess=True).ipc_handle(), keep
    if case == "event_record":
        ev = torch.cuda.Event(interprocess=True)
        return lambda: ev.record(), keep
    if case == "new_stream_mm":
        s2 = torch.cuda.Stream()

        def mm():
            with torch.cuda.stream(s2):
                keep["z"] = x @ x
        return mm, keep
    if case == "item":  # a host read of a value the program's stream computes after the wait
        return lambda: keep.setdefault("v", x[0, 0].item()), keep
    if case == "h2d_blocking":  # a tensor from a Python list: a copy the host waits for
        return lambda: keep.setdefault("t", torch.tensor(list(range(1024)), device="cuda")), keep
    if case == "d2h_nonblocking":  # a copy into the caching host allocator's pinned memory
        return lambda: keep.setdefault("h", x.to("cpu", non_blocking=True)), keep
    if case == "first_mm":
        return lambda: keep.setdefault("z", x @ x), keep
    if case == "first_kernel":
        return lambda: keep.setdefault("z", torch.special.erfcx(x)), keep
    return (lambda: None), keep


def child(case: str, side: str, lazy: bool) -> None:
    import torch

    from nccl_ext.exchange import device_flags

    if not lazy:
        device_flags.prepare_context()
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    device_flags.restore_context()
    fold = torch.cuda.Stream()
    flags = device_flags.self_test(torch.device("cuda", 0), fold)
    program = torch.cuda.current_stream()
    x = torch.randn(1024, 1024, device="cuda")
    if case != "first_mm":
        x @ x  # cuBLAS's handle and kernels exist before the wait
    call, _keep = _call(case, x)
    torch.cuda.synchronize()
    print("ready", flush=True)
    flags.wait(program, 5)
    x.add_(1)  # queued behind the wait

    def signal():
        with torch.cuda.stream(fold):
            flags.signal(fold, 5)

    t0 = time.monotonic()
    if side == "main":
        threading.Timer(1.0, signal).start()
    call()
    took = time.monotonic() - t0
    if side == "queuer":
        signal()
    torch.cuda.synchronize()
    print(f"{took:.3f}", flush=True)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--lazy", action="store_true", help="keep the driver's lazy kernel loading")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once, each in a process of its own")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.lazy)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def one(case_side: tuple[str, str]) -> tuple[bool, str]:
        case, side = case_side
        cmd = [sys.executable, __file__, "--child", case, side, *(["--lazy"] if a.lazy else [])]
        errs = tempfile.TemporaryFile("w+")  # read after the end: a full pipe would stop the case
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errs, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        got, limit = [], SETUP_S  # the set-up's deadline, then the case's own from "ready"
        try:
            while True:
                line = lines.get(timeout=limit)
                if line is None:
                    break
                got.append(line)
                if line == "ready":
                    limit = DEADLINE_S
        except queue.Empty:
            proc.kill()
            proc.wait()
            what = f"no end within {DEADLINE_S:g} s of its wait" if "ready" in got else f"not set up within {SETUP_S:g} s"
            return False, f"{case:16s} {side:7s} HUNG ({what})"
        rc = proc.wait()
        errs.seek(0)
        err = errs.read()
        ok = rc == 0 and len(got) > 1
        said = f"X took {got[-1]} s" if ok else \
            f"failed (exit {rc}): {(err.strip().splitlines() or ['?'])[-1][:120]}"
        return ok, f"{case:16s} {side:7s} {said}"

    todo = [(case, side) for case in a.cases.split(",") for side in ("queuer", "main")
            if not (side == "queuer" and case in WAITING)]  # there it waits for itself, by design
    bad = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for ok, line in pool.map(one, todo):
            bad += not ok
            print(line, flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
