"""Exact traces of upstream Megatron-LM ``pretrain_gpt.py`` (unchanged) on one GPU: the 84M dense
TP2·PP2 job and the MoE PP2·EP2 job at 1,024 ranks, sandbox rank 1023, ``capture.payload=exact``
(only what the sandbox consumes is stored), capture then emulation.

    source .mlm/activate.sh && python bench/gpu_exact.py [--jobs dense,moe] [--slots N] [--measure-full] [--out r.json]

Prints per job: the trace's size (all files, and tensor files alone) and, with ``--measure-full``,
the tensor bytes of a ``capture.payload=full`` capture of the same job measured in the same run
and the exact trace's share of them, capture wall time, Megatron's own time per iteration on rank 1023 while capturing
against its time per iteration in the emulation (the job's step on this GPU), the sandbox's
losses against the capture's, divergences by kind (value / tolerance / host scalar), the
sandbox's GPU peak and the predicted iteration time. Exits 1 when a phase fails, a figure is
missing (printed as MISSING), the losses differ or a value divergence is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from figures import IS_TRUE, Figure, equals, report  # noqa: E402
from gpu_lean import iteration_ms, prism  # noqa: E402
from upstream import MODEL_84M, pretrain_gpt  # noqa: E402

MODEL = MODEL_84M
JOBS = {  # name: (parallel layout flags, model-parallel ranks per replica, steps)
    "dense": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4, 8),
    # no tensor parallelism: megatron-core's local layer norm refuses sequence parallelism on CUDA,
    # and tensor-parallel MoE layers need it; no linear biases: with one tensor-parallel rank the
    # experts' in-place bias add on their reduction's output is refused by autograd (under torchrun too)
    "moe": (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--num-experts", "4",
             "--moe-router-topk", "2", "--disable-bias-linear"], 2, 6),
}


DEVICE = "cuda"


def median_after_first(xs: list[float]) -> float | None:
    return statistics.median(xs[1:]) if len(xs) > 1 else None


def blocked_seconds(trace: Path, since_unit: int = 0) -> tuple[dict[int, float], dict[int, dict[str, list]]]:
    """Each captured rank's seconds blocked in waits on its ops (the trace's ``wait`` events of
    steps ``since_unit`` on), in
    all and by what it waited on: ``<c|s|r>:<group desc>(<size>)`` -> [seconds, waits, seconds
    before the op completed at the coordinator (its peers still to come), seconds after (the
    rank computing its result from the exchange, being resumed)]."""
    from prism_launch.trace import TraceReader

    reader = TraceReader(trace)
    groups = {g["id"]: f"{g.get('desc') or g['id']}({len(g.get('ranks') or [])})" for g in reader.manifest.groups}
    rows = reader.events().to_pylist()
    done = {(r["rank"], r["group"], r["seq"]): r["t_end"] for r in rows if r["kind"] == "collective"}
    out: dict[int, float] = {}
    by: dict[int, dict[str, list]] = {}
    for row in rows:
        if row["kind"] == "wait" and row["extra"] and row["unit"] >= since_unit:
            extra = json.loads(row["extra"])
            b = extra.get("blocked_s") or 0.0
            out[row["rank"]] = round(out.get(row["rank"], 0.0) + b, 3)
            cell = by.setdefault(row["rank"], {}).setdefault(f"{extra.get('ref')}:{groups.get(row['group'], row['group'])}",
                                                             [0.0, 0, 0.0, 0.0])
            cell[0] = round(cell[0] + b, 3)
            cell[1] += 1
            end = done.get((row["rank"], row["group"], row["seq"])) if extra.get("ref") == "c" else None
            if b and end is not None:
                before = min(b, max(0.0, end - row["t_start"]))
                cell[2] = round(cell[2] + before, 3)
                cell[3] = round(cell[3] + b - before, 3)
    return out, by


class GpuUtil:
    """``nvidia-smi``'s GPU utilization every 100 ms while a phase runs (``--gpu-util``): whether
    a capture's steps are bound by the card (near 100%) or by its ranks' host-side waits."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-lms", "100"], stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[int]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return [int(x) for x in out.split() if x.isdigit()]


