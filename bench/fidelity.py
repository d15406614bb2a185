"""Fidelity: the same job run for real and emulated; prints iteration-time error,
peak-memory error (allocator-level, sandbox rank vs the same rank of the real run) and
whether losses match.

    python bench/fidelity.py [--jobs dense,moe] [--iters 8] [--cluster cpu_local] [--compute calibrated]

Each job runs with 2 ranks (one thread each, so the real run is free of contention on a
2-core machine): ``mode=real`` gives the measured step time (the recipe's own
``step_time_ms``, median of the steps after the first) and losses; ``mode=auto`` captures
and emulates rank 0 as the sandbox, calibrating first (``--compute calibrated``, the default:
slices of 2 ranks run for real against the bare graph and their compute spans replace the
bare ones), and the report's global replay gives the predicted iteration time.
``--compute cpu`` predicts from the bare graph's per-rank thread CPU time instead (no
calibration; on this VM it misses the time a running thread loses to the other rank and the
host, about 13% of the dense step).
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

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
JOBS = {
    "dense": ["--tensor-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "256",
              "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "4"],
    "moe": ["--expert-model-parallel-size", "2", "--num-experts", "4", "--num-layers", "4", "--hidden-size", "256",
            "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "4"],
}
_STEP = re.compile(r"step (\d+) \| loss (\S+) .*step_time_ms (\S+)")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"failed: prism-launch {' '.join(map(str, args))}\n{r.stderr[-3000:]}")
    return r


def _steps(log_dir: Path) -> list[tuple[int, float, float]]:
    out = []
    for f in sorted(log_dir.glob("*/*/stdout.log")):
        for m in _STEP.finditer(f.read_text()):
            out.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
        if out:
            return out
    return out


def bench(job: str, iters: int, cluster: str, compute: str = "auto") -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"prism-fidelity-{job}-"))
    args = [RECIPE, *JOBS[job], "--train-iters", str(iters)]
    flags = ["--nproc-per-node", "2", "-r", "3"]
    _run([*flags, "--log-dir", work / "real", "mode=real", "device=cpu", *args], work)
    real = _steps(work / "real")
    real_memory = json.loads(next((work / "real").glob("*/0/memory.json")).read_text())["peak_bytes"]
    real_step = statistics.median(s[2] for s in real[1:]) / 1e3
    _run([*flags, "--log-dir", work / "emu", "mode=auto", "device=cpu", f"cluster={cluster}",
          f"trace.dir={work / 'trace'}", "sandbox.ranks=[0]", "calibrate.slice_size=2", f"replay.compute={compute}",
          *(["calibrate.in_auto=true"] if compute == "calibrated" else []), *args], work)
    report = json.loads((work / "trace" / "report" / "report.json").read_text())
    predicted = report["predicted"]["iteration_time_s"]
    sandbox = report["ranks"]["0"]
    real_losses = [s[1] for s in real]
    emu_losses = sandbox["losses"]
    rel = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(emu_losses, real_losses)), default=float("nan"))
    return {
        "job": job, "real_step_s": real_step, "predicted_s": predicted,
        "error_pct": 100 * (predicted - real_step) / real_step,
        "losses_vs_real_max_rel": rel, "losses_bit_identical_to_capture": sandbox["losses_match_capture"],
        "peak_memory_bytes": sandbox.get("peak_memory_bytes"), "real_peak_memory_bytes": real_memory,
        "memory_error_pct": 100 * (sandbox["peak_memory_bytes"] - real_memory) / real_memory,
        "compute_source": report["predicted"]["compute_source"], "work": str(work),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="dense,moe")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--cluster", default="cpu_local")
    ap.add_argument("--compute", default="calibrated", help="replay.compute: calibrated | auto | cpu | wall")
    a = ap.parse_args()
    rows = [bench(j, a.iters, a.cluster, a.compute) for j in a.jobs.split(",")]
    print(f"{'job':6} {'real step (ms)':>15} {'predicted (ms)':>15} {'error':>8} {'losses vs real':>15} "
          f"{'bit-identical':>14} {'peak mem (MiB)':>15} {'mem error':>10} {'compute spans':>14}")
    for r in rows:
        print(f"{r['job']:6} {r['real_step_s'] * 1e3:15.2f} {r['predicted_s'] * 1e3:15.2f} {r['error_pct']:7.2f}% "
              f"{r['losses_vs_real_max_rel']:15.2e} {str(r['losses_bit_identical_to_capture']):>14} "
              f"{r['peak_memory_bytes'] / 2**20:15.2f} {r['memory_error_pct']:9.4f}% {r['compute_source']:>14}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
