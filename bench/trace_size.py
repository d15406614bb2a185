"""Trace size by payload policy on the bundled CPU example (runs on the CPU).

    python bench/trace_size.py [--nodes 2] [--steps 3] [--sandbox 11] [--no-fold] [--out DIR] [--keep]

Captures the bundled dense recipe (``examples/megatron_gpt.py``, TP2·PP2 over ``--nodes`` x 8
logical ranks, folded around ``--sandbox`` unless ``--no-fold``) with ``capture.payload=full``
(every captured rank's tensors), ``exact`` (only what the sandbox rank consumes) and ``none``,
and prints per policy the tensor bytes recorded, the trace's bytes on disk and the capture's
seconds, then the ratios exact/full and none/full. Exits 1 when a capture fails, a figure is
missing, or the exact trace is not smaller than the full one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import Figure, Goal, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
DENSE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--replicate-data"]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def capture(out: Path, payload: str, a) -> dict | None:
    d = out / payload
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "prism_launch", "--nnodes", str(a.nodes), "--nproc-per-node", "8", "-r", "3",
           "device=cpu", "comm.timeout_s=300", "--log-dir", str(d / "logs"), "mode=capture",
           f"trace.dir={d / 'trace'}", f"capture.payload={payload}", f"capture.fold={str(not a.no_fold).lower()}",
           f"sandbox.ranks=[{a.sandbox}]", "launch.progress=false", str(RECIPE), *DENSE, "--train-iters", str(a.steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        print(f"capture {payload} failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
        return None
    manifest = json.loads((d / "trace" / "manifest.json").read_text())
    stats = manifest["extra"]["capture"]
    return {"payload": payload, "tensor_bytes": stats.get("tensor_bytes"), "trace_bytes": _size(d / "trace"),
            "wall_s": stats.get("wall_s"), "ranks": len(manifest["ranks_captured"])}


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def figures(rows: dict[str, dict]) -> list[Figure]:
    """Per policy its tensors, trace and seconds; the exact/full and none/full ratios, the exact
    trace smaller than the full one (it stores only what the sandbox consumes)."""
    out = []
    full = rows["full"]
    for r in rows.values():
        p = r["payload"]
        out += [Figure(f"{p} tensors MiB", None if r.get("tensor_bytes") is None else r["tensor_bytes"] / 2**20,
                       fmt=".2f"),
                Figure(f"{p} trace MiB", None if r.get("trace_bytes") is None else r["trace_bytes"] / 2**20, fmt=".2f"),
                Figure(f"{p} trace vs full", _ratio(r.get("trace_bytes"), full.get("trace_bytes")), fmt=".3f"),
                Figure(f"{p} capture s", r.get("wall_s"), fmt=".1f")]
    below_one = Goal("< 1", lambda v: v < 1)
    out += [Figure("exact/full tensors", _ratio(rows["exact"].get("tensor_bytes"), full.get("tensor_bytes")),
                   below_one, ".3f"),
            Figure("exact/full trace", _ratio(rows["exact"].get("trace_bytes"), full.get("trace_bytes")), below_one,
                   ".3f"),
            Figure("none/full trace", _ratio(rows["none"].get("trace_bytes"), full.get("trace_bytes")), fmt=".4f")]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2, help="logical nodes of 8 ranks")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sandbox", type=int, default=11)
    p.add_argument("--no-fold", action="store_true", help="capture every rank (capture.fold=false)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the traces")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="prism-trace-size-"))
    rows = {payload: capture(out, payload, a) for payload in ("full", "exact", "none")}
    if not a.keep and a.out is None:
        shutil.rmtree(out, ignore_errors=True)
    if any(r is None for r in rows.values()):
        print("FAIL: a capture failed", file=sys.stderr)
        return 1
    figs = figures(rows)
    f = {x.name: x.shown() for x in figs}
    first = rows["full"]
    print(f"dense TP2·PP2, {a.nodes * 8} logical ranks ({first['ranks']} captured), sandbox rank {a.sandbox}, "
          f"{a.steps} steps")
    print(f"{'payload':8} {'tensors MiB':>11} {'trace MiB':>9} {'vs full':>8} {'capture s':>9}")
    for p in rows:
        print(f"{p:8} {f[p + ' tensors MiB']:>11} {f[p + ' trace MiB']:>9} {f[p + ' trace vs full']:>8} "
              f"{f[p + ' capture s']:>9}")
    print(f"exact/full: tensors {f['exact/full tensors']}, trace {f['exact/full trace']}; "
          f"none/full: trace {f['none/full trace']}")
    return report(figs)


if __name__ == "__main__":
    sys.exit(main())
