"""The coordinator's load from collectives it computes, socket against shared memory (runs on the CPU).

    python bench/coordinator_load.py [--hidden 512] [--steps 6] [--keep DIR]

Captures the bundled MoE recipe (``examples/megatron_gpt.py``, PP2·EP2 over 16 logical ranks,
folded around sandbox rank 15: 4 captured ranks, each stage's two expert-parallel ranks sharing
one 8-member data-parallel group, so the gradient reductions are computed by the coordinator)
with ``capture.exchange=true`` (contributions of 64 KiB and more, and their results, through
shared memory: ``scoll``/``sok``) and ``false`` (through the coordinator's socket), and prints
per setting the capture's wall seconds, the coordinator thread's seconds receiving, replying and
pumping messages, the ranks' seconds sending and staging, and the staged collectives; then
whether the sandbox rank's logged losses agree bit for bit. Exits 1 when a capture fails or they
differ.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
SANDBOX = 15


def capture(work: Path, exchange: str, hidden: int, steps: int) -> tuple[dict, list[str]]:
    trace, logs = work / f"trace-{exchange}", work / f"logs-{exchange}"
    cmd = [sys.executable, "-m", "prism_launch", "--nnodes", "2", "--nproc-per-node", "8", "--log-dir", str(logs),
           "device=cpu", "comm.timeout_s=300", "capture.fold=true", "capture.payload=exact",
           f"capture.exchange={exchange}", f"sandbox.ranks=[{SANDBOX}]", f"trace.dir={trace}", "mode=capture",
           str(RECIPE), "--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size",
           "2", "--moe-aux-loss-coeff", "0.01", "--replicate-data", "--log-all-ranks", "--hidden-size", str(hidden), "--ffn-hidden-size",
           str(4 * hidden), "--train-iters", str(steps)]
    r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        raise SystemExit(1)
    stats = json.loads((trace / "capture.json").read_text())
    [run] = [p for p in logs.iterdir() if p.is_dir()]
    losses = re.findall(r"loss[ =:]+([0-9.eE+-]+)", (run / str(SANDBOX) / "stdout.log").read_text())
    return stats, losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep", type=Path, default=None, help="keep the traces and logs here")
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="prism-coord-load-"))
    work.mkdir(parents=True, exist_ok=True)
    losses = {}
    try:
        for exchange in ("true", "false"):
            s, losses[exchange] = capture(work, exchange, a.hidden, a.steps)
            busy = s["coordinator_busy_s"]
            ranks = s["rank_busy_s"]
            print(f"capture.exchange={exchange}: wall {s['wall_s']:.1f}s; coordinator receive {busy['receive']:.2f}s, "
                  f"reply {busy['reply']:.2f}s, pump {busy.get('pump', 0):.2f}s; ranks' send "
                  f"{sum(v.get('send', 0) for v in ranks.values()):.2f}s, stage "
                  f"{sum(v.get('stage', 0) for v in ranks.values()):.2f}s, staged collectives "
                  f"{sum(v.get('staged_ops', 0) for v in ranks.values())}; longest pump "
                  f"{(s.get('coordinator_lags') or {}).get('pump', {}).get('max_s', 0):.3f}s, pumps over 10 ms "
                  f"{(s.get('coordinator_lags') or {}).get('pump', {}).get('over_10ms', 0)}", flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    same = bool(losses["true"]) and losses["true"] == losses["false"]
    print(f"sandbox rank {SANDBOX}'s losses ({len(losses['true'])} logged) bit-identical between the two: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
