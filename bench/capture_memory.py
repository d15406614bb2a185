"""The launcher's memory during a capture does not grow with the step count (runs on the CPU).

    python bench/capture_memory.py [--steps 4 32] [--margin 0.25] [--nproc 8] [--spill-mib 64]
                                   [--out DIR] [--keep]

Captures the bundled dense recipe (``examples/megatron_gpt.py``, TP2·PP2 over ``--nproc``
ranks) for each step count (its ``--train-iters``) with ``capture.payload=full`` and
``capture.payload=none``, and prints per case the launcher's peak resident memory (VmHWM,
``launcher_peak_rss_bytes`` in the trace's ``capture.json``), the bytes of tensors recorded
and stored, the most waiting in memory at once, the trace's size on disk and the capture's
seconds. Tensors are spilled to disk as they are recorded (``capture.spill_mib``), so only
the events (a few hundred bytes each) grow with the steps.

Exits 1 when a figure is missing, or when the exact capture's peak at the largest step count
is more than ``--margin`` (a fraction) above its peak at the smallest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import Figure, Goal, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
DENSE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def capture(out: Path, nproc: int, steps: int, payload: str, spill_mib: float) -> dict:
    d = out / f"{payload}-{steps}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "prism_launch", "--nproc-per-node", str(nproc), "-r", "3", "device=cpu",
           "comm.timeout_s=300", "--log-dir", str(d / "logs"), "mode=capture", f"trace.dir={d / 'trace'}",
           f"capture.payload={payload}", f"capture.spill_mib={spill_mib:g}", "launch.progress=false",
           str(RECIPE), *DENSE, "--train-iters", str(steps)]
    r = subprocess.run(cmd, cwd=d, capture_output=True, text=True, timeout=1800)
    row = {"payload": payload, "steps": steps}
    if r.returncode != 0:
        print(f"capture {payload} at {steps} steps failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
        return row
    stats = json.loads((d / "trace" / "capture.json").read_text())
    row.update(peak_rss=stats.get("launcher_peak_rss_bytes"), tensor_bytes=stats.get("tensor_bytes"),
               stored=stats.get("tensor_bytes_stored"), pending=stats.get("tensor_bytes_peak_pending"),
               trace_bytes=_size(d / "trace"), wall_s=stats.get("wall_s"))
    return row


COLUMNS = (("peak_rss", "peak RSS MiB"), ("tensor_bytes", "tensors MiB"), ("stored", "stored MiB"),
           ("pending", "waiting MiB"), ("trace_bytes", "trace MiB"))


def figures(rows: list[dict], margin: float) -> list[Figure]:
    """Every printed cell (MiB; the capture's seconds) and the full capture's peak RSS growth from
    the fewest to the most steps, which must stay within ``margin``."""
    out = []
    for r in rows:
        at = f"{r['payload']} {r['steps']} steps"
        out += [Figure(f"{at} {name}", None if r.get(k) is None else r[k] / 2**20, fmt=".1f") for k, name in COLUMNS]
        out.append(Figure(f"{at} capture s", r.get("wall_s"), fmt=".1f"))
    peaks = {r["steps"]: r.get("peak_rss") for r in rows if r["payload"] == "full"}
    lo, hi = (peaks.get(min(peaks)), peaks.get(max(peaks))) if peaks else (None, None)
    growth = None if not (lo and hi is not None) else hi / lo - 1
    out.append(Figure(f"full peak RSS growth {min(peaks, default='?')} -> {max(peaks, default='?')} steps", growth,
                      Goal(f"<= {margin:.0%}", lambda g: g <= margin), "+.1%"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[4, 32])
    p.add_argument("--margin", type=float, default=0.25,
                   help="allowed growth of the exact capture's peak from the fewest to the most steps")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--spill-mib", type=float, default=64.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the traces")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="prism-capture-memory-"))
    rows = [capture(out, a.nproc, s, payload, a.spill_mib) for payload in ("full", "none") for s in a.steps]
    figs = figures(rows, a.margin)
    f = {x.name: x.shown() for x in figs}
    print(f"dense TP2·PP2, {a.nproc} ranks, capture.spill_mib={a.spill_mib:g}")
    print(f"{'payload':8} {'steps':>5} {'peak RSS MiB':>12} {'tensors MiB':>11} {'stored MiB':>10} "
          f"{'waiting MiB':>11} {'trace MiB':>9} {'capture s':>9}")
    for r in rows:
        at = f"{r['payload']} {r['steps']} steps"
        print(f"{r['payload']:8} {r['steps']:>5} {f[at + ' peak RSS MiB']:>12} {f[at + ' tensors MiB']:>11} "
              f"{f[at + ' stored MiB']:>10} {f[at + ' waiting MiB']:>11} {f[at + ' trace MiB']:>9} "
              f"{f[at + ' capture s']:>9}")
    if not a.keep and a.out is None:
        shutil.rmtree(out, ignore_errors=True)
    growth = figs[-1]
    print(f"{'FAIL' if growth.missing or growth.missed else 'ok'}: exact peak RSS at {max(a.steps)} steps is "
          f"{growth.shown()} of the {min(a.steps)}-step peak (margin {a.margin:.0%})")
    return report(figs)


if __name__ == "__main__":
    sys.exit(main())
