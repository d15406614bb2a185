"""Context-switched capture cost on this machine: the bundled Megatron recipe (TP2·PP2, every
rank captured, no folding) at N = 8, 16, 32, 64 logical ranks with ``capture.slots`` ranks
computing at once.

    python bench/capture_scale.py [--sizes 8,16,32,64] [--slots 2] [--check 64]

Prints per N: capture wall time, context switches (resumes), peak host memory of the whole
process tree (launcher + ranks, summed PSS sampled every 0.2 s) and the trace's size.
``--check N`` also captures N ranks with no slot limit and verifies every rank's logged
values (loss, grad norm, parameter checksum) are bit-identical to the context-switched run.
Exits 1 when a figure is missing, more ranks ran at once than ``--slots``, or the values differ.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import IS_TRUE, Figure, at_most, report  # noqa: E402

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
    peak: list[float | None] = [None]  # None until sampled: a capture too short to sample has no peak
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            now = _tree_pss_mb(p.pid)
            peak[0] = now if peak[0] is None else max(peak[0], now)

    threading.Thread(target=sample, daemon=True).start()
    _, err = p.communicate(timeout=7200)
    done.set()
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"capture of {n} ranks failed:\n{err[-3000:]}")
    stats = json.loads((out / "trace" / "capture.json").read_text())
    size = sum(f.stat().st_size for f in (out / "trace").rglob("*") if f.is_file())
    return {"n": n, "slots": slots, "wall_s": wall, "capture_s": stats.get("wall_s"), "resumes": stats.get("resumes"),
            "max_running": stats.get("max_running"), "peak_mb": peak[0], "trace_mb": size / 2**20, "dir": out}


def values(run: dict, rank: int) -> list:
    [d] = [p for p in (run["dir"] / "logs").iterdir() if p.is_dir()]
    text = (d / str(rank) / "stdout.log").read_text()
    return [tuple(_NUM.findall(line)) for line in text.splitlines() if _NUM.search(line)]


def _cell(v, width: int, fmt: str = "") -> str:
    return f"{'MISSING' if v is None else format(v, fmt):>{width}}"


def figures(rows: list[dict], same: bool | None = None, check: int = 0) -> list[Figure]:
    """Each row's figures (``max_running`` at most its slots when they limit it) and, with
    ``check``, whether every rank's values are bit-identical to the unthrottled capture."""
    out = []
    for r in rows:
        at = f"N={r['n']} slots={r['slots']}"
        out += [Figure(f"{at} capture s", r.get("capture_s"), fmt=".1f"),
                Figure(f"{at} total s", r.get("wall_s"), fmt=".1f"),
                Figure(f"{at} resumes", r.get("resumes")),
                Figure(f"{at} max running", r.get("max_running"), at_most(r["slots"]) if r["slots"] else None),
                Figure(f"{at} peak host MB", r.get("peak_mb"), fmt=".0f"),
                Figure(f"{at} trace MB", r.get("trace_mb"), fmt=".1f")]
    if check:
        out.append(Figure(f"N={check} every rank's logged values bit-identical", same, IS_TRUE))
    return out


def main() -> int:
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
        print(f"{r['n']:>4}{r['slots']:>6}{_cell(r['capture_s'], 10, '.1f')}{_cell(r['wall_s'], 9, '.1f')}"
              f"{_cell(r['resumes'], 9)}{_cell(r['max_running'], 12)}{_cell(r['peak_mb'], 13, '.0f')}"
              f"{_cell(r['trace_mb'], 9, '.1f')}")
    same = None
    if a.check:
        throttled = next((r for r in rows if r["n"] == a.check), None) or capture(a.check, a.slots, work)
        free = capture(a.check, 0, work)
        same = all(values(throttled, r) == values(free, r) and values(free, r) for r in range(a.check))
        print(f"\nN={a.check}: slots={a.slots} ({_cell(throttled['capture_s'], 0, '.1f')}s) vs unlimited "
              f"({_cell(free['capture_s'], 0, '.1f')}s, peak {_cell(free['peak_mb'], 0, '.0f')} MB): every rank's "
              f"logged values {'bit-identical' if same else 'DIFFER'}")
        rows = [*rows, free] if throttled in rows else [*rows, throttled, free]
    print(f"work dir: {work}")
    return report(figures(rows, same, a.check))


if __name__ == "__main__":
    sys.exit(main())
