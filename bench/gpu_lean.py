"""A real-size job on one GPU with a lean trace: upstream Megatron-LM ``pretrain_gpt.py``
(unchanged) with a Llama-3-8B shape — 32 layers, hidden 4096, 32 heads in 8 query groups, FFN
14336 (SwiGLU), vocab 128,256, RMSNorm, RoPE, bf16, distributed optimizer, no sequence
parallelism (megatron-core's local layer norm refuses it without Transformer Engine) — in an
8,192-rank world, TP8·PP4 (the folded capture runs the 32 ranks of the sandbox's model
replica), one sandbox rank, ``capture.payload=none``: capture, then emulation and report.

    source .mlm/activate.sh && python bench/gpu_lean.py [--seq 4096] [--iters 3] [--slots 4]

Prints: the trace's size (and per rank-step), capture wall time and seconds per iteration
(Megatron's own "elapsed time per iteration" of the captured last rank, and the capture's wall
time over iterations), the admission by memory (peaks measured, most ranks on the card at
once), the launcher's host peak, the sandbox's GPU peak, the predicted iteration time on
``--cluster`` and the OOM verdict at its memory (80 GiB for h100_ib). Exits non-zero when a
phase fails or a figure is missing (printed as MISSING, never as a default).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from figures import Figure, report  # noqa: E402
from upstream import pretrain_gpt  # noqa: E402


SHAPES = {  # layers, hidden, heads, query groups, FFN, vocab
    "llama8b": ("32", "4096", "32", "8", "14336", "128256"),
    "small": ("4", "1024", "16", "8", "4096", "32000"),  # a quick check of the same path
}


def llama8b(seq: int, tp: int, pp: int, world: int, iters: int, micro_batches: int, shape: str = "llama8b") -> list[str]:
    dp = world // (tp * pp)
    layers, hidden, heads, groups, ffn, vocab = SHAPES[shape]
    return ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads, "--group-query-attention",
            "--num-query-groups", groups, "--ffn-hidden-size", ffn, "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
            "--global-batch-size", str(dp * micro_batches), "--train-iters", str(iters), "--bf16", "--lr", "1e-4",
            "--use-distributed-optimizer", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", vocab, "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-swiglu-fusion", "--log-interval", "1",
            "--eval-interval", "100000", "--eval-iters", "0"]


def keep_trace(trace: Path, dest: Path) -> Path | None:
    """``trace`` (bare and calibrated: manifests, events, fold plan, kernel lists and the
    stored tensors, a few MiB under ``payload=none``) as ``dest`` (a .tar.gz), for a look (a
    replay under other settings) after the device is gone."""
    import tarfile

    if not trace.is_dir():
        return None
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(trace, arcname="trace")
    return dest


STACKS = Path(__file__).resolve().parent / "stack_sampler"


def prism(args: list, cwd: Path, timeout: float, *, stacks: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Run prism-launch; with ``stacks``, every process it starts samples its threads' stacks
    into that folder (``bench/stack_sampler``; ``bench/stack_summary.py`` prints them)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if stacks is not None:
        env["PRISM_STACK_SAMPLES"] = str(stacks)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STACKS), env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "prism_launch", *map(str, args)], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(f"  prism-launch timed out after {timeout:.0f}s; its stderr ends:\n{err[-5000:]}", flush=True)
        given = [str(b) for a, b in zip(args, args[1:]) if str(a) == "--log-dir"]
        logdir = Path(given[0]) if given else Path(cwd) / "cap-logs"
        logs = sorted(logdir.glob("*/*/stdout.log"))
        for log in logs[-3:]:
            print(f"  --- {log}:\n{log.read_text()[-1500:]}", flush=True)
        for log in sorted(logdir.glob("*/*/stderr.log"))[-4:]:
            text = log.read_text(errors="replace").strip()
            if text:
                print(f"  --- {log}:\n{text[-1200:]}", flush=True)
        raise SystemExit(1) from None
    wall = time.monotonic() - t0
    print(f"  [{wall:.0f}s] prism-launch ... {' '.join(str(a) for a in args if str(a).startswith('mode='))} "
          f"-> {r.returncode}", flush=True)
    for line in r.stderr.splitlines():
        if line.startswith("prism-launch:"):
            print("   ", line[:300], flush=True)
    if r.returncode != 0:
        print(r.stderr[-8000:], flush=True)
        raise SystemExit(1)
    return r, wall


def iteration_ms(log: Path) -> list[float]:
    """Megatron's own "elapsed time per iteration (ms)" lines of one rank's log."""
    if not log.exists():
        return []
    return [float(m.group(1)) for m in re.finditer(r"elapsed time per iteration \(ms\): ([0-9.]+)", log.read_text())]


def need(value, what: str):
    if value is None:
        print(f"missing: {what}", file=sys.stderr)
        raise SystemExit(1)
    return value


def figures(res: dict) -> list[Figure]:
    """Every figure the bench prints, from its results (``res``); the OOM verdict is a figure
    too: the ranks that would not fit, or "none" when the report says none (not when it is silent)."""
    adm = res.get("admission") or {}
    peaks = sorted({round(v / 2**30, 2) for v in (adm.get("measured_peaks") or {}).values()})
    oom = res.get("oom_ranks")
    return [Figure("trace bytes", res.get("trace_bytes")),
            Figure("captured ranks", res.get("captured_ranks")),
            Figure("trace KiB per rank-step", None if res.get("trace_bytes_per_rank_step") is None
                   else res["trace_bytes_per_rank_step"] / 1024, fmt=".1f"),
            Figure("capture s", res.get("capture_s"), fmt=".0f"),
            Figure("capture s per iteration", res.get("capture_wall_s_per_iteration"), fmt=".1f"),
            Figure("Megatron ms per iteration in capture", res.get("capture_megatron_ms_per_iteration")),
            Figure("most ranks on the card at once", adm.get("max_admitted")),
            Figure("measured peaks GiB", peaks),
            Figure("launcher host peak GiB", None if res.get("launcher_peak_rss_bytes") is None
                   else res["launcher_peak_rss_bytes"] / 2**30, fmt=".2f"),
            Figure("emulation s", res.get("emulate_s"), fmt=".0f"),
            Figure("sandbox GPU peak GiB", None if res.get("sandbox_peak_bytes") is None
                   else res["sandbox_peak_bytes"] / 2**30, fmt=".3f"),
            Figure("Megatron ms per iteration in emulation", res.get("emulate_megatron_ms_per_iteration")),
            Figure("predicted iteration ms", res.get("predicted_iteration_ms"), fmt=".1f"),
            Figure("largest rank peak GiB", None if res.get("max_rank_peak_bytes") is None
                   else res["max_rank_peak_bytes"] / 2**30, fmt=".2f"),
            Figure("OOM ranks at the cluster's memory", None if oom is None else (oom[:8] or "none"))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="llama8b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--world", type=int, default=8192)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--slots", type=int, default=4, help="captured ranks computing at once (admitted by memory)")
    ap.add_argument("--cluster", default="h100_ib")
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--timeout", type=float, default=560.0, help="seconds for capture + emulation together")
    ap.add_argument("--out")
    a = ap.parse_args()
    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    import torch

    tp, pp = 8, 4
    work = Path(tempfile.mkdtemp(prefix="prism-lean-"))
    trace = work / "trace"
    sandbox = a.world - 1  # Megatron prints its iteration line on the last rank only
    job = llama8b(a.seq, tp, pp, a.world, a.iters, a.micro_batches, a.shape)
    base = ["--nnodes", str(a.world // 8), "--nproc-per-node", "8", "device=cuda", f"sandbox.ranks=[{sandbox}]",
            f"trace.dir={trace}", f"cluster={a.cluster}", "capture.payload=none", f"capture.slots={a.slots}",
            "comm.timeout_s=600", "launch.progress=true"]
    res: dict = {"machine": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "world": a.world,
                 "layout": f"TP{tp}·PP{pp}", "seq": a.seq, "iters": a.iters, "cluster": a.cluster,
                 "model": "Llama-3-8B shape" if a.shape == "llama8b" else f"{a.shape} shape"}
    print(f"{res['machine']}: {res['model']}, seq {a.seq}, {a.world} ranks {res['layout']}, sandbox {sandbox}, "
          f"{a.iters} iterations, payload none, cluster {a.cluster}", flush=True)
    t_start = time.monotonic()
    try:
        _r, res["capture_s"] = prism([*base, "--log-dir", work / "cap-logs", "mode=capture", script, *job], work,
                                     a.timeout)
        files = [p for p in trace.rglob("*") if p.is_file()]
        res["trace_bytes"] = sum(p.stat().st_size for p in files)
        manifest = json.loads((trace / "manifest.json").read_text())
        stats = json.loads((trace / "capture.json").read_text())
        ranks = len(manifest["ranks_captured"])
        res["captured_ranks"] = ranks
        res["trace_bytes_per_rank_step"] = res["trace_bytes"] / (ranks * a.iters)
        res["launcher_peak_rss_bytes"] = need(stats.get("launcher_peak_rss_bytes"), "launcher peak RSS")
        res["admission"] = stats.get("admission")
        logs = sorted((work / "cap-logs").glob(f"*/{sandbox}/stdout.log"))
        per_iter = iteration_ms(logs[0]) if logs else []
        res["capture_megatron_ms_per_iteration"] = per_iter
        res["capture_wall_s_per_iteration"] = stats["wall_s"] / a.iters
        left = a.timeout - (time.monotonic() - t_start)
        _r, res["emulate_s"] = prism([*base, "--log-dir", work / "emu-logs", "mode=emulate",
                                      f"report.dir={work / 'report'}", script, *job], work, max(60.0, left))
        rep = json.loads((work / "report" / "report.json").read_text())
        pred, me = rep["predicted"], rep["ranks"][str(sandbox)]
        res["predicted_iteration_ms"] = need(pred.get("iteration_time_s"), "predicted iteration time") * 1e3
        res["calibration"] = pred.get("calibration")
        res["oom_ranks"] = pred.get("oom_ranks")
        res["gpu_memory_gib"] = rep.get("cluster", {}).get("gpu_memory_gib") if isinstance(rep.get("cluster"), dict) \
            else None
        res["sandbox_peak_bytes"] = need(me.get("peak_memory_bytes"), "sandbox GPU peak")
        res["sandbox_step_times_s"] = me.get("step_times_s")
        res["synthesized_ops"] = me.get("synthesized")
        peaks = {int(r): v.get("peak_memory_bytes") for r, v in rep["ranks"].items() if v.get("peak_memory_bytes")}
        res["max_rank_peak_bytes"] = max(peaks.values()) if peaks else None
        emu_iter = iteration_ms(next(iter(sorted((work / "emu-logs").glob(f"*/{sandbox}/stdout.log"))), Path("-")))
        res["emulate_megatron_ms_per_iteration"] = emu_iter
    finally:
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1, default=str))
        shutil.rmtree(work, ignore_errors=True)
    f = {x.name: x.shown() for x in figures(res)}
    oom = f["OOM ranks at the cluster's memory"]
    print(f"trace: {_mib(res.get('trace_bytes'))} MiB for {f['captured ranks']} captured ranks x {a.iters} steps "
          f"({f['trace KiB per rank-step']} KiB per rank-step)")
    print(f"capture: {f['capture s']}s wall; {f['capture s per iteration']}s of capture per "
          f"iteration (all {f['captured ranks']} ranks); Megatron's own time per iteration on rank {sandbox}: "
          f"{_ms(res.get('capture_megatron_ms_per_iteration'))} ms; "
          f"most ranks on the card at once {f['most ranks on the card at once']}, measured peaks "
          f"{f['measured peaks GiB']} GiB")
    print(f"launcher host peak: {f['launcher host peak GiB']} GiB")
    print(f"emulation: {f['emulation s']}s; sandbox rank {sandbox} GPU peak {f['sandbox GPU peak GiB']} GiB; "
          f"Megatron's time per iteration {_ms(res.get('emulate_megatron_ms_per_iteration'))} ms")
    print(f"predicted iteration time on {a.cluster}: {f['predicted iteration ms']} ms "
          f"({res.get('calibration') or 'bare capture spans'}); largest rank peak {f['largest rank peak GiB']} GiB; "
          f"OOM ranks at the cluster's memory: {oom}")
    return report(figures(res))


def _mib(b) -> str:
    return "MISSING" if b is None else f"{b / 2**20:.2f}"


def _ms(xs) -> str:
    return ", ".join(f"{x:.0f}" for x in xs) if xs else "MISSING"


if __name__ == "__main__":
    sys.exit(main())
