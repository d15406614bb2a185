"""torchtitan's published Llama 3.1 8B rows, predicted from one GPU: both rows in one command.

    python bench/gpu_torchtitan.py [--rows fsdp,compile] [--steps 8] [--cluster h100_96gb_gt]
                                   [--derated-tflops 835] [--out results.json]

On the device machine: ``.whl`` prepared by ``../shared/tools/gpu-stack.sh`` and then
``bench/titan_wheels.sh`` (torchtitan's dependencies the image lacks), the command begun with
``source .mlm/activate.sh &&``; an H200 (the FSDP row's 82 GiB does not fit an 80 GB H100).

The published figures (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``,
Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch size 2, global batch size 16, seq 8192,
selective activation checkpointing; throughput read at iteration 90, memory the maximum over
GPUs of torchtitan's "max reserved"):

    FSDP                   5,762 TPS/GPU   82.4 GiB
    FSDP + torch.compile   6,667 TPS/GPU   77.0 GiB

Each row runs torchtitan's unchanged ``-m torchtitan.train`` (llama3 ``8B`` flavour, random
weights, a local tokenizer and dataset from ``examples/torchtitan/make_assets.py``: the model's
vocabulary stays 128,256) under ``prism-launch --nproc-per-node 8`` in ``mode=auto`` with
``capture.payload=none`` and calibration (``calibrate.in_auto=true``), sandbox rank 0, predicted
on ``--cluster`` (``h100_96gb_gt``: the published hosts; nothing in it is fitted to these rows).
It prints per row the predicted and published TPS/GPU and memory (GiB, the sandbox's peak
reserved) and their errors, then the TPS/GPU again with the GPU's peak at ``--derated-tflops``
(the lower bound torchtitan's footnote gives for its 500 W H100s: "between SXM and NVL"; the
H100 NVL's dense BF16 is 835 TFLOP/s), the same calibrated trace replayed again in-process.

What differs from the published runs, printed with each row: the measuring device (the one its
trace names) against the target's (H100 96 GB HBM2e, 500 W, clocks unknown); torch (this
process's against a 2024-12-23 nightly, 1963fc8); torchtitan (this process's against 9dec370); the data
(a local synthetic corpus against C4). Goal per row, on the undrated prediction: TPS/GPU within
10%, memory within 5%; the exit code is 1 when a figure is missing or misses its goal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from figures import Figure, at_most, exit_code, table  # noqa: E402

PUBLISHED = {"fsdp": ("FSDP", 5762.0, 82.4, []),
             "compile": ("FSDP + torch.compile", 6667.0, 77.0, ["--compile.enable"])}
"""row -> (published name, TPS/GPU, memory GiB, extra torchtitan flags)."""
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1"
DIFFERS = ("measuring device {device} vs target H100 96 GB HBM2e at 500 W (clocks unknown); "
           "torch {torch} vs nightly 1963fc8 (2024-12-23); torchtitan {titan} vs 9dec370; local synthetic data vs C4")
"""What differs from the published runs; the measuring GPU is the one each row's trace names."""


def _assets(root: Path) -> tuple[Path, Path]:
    spec = importlib.util.spec_from_file_location("make_assets", ROOT / "examples" / "torchtitan" / "make_assets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write_assets(root)


SHAPE = {"flavor": "8B", "seq_len": 8192, "device": "cuda"}
"""The published shape; ``--flavor debugmodel --seq-len 64 --device cpu`` runs the same plumbing
on a CPU in a minute (its figures then mean nothing against the published ones)."""


def _script(tok: Path, data: Path, steps: int, dump: Path, extra: list[str]) -> list[str]:
    return ["-m", "torchtitan.train", "--model.name", "llama3", "--model.flavor", SHAPE["flavor"],
            "--model.hf_assets_path", str(tok), "--training.dataset_path", str(data),
            "--training.local_batch_size", "2", "--training.seq_len", str(SHAPE["seq_len"]),
            "--training.steps", str(steps),
            "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
            "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--debug.seed", "7",
            "--job.dump_folder", str(dump), *extra]


def _prism(args: list[str], cwd: Path, timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(cwd / "hf")}
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "prism_launch", *args], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, time.monotonic() - t0, f"timed out after {timeout:.0f} s"
    return r.returncode, time.monotonic() - t0, r.stderr[-3000:]


def _read(report: Path) -> dict:
    rep = json.loads(report.read_text())
    pred = rep["predicted"]
    reserved = [v.get("peak_reserved_bytes") for v in rep["ranks"].values() if v.get("peak_reserved_bytes")]
    return {"iteration_s": pred.get("iteration_time_s"),
            "tps_per_gpu": (pred.get("throughput") or {}).get("tokens_per_s_per_gpu"),
            "memory_gib": max(reserved) / 2**30 if reserved else None,
            "losses_match": (rep["ranks"].get("0") or {}).get("losses_match_capture"),
            "device": (pred.get("gpu_scaling") or {}).get("measuring_device"),
            "scaling": pred.get("gpu_scaling") or {}}


