"""The bundled Megatron recipe on one GPU in large virtual worlds (run where CUDA is).

    python bench/gpu_emulate.py [--jobs dense,moe] [--worlds 64,1024] [--oom-gib 0.25] [--repeat 2]

Per job and world size: a folded capture (ranks context-switched on the one GPU through the
coordinator), then emulation of one sandbox rank on the GPU (device data path: virtual peers' recorded data
prefetched into a device pool, compensation folded there); again with ``emulate.timing=none``
(no virtual peer ever late: the sandbox's own step) for each prefetch mode — ``stream`` (the
default), ``stream-fixed`` (stream within ``pool_mib``, not grown), ``inline`` (within
``pool_mib``, copies issued by the program's thread one op at a time), ``off`` (data moved
when each op is entered) and ``preload`` (everything on the device before the run: no
virtual-peer data movement at all, the reference); and once with
``cluster.gpu_memory_gib`` below the job's need, which must OOM. Prints losses vs the capture,
step times, prefetch statistics, sandbox GPU peak memory, divergences by kind and the
predictions with the cluster and the calibration method the report states, and the GPU it
ran on. Exits 1 when a value is missing (never printed as 0), when losses are not
bit-identical to the capture, when a value divergence appears, or when the OOM run did not
fail with the sandbox out of memory and the virtual ranks predicted to OOM.
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "megatron_gpt.py"
MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "512",
         "--micro-batch-size", "4", "--vocab-size", "8192",
         # every replica trains on the same samples whatever the data-parallel size, so the
         # sandbox's shard sees the same tokens (and MoE routing) at every world size
         "--replicate-data"]
JOBS = {
    "dense": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *MODEL], None),
    # no tensor parallelism: megatron-core's local (non-Transformer-Engine) layer norm refuses
    # sequence parallelism on CUDA, and tensor-parallel MoE layers need it
    "moe": (["--num-experts", "4", "--expert-model-parallel-size", "2", *MODEL], None),
}
MODES = {  # how virtual peers' data moves, as settings
    "stream": ["emulate.prefetch.mode=stream"],  # ahead of the program (the pool grows when the GPU can spare it)
    "stream-fixed": ["emulate.prefetch.mode=stream", "emulate.prefetch.grow=false"],  # within pool_mib only
    "inline": ["emulate.prefetch.mode=inline", "emulate.prefetch.grow=false"],  # copies issued at op entry
    "off": ["emulate.prefetch.mode=off"],
    "preload": ["emulate.prefetch.mode=preload"],
}
_STEP = re.compile(r"step (\d+) \| loss (\S+) .*step_time_ms (\S+)")


def run(args: list, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1800)
    print(f"  [{time.monotonic() - t0:.0f}s] prism-launch {' '.join(map(str, args[:12]))} ... -> {r.returncode}",
          flush=True)
    if ok and r.returncode != 0:
        print(r.stderr[-4000:], flush=True)
        raise SystemExit(1)
    return r


def machine() -> dict:
    """What else the machine was doing as a run started: load, dirty page cache still being
    written back (a capture writes many GiB), the busiest processes and the GPU's clocks."""
    state: dict = {"loadavg": os.getloadavg()}
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        state["dirty_mib"] = int(mem["Dirty"].split()[0]) // 1024
        state["writeback_mib"] = int(mem["Writeback"].split()[0]) // 1024
    except (OSError, KeyError, ValueError):
        pass
    try:  # the busiest processes over one second (top's second frame)
        out = subprocess.run(["top", "-b", "-n", "2", "-d", "1", "-o", "%CPU", "-w", "200"], capture_output=True,
                             text=True, timeout=20).stdout
        frame = out.split("PID USER")[-1].splitlines()[1:5]
        state["busiest"] = [" ".join(line.split()[8:9] + line.split()[11:12]) for line in frame]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,"
                              "utilization.gpu", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout
        state["gpu"] = out.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return state


