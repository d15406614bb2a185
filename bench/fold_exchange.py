"""Folded data-parallel reductions summed by the captured members against the coordinator (CPU).

    python bench/fold_exchange.py [--nodes 20] [--steps 4] [--hidden 512] [--out DIR] [--keep]

Captures the bundled MoE recipe (``examples/megatron_gpt.py``, PP2·EP2 over ``--nodes`` x 8
logical ranks, folded around the last rank: each stage's two captured expert-parallel ranks share
one data-parallel group of ``--nodes`` x 4 members, weighted past 64) with
``capture.fold_exchange=true`` and ``false``, and prints per setting the capture's seconds, the
recipe's step times on the sandbox rank (median after the first), the coordinator's busiest
handling of a staged collective and its compute seconds, the captured ranks' seconds blocked in
waits on data-parallel collectives after the first step, and whether every captured rank logged
the same losses and parameter checksums under both. Exits 1 when a capture fails or they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import IS_TRUE, Figure, at_least, report  # noqa: E402
from gpu_exact import blocked_seconds  # noqa: E402
RECIPE = ROOT / "examples" / "megatron_gpt.py"
MOE = ["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "2",
       "--moe-aux-loss-coeff", "0.01", "--replicate-data", "--log-all-ranks"]
_METRIC = re.compile(r"(loss|grad_norm|param_checksum) (\S+)")
_STEP = re.compile(r"step_time_ms (\S+)")


def _logs(d: Path, rank: int) -> str:
    [run] = [p for p in (d / "logs").iterdir() if p.is_dir()]
    return (run / str(rank) / "stdout.log").read_text()


def capture(out: Path, on: bool, a) -> dict | None:
    d = out / ("members" if on else "coordinator")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    world = a.nodes * 8
    cmd = [sys.executable, "-m", "prism_launch", "--nnodes", str(a.nodes), "--nproc-per-node", "8", "-r", "3",
           "device=cpu", "comm.timeout_s=300", "--log-dir", str(d / "logs"), "mode=capture",
           f"trace.dir={d / 'trace'}", "capture.payload=exact", "capture.fold=true",
           f"capture.fold_exchange={str(on).lower()}", f"sandbox.ranks=[{world - 1}]", "launch.progress=false",
           str(RECIPE), *MOE, "--train-iters", str(a.steps), "--hidden-size", str(a.hidden),
           "--num-attention-heads", "8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=a.timeout)
    seconds = time.monotonic() - t0
    if r.returncode != 0:
        print(f"capture with fold_exchange={on} failed ({r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
        return None
    stats = json.loads((d / "trace" / "capture.json").read_text())
    busy = stats["rank_busy_s"]
    ranks = sorted(map(int, busy))
    steps = [float(x) for x in _STEP.findall(_logs(d, world - 1))]
    _total, by = blocked_seconds(d / "trace", since_unit=1)
    dp = [cell for per in by.values() for what, cell in per.items() if what.startswith("c:DATA_PARALLEL")]
    return {"seconds": seconds, "ranks": ranks, "steps_ms": steps,
            "metrics": {r: _METRIC.findall(_logs(d, r)) for r in ranks},
            "folded_exchanged": sum(b.get("folded_exchanged_ops", 0) for b in busy.values()),
            "staged": sum(b.get("staged_ops", 0) for b in busy.values()),
            "compute_s": (stats.get("coordinator_busy_s") or {}).get("compute"),
            "dp_blocked_s": sum(c[0] for c in dp), "dp_waits": sum(c[1] for c in dp),
            "scoll_max_s": _scoll_max_s(stats)}


def _scoll_max_s(stats: dict) -> float | str | None:
    """The longest ``handle_scoll``; "none ran" when the capture noted lags but none for it (no
    staged collective), None when it noted no lags at all (missing)."""
    lags = stats.get("coordinator_lags")
    if lags is None:
        return None
    return lags["handle_scoll"].get("max_s") if "handle_scoll" in lags else "none ran"


def figures(res: dict[bool, dict]) -> list[Figure]:
    """Both captures' figures: with ``fold_exchange=true`` members must sum at least one op
    themselves (else the setting did nothing), and every captured rank's losses and checksums
    must be equal under both (no logged values: missing, not equal)."""
    out = []
    for on, r in res.items():
        at = f"fold_exchange={str(on).lower()}"
        steps = r.get("steps_ms") or []
        out += [Figure(f"{at} capture s", r.get("seconds"), fmt=".1f"),
                Figure(f"{at} step ms (median after the first)", statistics.median(steps[1:]) if len(steps) > 1
                       else None, fmt=".0f"),
                Figure(f"{at} ops summed by members", r.get("folded_exchanged"), at_least(1) if on else None),
                Figure(f"{at} staged to the coordinator", r.get("staged")),
                Figure(f"{at} coordinator compute s", r.get("compute_s"), fmt=".3f"),
                Figure(f"{at} longest scoll ms", r["scoll_max_s"] * 1e3 if isinstance(r.get("scoll_max_s"), float)
                       else r.get("scoll_max_s"), fmt=".1f" if isinstance(r.get("scoll_max_s"), float) else ""),
                Figure(f"{at} blocked s on data-parallel collectives", r.get("dp_blocked_s"), fmt=".3f")]
    metrics = [r.get("metrics") or {} for r in res.values()]
    same = None if not all(m and all(m.values()) for m in metrics) else all(m == metrics[0] for m in metrics)
    out.append(Figure("losses and parameter checksums equal under both", same, IS_TRUE))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="prism-fold-exchange-"))
    try:
        res = {on: capture(out, on, a) for on in (True, False)}
        if any(r is None for r in res.values()):
            return 1
        print(f"PP2·EP2 MoE, {a.nodes * 8} ranks, hidden {a.hidden}, {a.steps} steps, data-parallel groups of "
              f"{a.nodes * 4} members (2 captured each):")
        figs = figures(res)
        f = {x.name: x.shown() for x in figs}
        for on, r in res.items():
            at = f"fold_exchange={str(on).lower()}"
            print(f"  fold_exchange={str(on).lower():5}: capture {f[at + ' capture s']}s, step (median after the "
                  f"first) {f[at + ' step ms (median after the first)']} ms {r['steps_ms']}, ops summed by members "
                  f"{f[at + ' ops summed by members']}, staged to the coordinator {f[at + ' staged to the coordinator']}, "
                  f"coordinator compute {f[at + ' coordinator compute s']}s, longest scoll {f[at + ' longest scoll ms']} "
                  f"ms; the captured ranks blocked {f[at + ' blocked s on data-parallel collectives']}s in "
                  f"{r['dp_waits']} waits on data-parallel collectives after the first step")
        print(f"  losses and parameter checksums of ranks {res[True]['ranks']} equal under both: "
              f"{f['losses and parameter checksums equal under both']}")
        return report(figs)
    finally:
        if not a.keep and a.out is None:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
