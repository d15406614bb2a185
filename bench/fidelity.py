"""CPU fidelity harness: real jobs and their predictions side by side, interleaved and repeated.

    python bench/fidelity.py [--ranks 2] [--jobs dense,moe,zero2,zero3] [--pairs 3] [--pairs-large 1]
                             [--iters 8] [--cluster cpu_local] [--compute calibrated] [--repeats 2]
                             [--payload auto] [--no-check]

Cases (``--jobs`` at ``--ranks``): the bundled Megatron recipe, ``examples/megatron_gpt.py`` —
``dense``: tensor-parallel TP2 at 2 ranks, TP2·PP2 at 4, TP2·PP2·DP2 at 8; ``moe``: EP2 at 2
ranks, EP2·DP2 at 4 — and the bundled DeepSpeed recipe, ``examples/deepspeed_gpt.py`` —
``zero2``/``zero3``: ZeRO-2 and ZeRO-3 (``examples/ds_configs/zero{2,3}.json``) data parallel
over 2 or 4 ranks. Each case runs ``--pairs`` pairs (2 ranks) or ``--pairs-large`` pairs (4 and 8) of

* ``mode=real``: every rank for real over gloo; the measured step time is the recipe's own
  ``step_time_ms``, median of the steps after the first; each rank's peak memory
  (``memory.json``, allocator level);
* ``mode=auto`` in a fresh trace directory: capture, then emulate rank 0 as the sandbox; the
  report's global replay on ``--cluster`` gives the predicted iteration time (compute spans:
  ``--compute calibrated``, the default: one member of each shard class re-run for real,
  ``--repeats`` measurements per class, one rank per core, the per-event median given to the
  class — host wall time of the program's compute plus its op calls' host work, so it
  includes what a rank loses to its neighbours, its gloo threads and the machine's load;
  ``--compute cpu``: the capture's per-rank thread CPU time, which does not; ``--compute
  wall``: the capture's wall time, which includes the coordinator's recording on the same
  cores) and every rank's predicted peak (virtual ranks: the capture's peak; the sandbox: its own);
  the capture's payload policy is ``--payload`` (``auto``: ``full`` when calibrating; ``none``
  is faster but its sandbox allocates synthesized results, so its peaks are not the job's);
  ``--network now`` (default) gives the replay
  cpu_local with gloo's per-op overhead, per-hop latency and bandwidth measured just before
  the pair (``bench/gloo_overhead.py``), and each measured kind's own overhead and bandwidth
  (``cluster.kinds``: gloo's all_reduce costs several times its broadcast), ``--network preset`` the preset's,

alternating which of the two goes first. It prints the machine, the load, the cluster and
the compute method, then per case the mean and spread of both times, the real runs' own
spread (the noise the errors are to be read against), the mean signed and absolute error,
the largest error and its spread, and the largest per-rank peak-memory error (predicted
against the real run's same rank). The exit code is 1 when a value is missing or not finite,
or (unless ``--no-check``) when a case misses its goal: every 2-rank case mean |error| <= 5% and
largest |error| <= 10%, and every case 1% peak memory.

Goal and machine: the real run of ``n`` ranks shares this machine's cores; at more ranks than
cores the real step includes time-slicing that the slices (one rank per core) do not, which
the table shows. On a machine shared with other work the real runs' own spread can exceed the
goal; the table prints it beside every row.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_stats import Pair, failures, load, machine, summarize, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "examples" / "megatron_gpt.py"
DEEPSPEED = ROOT / "examples" / "deepspeed_gpt.py"
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4"]
_DS = {stage: [DEEPSPEED, "--deepspeed_config", ROOT / "examples" / "ds_configs" / f"{stage}.json"]
       for stage in ("zero2", "zero3")}
CASES = {  # (job, ranks) -> (parallelism label, recipe and its flags)
    ("dense", 2): ("TP2", [MEGATRON, *MODEL, "--tensor-model-parallel-size", "2"]),
    ("dense", 4): ("TP2·PP2", [MEGATRON, *MODEL, "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2"]),
    ("dense", 8): ("TP2·PP2·DP2", [MEGATRON, *MODEL, "--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2"]),
    ("moe", 2): ("EP2", [MEGATRON, *MODEL, "--expert-model-parallel-size", "2", "--num-experts", "4"]),
    ("moe", 4): ("EP2·DP2", [MEGATRON, *MODEL, "--expert-model-parallel-size", "2", "--num-experts", "4"]),
    ("zero2", 2): ("ZeRO-2 DP2", _DS["zero2"]),
    ("zero2", 4): ("ZeRO-2 DP4", _DS["zero2"]),
    ("zero3", 2): ("ZeRO-3 DP2", _DS["zero3"]),
    ("zero3", 4): ("ZeRO-3 DP4", _DS["zero3"]),
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


NETWORK_SIZES = [1 << 10, 16 << 10, 128 << 10, 512 << 10, 2 << 20]
"""Message sizes the network is measured at before each pair: they span the recipes' own
(tensor-parallel all-reduces of 512 KiB, ZeRO buckets of 8 KiB to a few MiB), so the fitted
bandwidth is that of the messages the jobs send (fitted on 1-256 KiB alone it came out
anywhere from 2 to 54 GB/s, and a 512 KiB all-reduce was priced at half its time)."""
NETWORK_ITERS = 200
"""Timed iterations per op and size, in 10 rounds. gloo's times on a shared 2-core machine are
heavy-tailed (a 1 KiB all-reduce: median 0.2-0.9 ms, one in seven or so stalls ~4 ms), and an op's
cost is the mean: over 20 iterations a single stall moved a size's mean by 0.2 ms and the fitted
all_reduce overhead between 0.37 and 1.9 ms from one pair to the next."""


def network_now() -> tuple[list[str], str]:
    """cpu_local's gloo figures measured now (``bench/gloo_overhead.py``: per-op overhead, per-hop
    latency, bandwidth of all_reduce, all_gather and broadcast between 2 processes, fitted jointly)
    as config overrides, and in words. The machine's load moves them; measured just before
    each prediction, the network model sees the load the real run beside it sees."""
    from gloo_overhead import fit, fit_kinds, kinds_override
    from prism_launch.predict.netbench import run_workers

    measured = run_workers(2, NETWORK_SIZES, NETWORK_ITERS, 3, "gloo", 300.0, rounds=10)
    o, lat, bw = fit(measured, 2)
    kinds = fit_kinds(measured, 2)
    over = [f"cluster.protocol_latency_us={o:.1f}"]
    for link in ("intra_node", "inter_node"):
        over += [f"cluster.{link}.latency_us={lat:.1f}", f"cluster.{link}.bandwidth_gbps={bw:.4f}"]
    if kinds:
        over.append(kinds_override(kinds))
    return over, (f"gloo now: {o:.0f} us/op + {lat:.0f} us/hop, {bw:.2f} GB/s; per kind " +
                  ", ".join(f"{k} {c.latency_us:.0f} us/hop + {c.bandwidth_gbps:.2f} GB/s"
                             for k, c in sorted(kinds.items())))


def predicted(flags: list, job: list, work: Path, cluster: str, compute: str, repeats: int,
              payload: str, network: list[str]) -> tuple[float, dict[int, int]]:
    _run([*flags, "--log-dir", work / "logs", "mode=auto", f"cluster={cluster}", *network,
          f"trace.dir={work / 'trace'}",
          "sandbox.ranks=[0]", f"replay.compute={compute}", f"capture.payload={payload}",
          *(["calibrate.in_auto=true", f"calibrate.repeats={repeats}"] if compute == "calibrated" else []), *job],
         work.parent)
    report = json.loads((work / "trace" / "report" / "report.json").read_text())
    peaks = {int(r): v["peak_memory_bytes"] for r, v in report["ranks"].items() if v.get("peak_memory_bytes")}
    return report["predicted"]["iteration_time_s"], peaks


def run_case(job: str, ranks: int, pairs: int, iters: int, cluster: str, compute: str, repeats: int,
             payload: str, measure_network: bool) -> dict:
    label, recipe = CASES[(job, ranks)]
    work = Path(tempfile.mkdtemp(prefix=f"prism-fidelity-{job}{ranks}-"))
    flags = ["--nproc-per-node", str(ranks), "-r", "3", "device=cpu"]
    args = [*recipe, "--train-iters", str(iters)]
    out = []
    for i in range(pairs):
        network, said = network_now() if measure_network else ([], "cpu_local preset")
        runs = [("real", lambda: real(flags, args, work / f"real{i}")),
                ("pred", lambda: predicted(flags, args, work / f"pred{i}", cluster, compute, repeats, payload,
                                           network))]
        done = dict((name, fn()) for name, fn in (runs if i % 2 == 0 else runs[::-1]))
        out.append(Pair(done["real"][0], done["pred"][0], done["real"][1], done["pred"][1]))
        print(f"  {job} {ranks} ranks pair {i + 1}/{pairs}: real {out[-1].real_step_s * 1e3:.2f} ms, predicted "
              f"{out[-1].predicted_step_s * 1e3:.2f} ms ({out[-1].time_error_pct:+.2f}%); {said}; {load()}",
              flush=True)
    two = ranks == 2
    return summarize(f"{job} {label} ({ranks} ranks)", out, time_goal_pct=5.0 if two else None,
                     time_max_goal_pct=10.0 if two else None, absolute=True, memory_goal_pct=1.0, work=str(work))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2", help="comma-separated; 4 and 8 are the larger (optional) cases")
    ap.add_argument("--jobs", default="dense,moe,zero2,zero3")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved pairs of each 2-rank case")
    ap.add_argument("--pairs-large", type=int, default=1, help="pairs of each 4- and 8-rank case")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--cluster", default="cpu_local")
    ap.add_argument("--compute", default="calibrated", help="replay.compute: calibrated | cpu | wall")
    ap.add_argument("--repeats", type=int, default=2, help="calibrate.repeats: measurements per shard class")
    ap.add_argument("--payload", default="auto",
                    help="capture.payload of the prediction's capture")
    ap.add_argument("--network", default="now", choices=("now", "preset"),
                    help="now: gloo's figures measured before each pair (bench/gloo_overhead.py); preset: cpu_local's")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="exit 1 when a case misses its goal (--no-check: only when a figure is missing)")
    a = ap.parse_args()
    how = {"calibrated": f"one member of each shard class re-run for real, {a.repeats} measurement(s) per class, "
                         "one rank per core, median; host wall time of compute plus op calls' host work",
           "cpu": "the capture's thread CPU time", "wall": "the capture's wall time"}
    print(f"machine: {machine()}; {load()}\ncluster: {a.cluster}; compute spans: replay.compute={a.compute} "
          f"({how.get(a.compute, a.compute)}, measured on this machine's CPU); iterations {a.iters}; "
          f"capture.payload={a.payload}; network: {a.network}", flush=True)
    t0 = time.monotonic()
    rows = []
    for ranks in map(int, a.ranks.split(",")):
        for job in a.jobs.split(","):
            if (job, ranks) in CASES:
                try:
                    rows.append(run_case(job, ranks, a.pairs if ranks == 2 else a.pairs_large, a.iters, a.cluster,
                                         a.compute, a.repeats, a.payload, a.network == "now"))
                except SystemExit as e:  # a failed run: the case's row says so, the others still run
                    print(f"{job} {ranks} ranks: {str(e)[-2000:]}", file=sys.stderr, flush=True)
                    rows.append(summarize(f"{job} {CASES[(job, ranks)][0]} ({ranks} ranks) FAILED", []))
    print(f"\nmachine: {machine()}; {load()}; cluster {a.cluster} (network: {a.network}); compute {a.compute}; "
          f"{(time.monotonic() - t0) / 60:.1f} min")
    print(table([r for r in rows if r["pairs"]]))
    for r in rows:
        if not r["pairs"]:
            print(f"{r['case']}: no pair completed")
    # a value not measured is null in the dump, never a NaN that reads as a number
    print(json.dumps([{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
                      for r in rows], indent=1))
    bad = failures([r if a.check else {**r, "time_goal_pct": None, "time_max_goal_pct": None,
                                        "memory_goal_pct": None} for r in rows])
    for b in bad:
        print(f"FAIL: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