def step_timeline(trace: Path, since_unit: int, show_unit: int, show_ranks: tuple[int, ...], rows: int = 60) -> dict:
    """Where each captured rank's steps go, from the trace's events of steps ``since_unit`` on:
    per step, the program's own time between ops (the events' compute spans), time blocked in
    waits, and the rest (issuing ops: staging contributions, messages). Then, for ``show_ranks``,
    the first ``rows`` events of step ``show_unit`` (ms from the step's first event): kind, group,
    seq, start, end, the compute span before it."""
    from prism_launch.trace import TraceReader

    reader = TraceReader(trace)
    desc = {g["id"]: (g.get("desc") or str(g["id"]))[:12] + f"({len(g.get('ranks') or [])})" for g in reader.manifest.groups}
    ev = reader.events().to_pylist()
    out: dict = {"per_step": {}, "rows": {}}
    by_rank: dict[int, list] = {}
    for e in ev:
        by_rank.setdefault(e["rank"], []).append(e)
    for rank, es in sorted(by_rank.items()):
        steady = [e for e in es if e["unit"] >= since_unit]
        if not steady:
            continue
        units = sorted({e["unit"] for e in steady})
        span = max(e["t_end"] for e in steady) - min(e["t_start"] for e in steady)
        program = sum(e["compute_wall_s"] or 0.0 for e in steady)
        program_cpu = sum(e["compute_cpu_s"] or 0.0 for e in steady)
        # program spans whose wall time exceeds their CPU time by more than 1 ms: the program's
        # thread did not run (the GIL, the scheduler, a synchronizing CUDA call)
        stalled = [(e["compute_wall_s"] or 0.0) - (e["compute_cpu_s"] or 0.0) for e in steady]
        stalled = [x for x in stalled if x > 1e-3]
        blocked = sum((json.loads(e["extra"]).get("blocked_s") or 0.0) for e in steady if e["kind"] == "wait" and e["extra"])
        n = len(units)
        out["per_step"][rank] = {"step_ms": round(1e3 * span / n, 1), "program_ms": round(1e3 * program / n, 1),
                                 "program_cpu_ms": round(1e3 * program_cpu / n, 1),
                                 "stalled_spans": round(len(stalled) / n, 1), "stalled_ms": round(1e3 * sum(stalled) / n, 1),
                                 "blocked_ms": round(1e3 * blocked / n, 1),
                                 "rest_ms": round(1e3 * (span - program - blocked) / n, 1), "events": len(steady) // n}
        starts = {u: min(e["t_start"] for e in steady if e["unit"] == u) for u in units}
        waits = [(json.loads(e["extra"]).get("blocked_s") or 0.0, e) for e in steady if e["kind"] == "wait" and e["extra"]]
        out["per_step"][rank]["top_waits"] = [
            (round(1e3 * b, 1), desc.get(e["group"], "-"), e["seq"], e["unit"], round(1e3 * (e["t_start"] - starts[e["unit"]]), 1))
            for b, e in sorted(waits, key=lambda x: -x[0])[:8]]
        if rank in show_ranks:
            shown = [e for e in es if e["unit"] == show_unit][:rows]
            if shown:
                t0 = shown[0]["t_start"]
                out["rows"][rank] = [(e["kind"][:4], desc.get(e["group"], "-"), e["seq"], round(1e3 * (e["t_start"] - t0), 2),
                                      round(1e3 * (e["t_end"] - t0), 2), round(1e3 * (e["compute_wall_s"] or 0.0), 2),
                                      round(1e3 * (e["compute_cpu_s"] or 0.0), 2))
                                     for e in shown]
    return out


def run_job(name: str, script: Path, world: int, cluster: str, slots: int | None, timeout: float,
            stacks: Path | None = None, capture_only: bool = False, gpu_util: bool = False,
            overrides: tuple[str, ...] = (), payload: str = "exact") -> dict:
    layout, mp, steps = JOBS[name]
    dp = world // mp
    job = [*MODEL, *layout, "--global-batch-size", str(2 * 4 * dp), "--train-iters", str(steps)]
    sandbox = world - 1  # Megatron prints its iteration line on the last rank only
    work = Path(tempfile.mkdtemp(prefix=f"prism-exact-{name}-"))
    trace = work / "trace"
    base = ["--nnodes", str(world // 8), "--nproc-per-node", "8", f"device={DEVICE}", f"sandbox.ranks=[{sandbox}]",
            f"trace.dir={trace}", f"cluster={cluster}", f"capture.payload={payload}",
            *([f"capture.slots={slots}"] if slots is not None else []), *overrides]
    res: dict = {"job": name, "world": world, "steps": steps, "sandbox": sandbox, "payload_policy": payload}
    try:
        util = GpuUtil() if gpu_util else None
        try:
            _r, res["capture_s"] = prism([*base, "--log-dir", work / "cap-logs", "mode=capture", script, *job], work,
                                          timeout, stacks=None if stacks is None else stacks / name)
        finally:
            if util is not None:
                res["gpu_util"] = util.stop()
        files = [p for p in trace.rglob("*") if p.is_file()]
        res["trace_bytes"] = sum(p.stat().st_size for p in files)
        res["tensor_bytes"] = sum(p.stat().st_size for p in files if "tensors" in p.parts)
        stats = json.loads((trace / "capture.json").read_text())
        res["captured_ranks"] = len(json.loads((trace / "manifest.json").read_text())["ranks_captured"])
        res["capture_stats"] = {k: stats.get(k) for k in ("wall_s", "slots", "max_running", "resumes", "parking_off_after_s",
                                                          "launcher_peak_rss_bytes", "coordinator_busy_s", "coordinator_lags", "writer_busy_s",
                                                          "coordinator_waited_for_writer_s", "rank_busy_s")}
        res["blocked_s"], res["blocked_by_op"] = blocked_seconds(trace)
        res["steady_from"] = min(3, steps - 1)
        res["steady_blocked_s"], res["steady_blocked_by_op"] = blocked_seconds(trace, res["steady_from"])
        res["timeline"] = step_timeline(trace, res["steady_from"], steps - 2, (world - 1, world // 2 - 2))
        logs = sorted((work / "cap-logs").glob(f"*/{sandbox}/stdout.log"))
        res["capture_ms_per_iteration"] = iteration_ms(logs[0]) if logs else []
        if capture_only:
            return res
        _r, res["emulate_s"] = prism([*base, "--log-dir", work / "emu-logs", "mode=emulate",
                                      f"report.dir={work / 'report'}", script, *job], work, timeout)
        rep = json.loads((work / "report" / "report.json").read_text())
        me = rep["ranks"][str(sandbox)]
        logs = sorted((work / "emu-logs").glob(f"*/{sandbox}/stdout.log"))
        res["emulate_ms_per_iteration"] = iteration_ms(logs[0]) if logs else []
        res["losses"], res["captured_losses"] = me.get("losses"), me.get("captured_losses")
        res["losses_match_capture"] = me.get("losses_match_capture")
        res["divergence_counts"] = me.get("divergence_counts")
        res["divergences"] = (me.get("divergences") or [])[:5]
        res["sandbox_peak_bytes"] = me.get("peak_memory_bytes")
        it = rep["predicted"].get("iteration_time_s")
        res["predicted_iteration_ms"] = None if it is None else it * 1e3
        res["payload"] = rep.get("payload")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def show_blocked(r: dict, top: int, steady: bool = False) -> None:
    """Print each rank's blocked seconds: in all, then its ``top`` ops and groups by seconds
    (``steady``: per step, over the steps from ``steady_from`` on)."""
    if not steady:
        print(f"  ranks' seconds blocked in waits {r.get('blocked_s')}")
        show_blocked(r, top, steady=True)
    key = "steady_blocked_by_op" if steady else "blocked_by_op"
    if steady:
        n = max(1, r["steps"] - r["steady_from"])
        print(f"  per step from step {r['steady_from']} on ({n} steps), seconds blocked: "
              f"{ {k: round(v / n, 3) for k, v in (r.get('steady_blocked_s') or {}).items()} } (totals over those steps below)")
    for rank, cells in sorted((r.get(key) or {}).items()):
        most = sorted(cells.items(), key=lambda kv: -kv[1][0])[:top]
        print(f"    rank {rank} blocked on: " + ", ".join(
            f"{k} {v[0]:.2f}s/{v[1]}" + (f" ({v[2]:.2f}s before the op completed, {v[3]:.2f}s after)" if k[0] == "c" else "")
            for k, v in most))


def show_capture(r: dict) -> None:
    """Print a job's capture figures (``--capture-only``)."""
    print(f"{r['job']}: {r['captured_ranks']} captured ranks x {r['steps']} steps; trace {r['trace_bytes'] / 1e9:.2f} GB")
    print(f"  capture {r['capture_s']:.0f}s ({r['capture_stats']}); Megatron per iteration in capture "
          f"{[round(x) for x in r['capture_ms_per_iteration']]} ms")
    show_blocked(r, 4)
    show_util(r)
    show_timeline(r)


def show_timeline(r: dict) -> None:
    t = r.get("timeline") or {}
    for rank, v in sorted((t.get("per_step") or {}).items()):
        print(f"  rank {rank} per step (steady): {v}")
    for rank, rows in sorted((t.get("rows") or {}).items()):
        print(f"  rank {rank}, one step's events (kind group seq start end span-before its-cpu, ms): "
              + "; ".join(" ".join(str(x) for x in row) for row in rows))


def show_util(r: dict) -> None:
    u = r.get("gpu_util")
    if u:
        tail = u[-150:]
        print(f"  GPU utilization (%) over the capture's last {len(tail) / 10:.0f}s, 0.5s means: "
              f"{[round(statistics.mean(tail[i:i + 5])) for i in range(0, len(tail), 5)]}")


def figures(r: dict) -> list[Figure]:
    """One job's figures: sizes (and the exact trace's share of a full capture's tensors, when
    ``full_tensor_bytes`` was measured), times, the sandbox's losses equal to the capture's, no
    value divergence, its GPU peak and the prediction. ``divergence_counts`` absent: missing;
    present, a kind it does not name had none."""
    j, c = r["job"], r.get("divergence_counts")
    cap, emu = median_after_first(r.get("capture_ms_per_iteration") or []), \
        median_after_first(r.get("emulate_ms_per_iteration") or [])
    full = r.get("full_tensor_bytes")
    out = [Figure(f"{j} trace GB", None if r.get("trace_bytes") is None else r["trace_bytes"] / 1e9, fmt=".2f"),
           Figure(f"{j} tensors GB", None if r.get("tensor_bytes") is None else r["tensor_bytes"] / 1e9, fmt=".2f")]
    if "full_tensor_bytes" in r:
        out += [Figure(f"{j} full capture's tensors GB", None if full is None else full / 1e9, fmt=".1f"),
                Figure(f"{j} exact / full tensors", None if not (full and r.get("tensor_bytes") is not None)
                       else r["tensor_bytes"] / full, fmt=".3f")]
    out += [Figure(f"{j} capture s", r.get("capture_s"), fmt=".0f"),
            Figure(f"{j} capture / job step (medians after the first)", None if not (cap and emu) else cap / emu,
                   fmt=".1f"),
            Figure(f"{j} losses match the capture", r.get("losses_match_capture"), IS_TRUE),
            Figure(f"{j} value divergences", None if c is None else c.get("value", 0), equals(0)),
            Figure(f"{j} tolerance divergences", None if c is None else c.get("tolerance", 0)),
            Figure(f"{j} host scalar divergences", None if c is None else c.get("host_scalar", 0)),
            Figure(f"{j} sandbox GPU peak bytes", r.get("sandbox_peak_bytes")),
            Figure(f"{j} predicted iteration ms", r.get("predicted_iteration_ms"), fmt=".1f"),
            Figure(f"{j} emulation s", r.get("emulate_s"), fmt=".0f")]
    return out


def show(r: dict) -> list[Figure]:
    """Print one job's figures; returns them (:func:`figures`) for the exit code."""
    figs = figures(r)
    f = {x.name.removeprefix(f"{r['job']} "): x.shown() for x in figs}
    full = f.get("full capture's tensors GB")
    share = f"; = {f['exact / full tensors']} of the full capture's {full} GB" if full is not None else ""
    print(f"{r['job']}: {r['captured_ranks']} captured ranks x {r['steps']} steps; trace {f['trace GB']} GB "
          f"(tensors {f['tensors GB']} GB{share})")
    ratio = f["capture / job step (medians after the first)"]
    print(f"  capture {f['capture s']}s ({r['capture_stats']}); Megatron per iteration in capture "
          f"{[round(x) for x in r['capture_ms_per_iteration']]} ms, in emulation "
          f"{[round(x) for x in r.get('emulate_ms_per_iteration') or []]} ms; capture / job step (medians after the "
          f"first) {ratio if ratio == 'MISSING' else ratio + 'x'}")
    show_blocked(r, 6)
    show_util(r)
    show_timeline(r)
    print(f"  losses match the capture: {f['losses match the capture']} ({len(r.get('losses') or [])} steps); "
          f"divergences by kind: value {f['value divergences']}, tolerance {f['tolerance divergences']}, host scalar "
          f"{f['host scalar divergences']}; sandbox GPU peak {f['sandbox GPU peak bytes']} B; predicted "
          f"{f['predicted iteration ms']} ms; emulation {f['emulation s']}s")
    if r.get("divergences"):
        print(f"  first divergences: {r['divergences'][:2]}")
    return figs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="dense,moe")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--cluster", default="h100_ib")
    ap.add_argument("--slots", type=int, default=None, help="capture.slots (default: the launcher's)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds for each prism-launch run")
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--out")
    ap.add_argument("--stacks", type=Path, default=None,
                    help="sample the capture's processes' stacks into this folder (bench/stack_summary.py prints them)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further prism-launch override for both phases (repeatable)")
    ap.add_argument("--gpu-util", action="store_true", help="sample nvidia-smi's GPU utilization during the captures")
    ap.add_argument("--capture-only", action="store_true", help="capture and print its figures; no emulation")
    ap.add_argument("--measure-full", action="store_true",
                    help="also capture each job with capture.payload=full and print the exact trace's share of its tensors")
    a = ap.parse_args()
    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    import torch

    print(f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}; "
          f"upstream pretrain_gpt.py, {a.world} ranks, payload exact, cluster {a.cluster}", flush=True)
    results, figs = [], []
    try:
        for name in a.jobs.split(","):
            results.append(run_job(name, script, a.world, a.cluster, a.slots, a.timeout, a.stacks, a.capture_only,
                                   a.gpu_util, tuple(a.set)))
            if a.measure_full:
                full = run_job(name, script, a.world, a.cluster, a.slots, a.timeout, capture_only=True,
                               overrides=tuple(a.set), payload="full")
                results[-1]["full_tensor_bytes"] = full.get("tensor_bytes")
            if a.capture_only:
                show_capture(results[-1])
            else:
                figs += show(results[-1])
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1, default=str))
    return report(figs) if figs else 0


if __name__ == "__main__":
    sys.exit(main())
