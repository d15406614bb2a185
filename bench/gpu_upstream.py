"""Upstream Megatron-LM ``pretrain_gpt.py`` (unchanged) under prism-launch on one GPU: capture,
calibrate, emulate, predict — and the same calibration asked for two ranks per slice, which
the one-rank-per-device rule cuts to one (two ranks sharing the GPU once inflated this job's
prediction 2.5x). Run where CUDA is, with Megatron-LM's training code on PYTHONPATH
(``../shared/tools/gpu-stack.sh`` prepares it; ``source .mlm/activate.sh``).

    python bench/gpu_upstream.py [--world 1024] [--iters 6] [--mlm .mlm] [--out results.jsonl]

Prints per phase its wall time; per calibration the predicted iteration time on
``--cluster`` and how the spans were measured; the ratio of the two predictions; the sandbox
rank's losses against the capture's; divergences; the sandbox's GPU peak. Exits 1 when a phase
fails, a figure is missing, the sandbox's losses differ from the capture's, the calibration
asked for two ranks per slice is not cut to one (no notice) or its prediction is more than
``--ratio-tolerance`` away from the default's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from figures import IS_TRUE, Figure, Goal, report  # noqa: E402
from upstream import pretrain_gpt  # noqa: E402

# 84M-parameter GPT (4 layers, hidden 1024, seq 1024, bf16), TP2·PP2, 4 micro-batches of 2 per replica
MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--micro-batch-size", "2", "--bf16", "--lr", "1e-4",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
         "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--log-interval", "1", "--eval-interval", "1000",
         "--eval-iters", "1"]


def prism(args: list, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    print(f"  [{wall:.0f}s] prism-launch {' '.join(map(str, args[:8]))} ... -> {r.returncode}", flush=True)
    if r.returncode != 0:
        print(r.stderr[-6000:], flush=True)
        raise SystemExit(1)
    return r, wall


def _shown(v, fmt: str = "") -> str:
    return "MISSING" if v is None else format(v, fmt)


def figures(results: dict, ratio_tolerance: float = 0.1) -> list[Figure]:
    """The capture's figures, each calibration's (prediction, sandbox losses equal to the
    capture's, divergences, GPU peak; the two-per-slice one's notice that it was cut to one) and
    each other calibration's prediction over the default's, which must be 1 within the tolerance."""
    out = [Figure("capture s", results.get("capture_s"), fmt=".0f"),
           Figure("trace bytes", results.get("trace_bytes"))]
    near_one = Goal(f"1 ± {ratio_tolerance:g}", lambda v: abs(v - 1) <= ratio_tolerance)
    for label in ("default", "asked_2_per_slice", "slice_size_1"):
        r = results.get(label)
        if r is None:
            continue
        out += [Figure(f"{label} predicted iteration ms", r.get("predicted_iteration_ms"), fmt=".1f"),
                Figure(f"{label} losses match capture", r.get("losses_match_capture"), IS_TRUE),
                Figure(f"{label} divergences", r.get("divergences")),
                Figure(f"{label} sandbox peak bytes", r.get("sandbox_peak_bytes"))]
        if label == "asked_2_per_slice":
            out.append(Figure(f"{label} notice that ranks would share a device", (r.get("notice") or [None])[0]))
        if label != "default":
            out.append(Figure(f"prediction {label} / default", results.get(f"ratio_{label}"), near_one, ".3f"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--cluster", default="h100_ib")
    ap.add_argument("--calibrations", default="default,asked_2_per_slice",
                    help="comma-separated: default, asked_2_per_slice (calibrate.slice_size=2), slice_size_1")
    ap.add_argument("--ratio-tolerance", type=float, default=0.1,
                    help="how far from 1 a calibration's prediction over the default's may be")
    ap.add_argument("--out")
    a = ap.parse_args()
    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    import torch

    work = Path(tempfile.mkdtemp(prefix="prism-upstream-"))
    dp = a.world // 4
    job = [*MODEL, "--global-batch-size", str(2 * 4 * dp), "--train-iters", str(a.iters)]
    sandbox = a.world - 1  # Megatron prints its iteration line on the last rank only
    trace = work / "trace"
    base = ["--nnodes", str(a.world // 8), "--nproc-per-node", "8", "device=cuda", f"sandbox.ranks=[{sandbox}]",
            f"trace.dir={trace}", f"cluster={a.cluster}"]
    results: dict = {"machine": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                     "world": a.world, "cluster": a.cluster, "iters": a.iters}
    print(f"machine: {results['machine']} x {results['gpus']}; cluster {a.cluster}; world {a.world}", flush=True)
    try:
        _r, results["capture_s"] = prism([*base, "mode=capture", script, *job], work)
        results["trace_bytes"] = sum(p.stat().st_size for p in trace.rglob("*") if p.is_file())
        runs = {"default": [], "asked_2_per_slice": ["calibrate.slice_size=2"], "slice_size_1": ["calibrate.slice_size=1"]}
        for label in a.calibrations.split(","):
            extra = runs[label]
            shutil.rmtree(trace / "calibrated", ignore_errors=True)
            r, cal_s = prism([*base, "mode=calibrate", *extra, script, *job], work)
            notice = [line for line in r.stderr.splitlines() if "share a device" in line]
            r, emu_s = prism([*base, "mode=emulate", script, *job], work)
            rep = json.loads((trace / "report" / "report.json").read_text())
            pred, me = rep["predicted"], rep["ranks"][str(sandbox)]
            it = pred.get("iteration_time_s")
            divergences = me.get("divergences")
            results[label] = {
                "calibrate_s": cal_s, "emulate_s": emu_s, "notice": notice,
                "predicted_iteration_ms": None if it is None else it * 1e3, "calibration": pred.get("calibration"),
                "losses": me.get("losses"), "captured_losses": me.get("captured_losses"),
                "losses_match_capture": me.get("losses_match_capture"),
                "divergences": None if divergences is None else len(divergences),
                "sandbox_peak_bytes": me.get("peak_memory_bytes"), "sandbox_step_times_s": me.get("step_times_s"),
            }
            r = results[label]
            print(f"{label}: predicted {_shown(r['predicted_iteration_ms'], '.1f')} ms on {a.cluster} "
                  f"({pred.get('calibration')}); losses match capture: {_shown(r['losses_match_capture'])} "
                  f"({_shown(None if r['losses'] is None else len(r['losses']))} steps); divergences "
                  f"{_shown(r['divergences'])}; sandbox peak {_shown(r['sandbox_peak_bytes'])} B; calibrate "
                  f"{cal_s:.0f}s, emulate {emu_s:.0f}s" + (f"; {notice[0]}" if notice else ""), flush=True)
        print(f"capture {results['capture_s']:.0f}s, trace {results['trace_bytes'] / 2**30:.2f} GiB", flush=True)
        for other in (k for k in runs if k != "default" and k in results and "default" in results):
            mine, base_ms = results[other]["predicted_iteration_ms"], results["default"]["predicted_iteration_ms"]
            ratio = None if not (mine and base_ms) else mine / base_ms
            results[f"ratio_{other}"] = ratio
            print(f"prediction {other} / default = {_shown(ratio, '.3f')}", flush=True)
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=1))
        shutil.rmtree(work, ignore_errors=True)
    return report(figures(results, a.ratio_tolerance))


if __name__ == "__main__":
    sys.exit(main())
