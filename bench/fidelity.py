"""CPU fidelity harness: real jobs and their predictions side by side, interleaved and repeated.

    python bench/fidelity.py [--ranks 2,4,8] [--jobs dense,moe] [--pairs 5] [--pairs-large 1]
                             [--iters 8] [--cluster cpu_local] [--compute calibrated] [--check]

For each case (the bundled Megatron recipe, ``examples/megatron_gpt.py``: dense TP2 at 2 ranks,
TP2·PP2 at 4, TP2·PP2·DP2 at 8; MoE EP2 at 2 ranks, EP2·DP2 at 4) it runs ``--pairs`` pairs
(2 ranks) or ``--pairs-large`` pairs (4 and 8) of

* ``mode=real``: every rank for real over gloo; the measured step time is the recipe's own
  ``step_time_ms``, median of the steps after the first; each rank's peak memory
  (``memory.json``, allocator level);
* ``mode=auto`` in a fresh trace directory: capture, then emulate rank 0 as the sandbox; the
  report's global replay on ``--cluster`` gives the predicted iteration time (compute spans:
  ``--compute calibrated``, the default: slices of one rank per core run for real against the
  bare trace and their measured spans replace the capture's — they include what a running
  thread loses to its neighbours and the host; ``--compute cpu``: the capture's per-rank
  thread CPU time, which does not) and every rank's predicted peak (virtual ranks: the
  capture's peak; the sandbox: its own),

alternating which of the two goes first. It prints the machine, the load, the cluster and
the compute method, then per case the mean and spread of both times, the mean, largest and
spread of the iteration-time error, and the largest per-rank peak-memory error (predicted
against the real run's same rank). The exit code is 1 when a value is missing or not finite,
or (``--check``) when a case misses its goal: the 2-rank cases ±5% mean time error (the
issue's CPU goal) and every case 1% peak memory.

Goal and machine: the real run of ``n`` ranks shares this machine's cores; at more ranks than
cores the real step includes time-slicing that CPU-time spans do not, which the table shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_stats import Pair, failures, load, machine, summarize, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4"]
CASES = {  # (job, ranks) -> (parallelism label, recipe flags)
    ("dense", 2): ("TP2", ["--tensor-model-parallel-size", "2"]),
    ("dense", 4): ("TP2·PP2", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("dense", 8): ("TP2·PP2·DP2", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ("moe", 2): ("EP2", ["--expert-model-parallel-size", "2", "--num-experts", "4"]),
    ("moe", 4): ("EP2·DP2", ["--expert-model-parallel-size", "2", "--num-experts", "4"]),
}
_STEP = re.compile(r"step (\d+) \| loss (\S+) .*step_time_ms (\S+)")


def _run(args: list, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"failed: prism-launch {' '.join(map(str, args))}\n{r.stderr[-3000:]}")


def _step_s(log_dir: Path) -> float:
    for f in sorted(log_dir.glob("*/*/stdout.log")):
        steps = [float(m.group(3)) for m in _STEP.finditer(f.read_text())]
        if len(steps) > 1:
            return statistics.median(steps[1:]) / 1e3
    raise SystemExit(f"no step_time_ms lines under {log_dir}")


def real(flags: list, job: list, work: Path) -> tuple[float, dict[int, int]]:
    _run([*flags, "--log-dir", work, "mode=real", *job], work.parent)
    peaks = {int(p.parent.name): json.loads(p.read_text())["peak_bytes"] for p in work.glob("*/*/memory.json")}
    return _step_s(work), peaks


def predicted(flags: list, job: list, work: Path, cluster: str, compute: str) -> tuple[float, dict[int, int]]:
    _run([*flags, "--log-dir", work / "logs", "mode=auto", f"cluster={cluster}", f"trace.dir={work / 'trace'}",
          "sandbox.ranks=[0]", f"replay.compute={compute}",
          *(["calibrate.in_auto=true"] if compute == "calibrated" else []), *job], work.parent)
    report = json.loads((work / "trace" / "report" / "report.json").read_text())
    peaks = {int(r): v["peak_memory_bytes"] for r, v in report["ranks"].items() if v.get("peak_memory_bytes")}
    return report["predicted"]["iteration_time_s"], peaks


def run_case(job: str, ranks: int, pairs: int, iters: int, cluster: str, compute: str) -> dict:
    label, flags_job = CASES[(job, ranks)]
    work = Path(tempfile.mkdtemp(prefix=f"prism-fidelity-{job}{ranks}-"))
    flags = ["--nproc-per-node", str(ranks), "-r", "3", "device=cpu"]
    args = [RECIPE, *MODEL, *flags_job, "--train-iters", str(iters)]
    out = []
    for i in range(pairs):
        runs = [("real", lambda: real(flags, args, work / f"real{i}")),
                ("pred", lambda: predicted(flags, args, work / f"pred{i}", cluster, compute))]
        done = dict((name, fn()) for name, fn in (runs if i % 2 == 0 else runs[::-1]))
        out.append(Pair(done["real"][0], done["pred"][0], done["real"][1], done["pred"][1]))
        print(f"  {job} {ranks} ranks pair {i + 1}/{pairs}: real {out[-1].real_step_s * 1e3:.2f} ms, predicted "
              f"{out[-1].predicted_step_s * 1e3:.2f} ms ({out[-1].time_error_pct:+.2f}%); {load()}", flush=True)
    return summarize(f"{job} {label} ({ranks} ranks)", out, time_goal_pct=5.0 if ranks == 2 else None,
                     memory_goal_pct=1.0, work=str(work))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--jobs", default="dense,moe")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved pairs of each 2-rank case")
    ap.add_argument("--pairs-large", type=int, default=1, help="pairs of each 4- and 8-rank case")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--cluster", default="cpu_local")
    ap.add_argument("--compute", default="calibrated", help="replay.compute: calibrated | cpu | wall")
    ap.add_argument("--check", action="store_true", help="exit 1 when a case misses its goal")
    a = ap.parse_args()
    how = {"calibrated": "slices of one rank per core, run for real", "cpu": "the capture's thread CPU time"}
    print(f"machine: {machine()}; {load()}\ncluster: {a.cluster}; compute spans: replay.compute={a.compute} "
          f"({how.get(a.compute, a.compute)}, measured on this machine's CPU); iterations {a.iters}", flush=True)
    rows = []
    for ranks in map(int, a.ranks.split(",")):
        for job in a.jobs.split(","):
            if (job, ranks) in CASES:
                try:
                    rows.append(run_case(job, ranks, a.pairs if ranks == 2 else a.pairs_large, a.iters, a.cluster,
                                         a.compute))
                except SystemExit as e:  # a failed run: the case's row says so, the others still run
                    print(f"{job} {ranks} ranks: {str(e)[-2000:]}", file=sys.stderr, flush=True)
                    rows.append(summarize(f"{job} {CASES[(job, ranks)][0]} ({ranks} ranks) FAILED", []))
    print(f"\nmachine: {machine()}; {load()}; cluster {a.cluster}; compute {a.compute}")
    print(table([r for r in rows if r["pairs"]]))
    for r in rows:
        if not r["pairs"]:
            print(f"{r['case']}: no pair completed")
    # a value not measured is null in the dump, never a NaN that reads as a number
    print(json.dumps([{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
                      for r in rows], indent=1))
    bad = failures([r if a.check else {**r, "time_goal_pct": None, "memory_goal_pct": None} for r in rows])
    for b in bad:
        print(f"FAIL: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