class Sampler:
    """``machine()`` every few seconds while a run goes on (in the background)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(machine())

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.samples


def steps(log_root: Path, rank: int) -> list[tuple[str, float]]:
    for f in sorted(log_root.glob(f"*/{rank}/stdout.log")):
        found = [(m.group(2), float(m.group(3))) for m in _STEP.finditer(f.read_text())]
        if found:
            return found
    return []


def job(name: str, world: int, work: Path, oom_gib: float | None, modes: list[str], iters: int = 6,
        repeat: int = 1, out_file: str | None = None) -> dict:
    args = [*JOBS[name][0], "--train-iters", str(iters)]
    sandbox = world - 24 if name == "dense" else world - 8  # a last-stage, tensor-rank-0 rank that logs
    out = work / f"{name}-{world}"
    flags = ["--nnodes", world // 8, "--nproc-per-node", 8, "-r", "3", "device=cuda", f"sandbox.ranks=[{sandbox}]",
             f"trace.dir={out / 'trace'}", "comm.timeout_s=900", "capture.fold=true"]
    if (out / "trace" / "manifest.json").exists() and steps(out / "cap", sandbox):  # from an earlier run (--work)
        res = {"job": name, "world": world, "sandbox": sandbox, "capture": f"reused {out / 'trace'}"}
    else:
        cap = run([*flags, "--log-dir", out / "cap", "mode=capture", RECIPE, *args], work)
        m = re.search(r"captured (.*?) in ([\d.]+)s", cap.stderr)
        res = {"job": name, "world": world, "sandbox": sandbox, "capture": m.group(0) if m else None}
    cap_steps = steps(out / "cap", sandbox)

    def emulate(tag: str, extra: list) -> dict:
        for stale in (out / tag, out / f"rep-{tag}"):  # an earlier run's, in a reused --work
            shutil.rmtree(stale, ignore_errors=True)
        before, sampler = machine(), Sampler()
        run([*flags, "--log-dir", out / tag, "mode=emulate", f"report.dir={out / ('rep-' + tag)}", *extra,
             RECIPE, *args], work)
        during = sampler.stop()
        rep = json.loads((out / f"rep-{tag}" / "report.json").read_text())
        summary = json.loads((out / f"rep-{tag}" / "sandbox" / f"rank{sandbox}.json").read_text())
        me = rep["ranks"][str(sandbox)]
        got = steps(out / tag, sandbox)
        pred = rep["predicted"]
        cal = pred.get("calibration") or {}
        return {
            "losses_bit_identical": [a for a, _ in cap_steps] == [a for a, _ in got] and bool(cap_steps),
            "step_ms": statistics.median(t for _, t in got[1:]) if len(got) > 1 else None,
            "steps_ms": [t for _, t in got],
            "sandbox_peak_gib": me["peak_memory_bytes"] / 2**30 if me.get("peak_memory_bytes") is not None else None,
            "predicted_iteration_ms": pred["iteration_time_s"] * 1e3,
            "cluster": pred.get("cluster"),
            "compute": f"{pred.get('compute_source')}: {cal.get('slices')} slice(s), {cal.get('method')}"
            if cal else pred.get("compute_source"),
            "divergences": len(me.get("divergences") or []),
            "divergence_counts": me.get("divergence_counts"),
            # the virtual side's time on the sandbox's thread (ops issued, served, checked), per step
            "own_ms_per_step": summary["own_s"] * 1e3 / max(1, len(got)) if "own_s" in summary else None,
            "prefetch": summary.get("prefetch"),
            "machine": {"before": before, "during": during},
        }

    res["emulate"] = emulate("emu", [])
    _progress(out_file, res)
    for r in range(repeat):  # interleaved, so a drift of the machine hits every mode alike
        for mode in modes:  # no virtual lateness: the sandbox's own step with each way of moving virtual data
            tag = f"none-{mode}" + (f"-{r}" if r else "")
            res[tag] = emulate(tag, ["emulate.timing=none", *MODES[mode]])
            _progress(out_file, {"job": name, "world": world, tag: res[tag]})
    if "preload" in modes:
        def med(mode: str) -> float:
            return statistics.median(t for r in range(repeat)
                                     for t in res[f"none-{mode}" + (f"-{r}" if r else "")]["steps_ms"][1:])
        def runs(mode: str) -> list[float]:  # each run's median step (runs differ more than steps do)
            return [res[f"none-{mode}" + (f"-{r}" if r else "")]["step_ms"] for r in range(repeat)]

        base = med("preload")
        res["median_step_ms"] = {mode: med(mode) for mode in modes}
        res["step_vs_preload"] = {mode: round(med(mode) / base, 4) for mode in modes}
        res["run_medians_ms"] = {mode: runs(mode) for mode in modes}
        res["median_of_runs_vs_preload"] = {
            mode: round(statistics.median(runs(mode)) / statistics.median(runs("preload")), 4) for mode in modes}
    if oom_gib:
        for stale in (out / "oom", out / "rep-oom"):
            shutil.rmtree(stale, ignore_errors=True)
        r = run([*flags, "--log-dir", out / "oom", "mode=emulate", f"cluster.gpu_memory_gib={oom_gib}",
                 f"report.dir={out / 'rep-oom'}", RECIPE, *args], work, ok=False)
        oom_rep = json.loads((out / "rep-oom" / "report.json").read_text()) if (out / "rep-oom" / "report.json").exists() else {}
        res["oom"] = {"exit": r.returncode, "sandbox_oom": bool(oom_rep.get("sandbox_oom")),
                      "predicted_oom_ranks": len((oom_rep.get("predicted") or {}).get("oom_ranks", [])),
                      "limit_gib": oom_gib}
    return res


def problems(res: dict) -> list[str]:
    """What a job's results say went wrong (the bench's exit code)."""
    out = []
    for tag, v in res.items():
        if not isinstance(v, dict) or "losses_bit_identical" not in v:
            continue
        for k in ("step_ms", "sandbox_peak_gib", "predicted_iteration_ms", "own_ms_per_step"):
            if v.get(k) is None:
                out.append(f"{res['job']} {res['world']} {tag}: {k} missing")
        if not v["losses_bit_identical"]:
            out.append(f"{res['job']} {res['world']} {tag}: losses differ from the capture")
        if (v.get("divergence_counts") or {}).get("value"):
            out.append(f"{res['job']} {res['world']} {tag}: {v['divergence_counts']['value']} value divergence(s)")
    oom = res.get("oom")
    if oom is not None and not (oom["exit"] != 0 and oom["sandbox_oom"] and oom["predicted_oom_ranks"] > 0):
        out.append(f"{res['job']} {res['world']}: the run at {oom['limit_gib']} GiB must OOM (sandbox and "
                   f"prediction) but gave {oom}")
    return out


def peak_only(name: str, world: int, work: Path, iters: int) -> dict:
    """Capture and the default emulation only (the sandbox's peak memory at another world size)."""
    return job(name, world, work, None, [], iters)


def _progress(out_file: str | None, res: dict) -> None:
    if out_file:
        with open(out_file, "a") as f:
            f.write(json.dumps({"partial": True, **res}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="dense,moe")
    ap.add_argument("--worlds", default="64,1024")
    ap.add_argument("--oom-gib", type=float, default=0.25)
    ap.add_argument("--modes", default="stream,off,preload", help="prefetch modes timed with emulate.timing=none")
    ap.add_argument("--oom-at", type=int, default=None, help="world size of the OOM run (default: the largest)")
    ap.add_argument("--out", default=None, help="append each result as a JSON line here")
    ap.add_argument("--iters", type=int, default=6, help="training iterations (the first is not timed)")
    ap.add_argument("--repeat", type=int, default=1, help="timed emulations per prefetch mode, interleaved")
    ap.add_argument("--peak-worlds", default="", help="world sizes with only capture + default emulation "
                                                      "(peak memory against the world size)")
    ap.add_argument("--work", default=None, help="working folder; a job's capture found there (same job, world "
                                                   "and --iters) is reused instead of captured again")
    a = ap.parse_args()
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="prism-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    print(f"machine: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}; {machine()}",
          flush=True)
    bad: list[str] = []
    for name in a.jobs.split(","):
        for world in (int(w) for w in a.peak_worlds.split(",") if w):
            res = peak_only(name, world, work, a.iters)
            print(json.dumps(res), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(res) + "\n")
        for world in (int(w) for w in a.worlds.split(",") if w):
            oom_at = a.oom_at if a.oom_at is not None else max(int(w) for w in a.worlds.split(","))
            res = job(name, world, work, a.oom_gib if world == oom_at else None, [m for m in a.modes.split(",") if m],
                      a.iters, a.repeat, a.out)
            print(json.dumps(res), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(res) + "\n")
            bad += problems(res)
    for b in bad:
        print(f"FAIL: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
