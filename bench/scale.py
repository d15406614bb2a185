"""Scale on CPU: one sandbox process of the bundled Megatron recipe in 1,024- and 8,192-rank
virtual worlds, captured with symmetry folding.

    python bench/scale.py [--only dense,moe,step,init] [--worlds 1024,8192]
    python bench/scale.py --only init --worlds 65536    # the 65,536-rank TP2·PP2 row alone

Prints, per layout and world size: the folded capture (ranks captured, wall time), the
sandbox's init (``init_process_group`` through ``initialize_model_parallel``; ``init`` in the
default run is TP2·PP2 at 8,192 and 65,536 ranks, a group-creation benchmark) and its
``new_group`` calls, its memory (VmRSS before init, growth through init, VmHWM at exit), and
its emulated step time. ``step`` compares the
emulated step of rank 0 of a TP2 job at 1,024 and 8,192 ranks with the same rank's step in a
real 2-rank run (same shard, same micro-batches per rank; one thread per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import Figure, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "bench" / "workers" / "timed_megatron.py"
SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]
LAYOUTS = {
    "dense": ("TP8·PP4", 5, ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4", *SMALL]),
    "moe": ("TP8·PP8·EP8", 5, ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                               "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
                               "--seq-length", "32", "--num-experts", "8", "--expert-model-parallel-size", "8",
                               "--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
    "step": ("TP2", 0, ["--tensor-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "256",
                        "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "4",
                        "--train-iters", "6"]),
    "init": ("TP2·PP2", 0, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *SMALL,
                            "--train-iters", "2"]),
}
INIT_WORLDS = [8192, 65536]
"""``init``'s worlds when ``--worlds`` is not given (group creation grows with the world)."""
_STEP = re.compile(r"step (\d+) \| loss \S+ .*step_time_ms (\S+)")
_CAPTURE = re.compile(r"captured (\d+) of (\d+) logical ranks \(folded\).* in ([\d.]+)s")


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"failed: prism-launch {' '.join(map(str, args))}\n{r.stderr[-3000:]}")
    return r


def _median_step(log_root: Path, rank: int) -> float | None:
    for f in sorted(log_root.glob(f"*/{rank}/stdout.log")):
        ms = [float(m.group(2)) for m in _STEP.finditer(f.read_text())]
        if len(ms) > 1:
            return statistics.median(ms[1:])
    return None


def emulated(layout: str, world: int, work: Path) -> dict:
    name, sandbox, args = LAYOUTS[layout]
    out = work / f"{layout}-{world}"
    flags = ["--nnodes", world // 8, "--nproc-per-node", 8, "-r", "3", "device=cpu", f"sandbox.ranks=[{sandbox}]",
             f"trace.dir={out / 'trace'}", "comm.timeout_s=1200"]
    script = [DRIVER, "--bench-out", out / "bench", *args]
    # capture and emulation as two commands, like a user re-running a captured job
    r = _run([*flags, "--log-dir", out / "cap", "mode=capture", *script], work)
    m = _CAPTURE.search(r.stderr)
    (out / "bench").rename(out / "bench-capture")
    _run([*flags, "--log-dir", out / "logs", "mode=emulate", *script], work)
    info = json.loads((out / "bench" / f"rank{sandbox}.json").read_text())
    report = json.loads((out / "trace" / "report" / "report.json").read_text())
    steps = report["ranks"][str(sandbox)].get("step_times_s") or []
    return {
        "layout": name, "world": world, "captured": int(m.group(1)) if m else None,
        "capture_s": float(m.group(3)) if m else None, "init_s": info.get("init_s"),
        "model_parallel_s": info.get("model_parallel_s"),
        "new_group_calls": info.get("new_group_calls"), "rss_before_init_mb": info.get("rss_before_init_mb"),
        "init_growth_mb": None if None in (info.get("rss_after_init_mb"), info.get("rss_before_init_mb"))
        else info["rss_after_init_mb"] - info["rss_before_init_mb"], "hwm_mb": info.get("hwm_mb"),
        "step_ms": _median_step(out / "logs", sandbox) or (statistics.median(steps[1:]) * 1e3 if len(steps) > 1 else None),
        "predicted_ms": None if report["predicted"].get("iteration_time_s") is None
        else report["predicted"]["iteration_time_s"] * 1e3,
    }


