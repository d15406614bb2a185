"""Context-switched capture cost on this machine: the bundled Megatron recipe (TP2·PP2, every
rank captured, no folding) at N = 8, 16, 32, 64 logical ranks with ``capture.slots`` ranks
computing at once.

    python bench/capture_scale.py [--sizes 8,16,32,64] [--slots 2] [--check 64]

Prints per N: capture wall time, context switches (resumes), peak host memory of the whole
process tree (launcher + ranks, summed PSS sampled every 0.2 s) and the trace's size.
``--check N`` also captures N ranks with no slot limit and verifies every rank's logged
values (loss, grad norm, parameter checksum) are bit-identical to the context-switched run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
ARGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--log-all-ranks"]
_NUM = re.compile(r"(loss|grad_norm|param_checksum) (\S+)")


def _tree_pss_mb(root: int) -> float:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def capture(n: int, slots: int, work: Path) -> dict:
    out = work / f"n{n}-s{slots}"
    cmd = [sys.executable, "-m", "prism_launch", "--nproc-per-node", str(n), "-r", "3", "--log-dir", str(out / "logs"),
           "device=cpu", "mode=capture", "capture.fold=false", f"capture.slots={slots}", "comm.timeout_s=1800",
           f"trace.dir={out / 'trace'}", str(RECIPE), *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _tree_pss_mb(p.pid))

    threading.Thread(target=sample, daemon=True).start()
    _, err = p.communicate(timeout=7200)
    done.set()
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"capture of {n} ranks failed:\n{err[-3000:]}")
    stats = json.loads((out / "trace" / "capture.json").read_text())
    size = sum(f.stat().st_size for f in (out / "trace").rglob("*") if f.is_file())
    return {"n": n, "slots": slots, "wall_s": wall, "capture_s": stats["wall_s"], "resumes": stats["resumes"],
            "max_running": stats["max_running"], "peak_mb": peak[0], "trace_mb": size / 2**20, "dir": out}


def values(run: dict, rank: int) -> list:
    [d] = [p for p in (run["dir"] / "logs").iterdir() if p.is_dir()]
    text = (d / str(rank) / "stdout.log").read_text()
    return [tuple(_NUM.findall(line)) for line in text.splitlines() if _NUM.search(line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--check", type=int, default=64, help="N to verify against an unthrottled capture (0: skip)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prism-capture-scale-"))
    rows = []
    for n in [int(x) for x in a.sizes.split(",")]:
        rows.append(capture(n, a.slots, work))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "dir"}), flush=True)
    print(f"\n{'N':>4}{'slots':>6}{'capture s':>10}{'total s':>9}{'resumes':>9}{'max running':>12}"
          f"{'peak host MB':>13}{'trace MB':>9}")
    for r in rows:
        print(f"{r['n']:>4}{r['slots']:>6}{r['capture_s']:>10.1f}{r['wall_s']:>9.1f}{r['resumes']:>9}"
              f"{r['max_running']:>12}{r['peak_mb']:>13.0f}{r['trace_mb']:>9.1f}")
    if a.check:
        throttled = next((r for r in rows if r["n"] == a.check), None) or capture(a.check, a.slots, work)
        free = capture(a.check, 0, work)
        same = all(values(throttled, r) == values(free, r) and values(free, r) for r in range(a.check))
        print(f"\nN={a.check}: slots={a.slots} ({throttled['capture_s']:.1f}s) vs unlimited "
              f"({free['capture_s']:.1f}s, peak {free['peak_mb']:.0f} MB): every rank's logged values "
              f"{'bit-identical' if same else 'DIFFER'}")
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