def _repredict(trace_dir: Path, overrides: list[str]) -> dict:
    """The global replay of the (calibrated) trace again under ``overrides``, in this process:
    the sandbox is not run again."""
    from prism_launch.config import compose, resolve
    from prism_launch.predict.prediction import predict
    from prism_launch.trace import TraceLayout, TraceReader

    try:
        pred = predict(resolve(compose(overrides)), TraceReader(trace_dir), TraceLayout(trace_dir), [0], {})["predicted"]
    except Exception as e:  # noqa: BLE001 - a figure the table then shows as missing
        print(f"replay under {overrides} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return {}
    return {"iteration_s": pred.get("iteration_time_s"),
            "tps_per_gpu": (pred.get("throughput") or {}).get("tokens_per_s_per_gpu")}


def _err(pred: float | None, pub: float) -> float | None:
    return None if pred is None else 100.0 * (pred - pub) / pub


def _log_tails(logs: Path, n: int = 3) -> None:
    """The ends of the ranks' stderr logs of a failed run (its folder is removed afterwards)."""
    for log in sorted(logs.rglob("stderr.log"))[-n:]:
        text = log.read_text(errors="replace").strip()
        if text:
            print(f"--- {log.relative_to(logs)}:\n{text[-2500:]}", file=sys.stderr)


def run_row(row: str, work: Path, steps: int, cluster: str, derated: float, timeout: float,
            repeats: int) -> list[Figure]:
    name, tps_pub, mem_pub, extra = PUBLISHED[row]
    tok, data = _assets(work / "assets")
    base = ["--nproc-per-node", "8", f"device={SHAPE['device']}", f"cluster={cluster}", "capture.payload=none",
            "capture.fold=true",  # the 8 FSDP ranks are replicas of one shard class: one rank captured
            "sandbox.ranks=[0]", f"trace.dir={work / 'trace'}", "comm.timeout_s=600"]
    rc, wall, err = _prism([*base, "--log-dir", str(work / "auto"), "mode=auto", "calibrate.in_auto=true",
                            f"calibrate.repeats={repeats}",
                            f"report.dir={work / 'report'}", *_script(tok, data, steps, work / "o1", extra)],
                           work, timeout)
    print(f"{name}: mode=auto (capture, calibrate, emulate) exit {rc} in {wall:.0f} s", flush=True)
    got = _read(work / "report" / "report.json") if rc == 0 else {}
    from importlib.metadata import version

    print("  what differs from the published run: " + DIFFERS.format(
        device=got.get("device") or "(not named: no trace)", torch=version("torch").split("+")[0],
        titan=version("torchtitan")))
    sc = got.get("scaling") or {}
    if sc.get("scaled"):
        v = {k: sc.get(k) or 0 for k in ("mean_factor", "compute_factor", "compute_fraction", "memory_factor",
                                          "memory_fraction", "busy_share")}
        print(f"  compute scaled to {sc.get('target_gpu')}: mean factor {v['mean_factor']:.3f} (FLOP-bound kernels "
              f"x{v['compute_factor']:.3f}, {100 * v['compute_fraction']:.0f}%; memory-bound x{v['memory_factor']:.3f}, "
              f"{100 * v['memory_fraction']:.0f}%; GPU busy {100 * v['busy_share']:.0f}% of the calibrated compute)")
    if rc != 0:
        print(err, file=sys.stderr)
        _log_tails(work / "auto")
    low = _repredict(work / "trace", [f"device={SHAPE['device']}", f"cluster={cluster}", "integration.kind=torchtitan",
                                      f"cluster.gpu.peak_bf16_tflops={derated:g}"]) if rc == 0 else {}
    tps, mem, tps_low = got.get("tps_per_gpu"), got.get("memory_gib"), low.get("tps_per_gpu")
    shown = (lambda v, fmt: "MISSING" if v is None else format(v, fmt))
    print(f"  published {tps_pub:,.0f} TPS/GPU, {mem_pub} GiB ({SOURCE}); predicted {shown(tps, ',.0f')} TPS/GPU, "
          f"{shown(mem, '.1f')} GiB; at {derated:g} TFLOP/s: {shown(tps_low, ',.0f')} TPS/GPU")
    e_tps, e_mem, e_low = _err(tps, tps_pub), _err(mem, mem_pub), _err(tps_low, tps_pub)
    return [Figure(f"{name}: TPS/GPU error %", None if e_tps is None else abs(e_tps), at_most(10, "%"), ".1f"),
            Figure(f"{name}: memory error %", None if e_mem is None else abs(e_mem), at_most(5, "%"), ".1f"),
            Figure(f"{name}: TPS/GPU error % at {derated:g} TFLOP/s", None if e_low is None else abs(e_low), None, ".1f"),
            Figure(f"{name}: signed errors (TPS, memory) %", None if e_tps is None or e_mem is None
                   else f"{e_tps:+.1f} / {e_mem:+.1f}"),
            Figure(f"{name}: sandbox losses equal the capture's", got.get("losses_match"), None)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="fsdp,compile")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cluster", default="h100_96gb_gt")
    ap.add_argument("--derated-tflops", type=float, default=835.0)
    ap.add_argument("--timeout", type=float, default=270.0, help="seconds per prism-launch run")
    ap.add_argument("--repeats", type=int, default=1,
                    help="calibrate.repeats: runs of the one shard class (FSDP's 8 ranks are one class); "
                         "each run's steps give every event several measurements already")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--flavor", default=SHAPE["flavor"])
    ap.add_argument("--seq-len", type=int, default=SHAPE["seq_len"])
    ap.add_argument("--device", default=SHAPE["device"], choices=("cuda", "cpu"))
    a = ap.parse_args()
    SHAPE.update(flavor=a.flavor, seq_len=a.seq_len, device=a.device)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in PUBLISHED]
    if unknown:
        ap.error(f"--rows: unknown {unknown} (known: {', '.join(PUBLISHED)})")
    figures: list[Figure] = []
    for row in rows:
        with tempfile.TemporaryDirectory(prefix=f"prism-titan-{row}-") as d:
            figures += run_row(row, Path(d), a.steps, a.cluster, a.derated_tflops, a.timeout, a.repeats)
    print(table(figures))
    if a.out:
        a.out.write_text(json.dumps([{"name": f.name, "value": f.value} for f in figures], indent=1))
    return exit_code(figures)


if __name__ == "__main__":
    sys.exit(main())
