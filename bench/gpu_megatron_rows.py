"""Megatron-LM README's weak-scaling rows, predicted from one GPU on an H100 cluster (h100_ib).

    source .mlm/activate.sh && python bench/gpu_megatron_rows.py [--rows 1.7b,7.1b] [--factor F --kernel-factor K]

Published (Megatron-LM ``images/model_table.png``, measured with Transformer Engine on H100s):

    1.7B  24 layers, hidden 2048, 16 heads, TP1, 48 GPUs, global batch 192, seq 4096, vocab 131,072: 408.8 TFLOP/s/GPU
    7.1B  30 layers, hidden 4096, 32 heads, TP2, 96 GPUs, global batch 192:                           465.9 TFLOP/s/GPU

Flags assumed where the table is silent: micro-batch 1, FFN 4h with GeLU, LayerNorm, learned
positions, bf16, no recompute, distributed optimizer with ``--overlap-grad-reduce
--overlap-param-gather``, no sequence parallelism (megatron-core's local layer norm refuses it).
Each row runs upstream ``pretrain_gpt.py`` unchanged under ``prism-launch`` at the row's world
size, ``mode=auto`` (capture with ``payload=none``, folded at both sizes: 48 ranks is under
``capture.fold_threshold``; calibration by shard class, emulation of the last rank), then the
same calibrated trace is replayed again with
``replay.compute_speedup`` = the implementation factor of ``bench/gpu_layer_factor.py`` (local
layers against torch-native SDPA + compiled ones: what Transformer Engine buys the published
runs), and once more as ``bench/gpu_predict8b.py`` judges its what-if: ``replay.host_gaps=removed``
(each shard class's spans cut to their profiled kernel share) with the compute divided by the
layers' kernel-time factor (local against the native layer replayed from a CUDA graph, the
geometric mean over the README shapes). TFLOP/s per GPU: the step's FLOPs as Megatron-LM counted them when the table was made
(attention's full square; today's ``num_floating_point_operations`` halves it for the causal
mask, also printed) over the predicted iteration time. Prints raw and adjusted errors per row; goal:
the host-kept-up adjusted error within 10% (the eager-factor one printed beside it).
Exits non-zero when a figure is missing or misses its goal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from figures import Figure, at_most, report  # noqa: E402

ROWS = {  # layers, hidden, heads, TP, GPUs, global batch, published TFLOP/s per GPU
    "1.7b": (24, 2048, 16, 1, 48, 192, 408.8),
    "7.1b": (30, 4096, 32, 2, 96, 192, 465.9),
}
SOURCE = "NVIDIA/Megatron-LM README, images/model_table.png (weak scaling, H100)"
DIFFERS = ("published: Transformer Engine (fused attention and layers), H100 SXM, Megatron-LM of its date; "
           "here: megatron-core 0.19 local layers (unfused attention softmax, no flash), measured on the GPU each "
           "row names and scaled to the cluster's GPU by the kernel mix where they differ")


def job(row: str, iters: int) -> list[str]:
    layers, hidden, heads, tp, _gpus, gbs, _pub = ROWS[row]
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
            "--global-batch-size", str(gbs), "--train-iters", str(iters), "--bf16", "--lr", "1e-4",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--tensor-model-parallel-size", str(tp), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "131072", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-persist-layer-norm", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0"]


def table_flops(row: str) -> float:
    """One step's FLOPs as Megatron-LM counted them when the table was measured (2024: attention's
    full square, before its formula halved it for the causal mask): 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))."""
    layers, h, _heads, _tp, _gpus, gbs, _pub = ROWS[row]
    s, v = 4096, 131072
    return 72 * gbs * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def repredict(trace: Path, overrides: list[str]) -> float | None:
    """The calibrated trace replayed again in this process under ``overrides``: its iteration time."""
    from prism_launch.config import compose, resolve
    from prism_launch.predict.prediction import predict
    from prism_launch.trace import TraceLayout, TraceReader

    try:
        return predict(resolve(compose(overrides)), TraceReader(trace), TraceLayout(trace), [0], {})[
            "predicted"]["iteration_time_s"]
    except Exception as e:  # noqa: BLE001 - the figure then shows as missing
        print(f"replay under {overrides} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def run_row(row: str, a: argparse.Namespace, factor: float | None, kernel: float | None) -> list[Figure]:
    from gpu_lean import prism
    from upstream import pretrain_gpt

    from integrations.megatron_workload import model_flops

    layers, hidden, heads, tp, gpus, gbs, published = ROWS[row]
    script = pretrain_gpt(a.mlm)
    args = job(row, a.iters)
    now, how = model_flops(args, gpus)
    flops = table_flops(row)
    work = Path(tempfile.mkdtemp(prefix=f"prism-row-{row}-"))
    it = it_adj = it_kept = None
    keep = None if a.out is None else a.out.with_name(f"{a.out.stem}.{row}")
    try:
        if script is not None:
            base = ["--nnodes", str(gpus // 8), "--nproc-per-node", "8", "device=cuda", f"sandbox.ranks=[{gpus - 1}]",
                    f"trace.dir={work / 'trace'}", f"cluster={a.cluster}", "capture.payload=none", "capture.fold=true",
                    "comm.timeout_s=600", "mode=auto", "calibrate.in_auto=true", f"calibrate.repeats={a.repeats}",
                    f"report.dir={work / 'report'}", "--log-dir", work / "logs"]
            try:
                prism([*base, script, *args], work, a.timeout)
                rep = json.loads((work / "report" / "report.json").read_text())
                it = rep["predicted"]["iteration_time_s"]
                scaling = rep["predicted"].get("gpu_scaling") or {}
                print(f"{row}: compute measured on {scaling.get('measuring_device') or 'MISSING'}, cluster GPU "
                      f"{rep['predicted'].get('cluster_gpu')}, scaled: {bool(scaling.get('scaled'))}", flush=True)
            except SystemExit:
                print(f"{row}: the run failed", file=sys.stderr)
            finally:
                if keep is not None:  # the report and the logs, for a look after the device is gone
                    for sub in ("report", "logs"):
                        if (work / sub).exists():
                            shutil.copytree(work / sub, keep / sub, dirs_exist_ok=True,
                                            ignore=shutil.ignore_patterns("*.png", "*.pt", "*.bin"))
            if keep is not None:
                from gpu_lean import keep_trace

                keep_trace(work / "trace", keep.with_name(f"{keep.name}.trace.tar.gz"))
            if it and factor:
                it_adj = repredict(work / "trace", ["device=cuda", f"cluster={a.cluster}",
                                                    f"replay.compute_speedup={factor:g}"])
            if it and kernel:
                it_kept = repredict(work / "trace", ["device=cuda", f"cluster={a.cluster}", "replay.host_gaps=removed",
                                                     f"replay.compute_speedup={kernel:g}"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tflops = None if not (it and flops) else flops / it / gpus / 1e12
    adj = None if not (it_adj and flops) else flops / it_adj / gpus / 1e12
    err = None if tflops is None else 100 * (tflops - published) / published
    err_adj = None if adj is None else 100 * (adj - published) / published
    kept = None if not (it_kept and flops) else flops / it_kept / gpus / 1e12
    err_kept = None if kept is None else 100 * (kept - published) / published
    print(f"{row}: {layers} layers, hidden {hidden}, {heads} heads, TP{tp}, {gpus} GPUs, global batch {gbs}; "
          f"{flops / 1e15:.2f} PFLOP per step as the table counted (today's {how}: "
          f"{'MISSING' if now is None else f'{now / 1e15:.2f}'}); predicted "
          f"{'MISSING' if it is None else f'{it * 1e3:.1f} ms'} -> "
          f"{'MISSING' if tflops is None else f'{tflops:.1f}'} TFLOP/s/GPU (published {published}); with the "
          f"implementation factor {factor if factor is None else f'{factor:.3f}'}: "
          f"{'MISSING' if it_adj is None else f'{it_adj * 1e3:.1f} ms'} -> {'MISSING' if adj is None else f'{adj:.1f}'}; "
          f"host kept up, kernel factor {kernel if kernel is None else f'{kernel:.3f}'}: "
          f"{'MISSING' if it_kept is None else f'{it_kept * 1e3:.1f} ms'} -> {'MISSING' if kept is None else f'{kept:.1f}'}",
          flush=True)
    return [Figure(f"{row}: predicted TFLOP/s per GPU (local layers)", tflops, None, ".1f"),
            Figure(f"{row}: raw error %", err, None, "+.1f"),
            Figure(f"{row}: adjusted TFLOP/s per GPU", adj, None, ".1f"),
            Figure(f"{row}: adjusted error % (eager factor)", err_adj, None, "+.1f"),
            Figure(f"{row}: TFLOP/s per GPU, host kept up / kernel factor", kept, None, ".1f"),
            Figure(f"{row}: host kept up / kernel factor |error| %", None if err_kept is None else abs(err_kept),
                   at_most(10, "%"), ".1f")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1.7b,7.1b")
    ap.add_argument("--iters", type=int, default=5, help="training iterations (4 steady steps, pooled by calibration)")
    ap.add_argument("--repeats", type=int, default=1, help="calibrate.repeats per shard class")
    ap.add_argument("--cluster", default="h100_ib")
    ap.add_argument("--factor", type=float, help="the implementation factor (default: measured here first)")
    ap.add_argument("--kernel-factor", type=float, help="the layers' kernel-time factor, local / graphed "
                    "(default: measured here first)")
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per row's prism-launch run")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown} (known: {', '.join(ROWS)})")
    print(f"source: {SOURCE}\nwhat differs: {DIFFERS}", flush=True)
    factor, kernel = a.factor, a.kernel_factor
    figs: list[Figure] = []
    if factor is None or kernel is None:
        import subprocess

        out = Path(tempfile.mkdtemp()) / "factor.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_layer_factor.py"), "--out", str(out)], timeout=300)
        measured = json.loads(out.read_text()) if out.exists() else {}
        factor, kernel = factor or measured.get("factor"), kernel or measured.get("kernel_factor_graphed")
    figs.append(Figure("implementation factor applied", factor, None, ".3f"))
    figs.append(Figure("kernel-time factor applied (host kept up)", kernel, None, ".3f"))
    for row in rows:
        figs += run_row(row, a, factor, kernel)
    if a.out:
        a.out.write_text(json.dumps({f.name: f.value for f in figs}, indent=1))
    return report(figs)


if __name__ == "__main__":
    sys.exit(main())