def real_small(layout: str, work: Path) -> float:
    _name, sandbox, args = LAYOUTS[layout]
    out = work / f"{layout}-real"
    _run(["--nproc-per-node", 2, "-r", "3", "--log-dir", out, "device=cpu", "mode=real", DRIVER, *args], work)
    return _median_step(out, sandbox)


def _cell(v, width: int, fmt: str) -> str:
    """A table cell: ``MISSING`` for a value that is missing (never a 0 that reads as measured)."""
    return f"{'MISSING':>{width}}" if v is None else f"{v:>{width}{fmt}}"


TABLE = (("captured", "d"), ("capture_s", ".1f"), ("init_s", ".2f"), ("new_group_calls", "d"),
         ("rss_before_init_mb", ".0f"), ("init_growth_mb", ".1f"), ("hwm_mb", ".0f"), ("step_ms", ".1f"),
         ("predicted_ms", ".1f"))


def figures(rows: list[dict], real_ms: float | None = None, want_real: bool = False) -> list[Figure]:
    """Every table cell of every row, and (``want_real``: the step layout ran) the real 2-rank
    run's step time that the emulated TP2 steps are compared with."""
    out = [Figure(f"{r['layout']} {r['world']}: {k}", r.get(k), fmt=fmt) for r in rows for k, fmt in TABLE]
    if want_real:
        out.append(Figure("TP2 rank 0 real 2-rank step ms", real_ms, fmt=".1f"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="dense,moe,step,init")
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 1024,8192; init: 8192,65536)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prism-scale-"))
    rows = []
    for layout in a.only.split(","):
        worlds = [int(w) for w in a.worlds.split(",")] if a.worlds else INIT_WORLDS if layout == "init" else [1024, 8192]
        for world in worlds:
            if layout == "moe" and world < 8192 and world % 512:
                continue
            row = emulated(layout, world, work)
            rows.append(row)
            print(json.dumps(row), flush=True)
    real = real_small("step", work) if "step" in a.only else None
    print()
    print(f"{'layout':<12}{'world':>7}{'captured':>9}{'capture s':>10}{'init s':>8}{'new_group':>10}"
          f"{'RSS@init MB':>12}{'init +MB':>9}{'HWM MB':>8}{'step ms':>9}")
    for r in rows:
        print(f"{r['layout']:<12}{r['world']:>7}{_cell(r['captured'], 9, 'd')}{_cell(r['capture_s'], 10, '.1f')}"
              f"{_cell(r['init_s'], 8, '.2f')}{_cell(r['new_group_calls'], 10, 'd')}"
              f"{_cell(r['rss_before_init_mb'], 12, '.0f')}{_cell(r['init_growth_mb'], 9, '.1f')}"
              f"{_cell(r['hwm_mb'], 8, '.0f')}{_cell(r['step_ms'], 9, '.1f')}")
    if real is not None:
        print(f"\nTP2 rank 0, real 2-rank run: step {real:.1f} ms (median after the first)")
        for r in rows:
            if r["layout"] == "TP2" and r["step_ms"]:
                print(f"  emulated in a {r['world']}-rank world: {r['step_ms']:.1f} ms = {r['step_ms'] / real:.3f}x real")
    elif "step" in a.only:
        print("\nTP2 rank 0, real 2-rank run: step MISSING")
    print(f"\nwork dir: {work}")
    return report(figures(rows, real, "step" in a.only))


if __name__ == "__main__":
    sys.exit(main())
