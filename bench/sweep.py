"""Config sweeps of the bundled recipe with ``prism-launch --multirun``.

    python bench/sweep.py [--world 16] [--tp 1,2] [--pp 1,2] [--out DIR] [--launcher basic]
    python bench/sweep.py --router [--router-world 4] [--capacity null,1.0,0.5]

Parallelism sweep (default): the dense recipe at ``--world`` logical ranks (``--nproc-per-node``
per node), every ``target.parallel.tp`` x ``target.parallel.pp`` point at a fixed global batch,
each in ``mode=auto`` (capture if no trace, then emulate sandbox rank 0). Router sweep
(``--router``): the MoE recipe (4 experts, EP 2, TP 2 with sequence parallelism, aux loss) over
``script.args.moe_expert_capacity_factor``, showing the measured routing imbalance and dropped
tokens of every point next to its predicted iteration time.

Prints the sweep's ranked table (from prism-launch) and the summary CSV's key columns; the
sweep dir holds ``summary.csv``, ``summary.png`` and one report per point.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
       "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0.01"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=16, help="logical ranks of the parallelism sweep")
    p.add_argument("--nproc-per-node", type=int, default=8)
    p.add_argument("--tp", default="1,2")
    p.add_argument("--pp", default="1,2")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--router", action="store_true", help="the MoE router sweep instead")
    p.add_argument("--router-world", type=int, default=4)
    p.add_argument("--capacity", default="null,1.0,0.5", help="moe_expert_capacity_factor points (null: dropless)")
    p.add_argument("--cluster", default="h100_ib")
    p.add_argument("--launcher", default="basic", help="hydra/launcher: basic, prism_joblib, prism_local, ...")
    p.add_argument("--out", type=Path, default=None, help="sweep dir (default multirun/<date>/<time>)")
    p.add_argument("--cwd", type=Path, default=Path.cwd(), help="where traces go (prism_traces/)")
    p.add_argument("extra", nargs="*", help="more key=value overrides")
    a = p.parse_args(argv)

    common = ["device=cpu", "comm.timeout_s=300", f"cluster={a.cluster}", f"hydra/launcher={a.launcher}", *a.extra]
    if a.out is not None:
        common.append(f"hydra.sweep.dir={a.out.resolve()}")
    if a.router:
        world = a.router_world
        flags = ["--nproc-per-node", str(world)]
        points = [f"script.args.moe_expert_capacity_factor={a.capacity}"]
        script = [RECIPE, *MOE, "--train-iters", str(a.iters)]
    else:
        world = a.world
        nproc = min(a.nproc_per_node, world)
        flags = ["--nnodes", str(world // nproc), "--nproc-per-node", str(nproc)]
        points = [f"target.parallel.tp={a.tp}", f"target.parallel.pp={a.pp}",
                  f"target.parallel.global_batch_size={a.global_batch_size}",
                  f"target.parallel.micro_batch_size={a.micro_batch_size}"]
        script = [RECIPE, "--train-iters", str(a.iters)]
    cmd = [sys.executable, "-m", "prism_launch", "--multirun", *flags, "-r", "3", *common, *points, *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)}
    print("$ " + " ".join(map(str, cmd)), file=sys.stderr)
    t0 = time.monotonic()
    r = subprocess.run(list(map(str, cmd)), cwd=a.cwd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    # the sweep's own ranked table and summary paths are the tail of its stderr
    tail = r.stderr[r.stderr.rfind("prism-launch sweep:"):] if "prism-launch sweep:" in r.stderr else r.stderr[-4000:]
    print(tail, file=sys.stderr)
    summary = next((line.split()[1] for line in r.stderr.splitlines() if line.startswith("summary: ")), None)
    if summary is None or not Path(summary).exists():
        print(f"sweep failed (exit {r.returncode})", file=sys.stderr)
        return 1
    rows = list(csv.DictReader(open(summary)))
    print(f"{'sweep' if not a.router else 'router sweep'} at {world} logical ranks, {len(rows)} points, "
          f"{wall:.0f}s: {summary}")
    keys = ["point", "overrides", "iteration_time_s", "peak_memory_bytes", "oom", "moe_expert_imbalance",
            "moe_ep_rank_imbalance", "moe_dropped_tokens", "wall_s", "status"]
    print("\t".join(keys))
    for row in rows:
        vals = []
        for k in keys:
            v = row.get(k, "")
            if k == "iteration_time_s" and v:
                v = f"{float(v) * 1e3:.2f} ms"
            elif k == "peak_memory_bytes" and v:
                v = f"{int(float(v)) / 2**20:.1f} MiB"
            elif k.startswith("moe_") and "imbalance" in k and v:
                v = f"{float(v):.3f}"
            vals.append(v)
        print("\t".join(vals))
    return 0 if r.returncode == 0 else r.returncode


if __name__ == "__main__":
    sys.exit(main())
