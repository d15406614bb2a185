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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import IS_TRUE, Figure, report  # noqa: E402

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


def figures(stats: dict[str, dict], losses: dict[str, list]) -> list[Figure]:
    """Each exchange setting's capture figures (a busy time or lag the capture did not record:
    missing, not 0) and the sandbox's losses bit-identical between the two (none logged: missing)."""
    out = []
    for exchange, s in stats.items():
        at = f"capture.exchange={exchange}"
        busy, ranks = s.get("coordinator_busy_s") or {}, s.get("rank_busy_s") or {}
        lag = (s.get("coordinator_lags") or {}).get("pump")
        # lags are noted per pump run: none noted with no pump time means no pump ran, not a missing figure
        idle = lag is None and busy.get("pump") == 0
        total = (lambda k: sum(v.get(k, 0) for v in ranks.values()) if ranks else None)
        out += [Figure(f"{at} wall s", s.get("wall_s"), fmt=".1f"),
                Figure(f"{at} coordinator receive s", busy.get("receive"), fmt=".2f"),
                Figure(f"{at} coordinator reply s", busy.get("reply"), fmt=".2f"),
                Figure(f"{at} coordinator pump s", busy.get("pump"), fmt=".2f"),
                Figure(f"{at} ranks' send s", total("send"), fmt=".2f"),
                Figure(f"{at} ranks' stage s", total("stage"), fmt=".2f"),
                Figure(f"{at} staged collectives", total("staged_ops")),
                Figure(f"{at} longest pump s", "no pump ran" if idle else (lag or {}).get("max_s"),
                       fmt="" if idle else ".3f"),
                Figure(f"{at} pumps over 10 ms", 0 if idle else (lag or {}).get("over_10ms"))]
    logged = list(losses.values())
    same = None if not logged or not all(logged) else all(x == logged[0] for x in logged)
    out.append(Figure(f"sandbox rank {SANDBOX}'s losses bit-identical between the two", same, IS_TRUE))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep", type=Path, default=None, help="keep the traces and logs here")
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="prism-coord-load-"))
    work.mkdir(parents=True, exist_ok=True)
    losses, stats = {}, {}
    try:
        for exchange in ("true", "false"):
            stats[exchange], losses[exchange] = capture(work, exchange, a.hidden, a.steps)
            f = {x.name.removeprefix(f"capture.exchange={exchange} "): x.shown()
                 for x in figures({exchange: stats[exchange]}, {})}
            send, stage = f["ranks' send s"], f["ranks' stage s"]
            print(f"capture.exchange={exchange}: wall {f['wall s']}s; coordinator receive {f['coordinator receive s']}s, "
                  f"reply {f['coordinator reply s']}s, pump {f['coordinator pump s']}s; ranks' send "
                  f"{send}s, stage {stage}s, staged collectives "
                  f"{f['staged collectives']}; longest pump {f['longest pump s']}s, pumps over 10 ms "
                  f"{f['pumps over 10 ms']}", flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    figs = figures(stats, losses)
    print(f"sandbox rank {SANDBOX}'s losses ({len(losses['true'])} logged) bit-identical between the two: "
          f"{figs[-1].shown()}")
    return report(figs)


if __name__ == "__main__":
    sys.exit(main())
