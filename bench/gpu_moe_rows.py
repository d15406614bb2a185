"""MoE jobs at 1,024 ranks predicted from one GPU, with their routing statistics: upstream
Megatron-LM ``pretrain_gpt.py`` (unchanged), ``capture.payload=none``, bf16, ``--mock-data``,
seq 4096, micro-batch 1, 8 micro-batches per pipeline (global batch = 8 × data-parallel size),
``--moe-token-dispatcher-type alltoall``, full activation recompute (``--recompute-granularity
full --recompute-method uniform --recompute-num-layers 1``: the local attention's score matrices
at seq 4096 would not fit otherwise), local layers (no Transformer Engine), experts as
megatron-core's ``SequentialMLP`` (no grouped GEMM without Transformer Engine), captured with
expert-parallel folding (``capture.ep_sample``), calibrated by shard class, predicted on
``--cluster`` (h100_ib) in this process.

Rows (``--row``):
- ``mixtral``: Mixtral-8x7B shape (32 layers, hidden 4096, 32 heads / 8 query groups, 8 experts
  top-2, expert FFN 14336, vocab 32,000), TP1·PP4·EP8, global batch 2,048;
- ``qwen3``: Qwen3-235B-A22B shape (94 layers as 11 + 6 × 12 + 11 over PP8, hidden 4096, 64 heads
  of 128 channels / 4 query groups, QK layer norm, 128 experts top-8, expert FFN 1536, vocab
  151,936), TP1·PP8·EP32, global batch 1,024, at most 64 captured ranks;
- ``sweep``: a 4-point router sweep of the Mixtral row through ``prism-launch --multirun``
  (``--sweep-points``: aux-loss coefficient 1e-3 / 1e-2 × dropless / capacity factor 1.0 by
  default), its ranked table and ``summary.csv``.

    source .mlm/activate.sh && python bench/gpu_moe_rows.py --row mixtral [--stage all] [--out r.json]
    python bench/gpu_moe_rows.py --row qwen3 --stage capture --work /tmp/q   # one device command
    python bench/gpu_moe_rows.py --row qwen3 --stage calibrate --work /tmp/q  # the next one, same machine
    python bench/gpu_moe_rows.py --row mixtral --print-args                   # the script's arguments only

Prints per row: captured ranks, the predicted iteration time, tokens/s/GPU, model TFLOP/s and MFU
(Megatron's formula, :mod:`integrations.megatron_workload`), and the ``moe`` section's routing
statistics: tokens per expert and per EP rank (max/mean, coefficient of variation), dropped
tokens, the routers' load-balancing loss, the all-to-all waits of the most loaded EP rank against
the mean. Exits non-zero when a figure is missing, fewer than 3 steps were captured, the compute is
not calibrated, or a row captured more ranks than its bound.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from figures import IS_TRUE, Figure, Goal, report  # noqa: E402

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
LOCAL = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
         "--no-bias-swiglu-fusion"]


@dataclass(frozen=True)
class Row:
    name: str
    layers: int
    hidden: int
    heads: int
    groups: int
    experts: int
    topk: int
    expert_ffn: int
    vocab: int
    pp: int
    ep: int
    aux_coeff: float
    max_captured: int
    kv_channels: int | None = None
    qk_layernorm: bool = False
    first_last_layers: int | None = None
    """Layers of the first and of the last pipeline stage where the layer count does not divide."""
    rotary_base: int = 10000
    tp: int = 1
    world: int = 1024
    seq: int = 4096
    micro_batches: int = 8
    extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def global_batch(self) -> int:
        return self.micro_batches * self.dp

    def args(self, iters: int) -> list[str]:
        a = ["--num-layers", self.layers, "--hidden-size", self.hidden, "--num-attention-heads", self.heads,
             "--group-query-attention", "--num-query-groups", self.groups, "--ffn-hidden-size", self.expert_ffn,
             "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--rotary-base", self.rotary_base, "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--num-experts", self.experts, "--moe-router-topk", self.topk, "--moe-ffn-hidden-size", self.expert_ffn,
             "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
             "--moe-aux-loss-coeff", self.aux_coeff, "--expert-model-parallel-size", self.ep,
             "--tensor-model-parallel-size", self.tp, "--pipeline-model-parallel-size", self.pp,
             "--seq-length", self.seq, "--max-position-embeddings", self.seq, "--micro-batch-size", 1,
             "--global-batch-size", self.global_batch, "--train-iters", iters, "--bf16", "--lr", "1e-4",
             "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", self.vocab, *RECOMPUTE, *LOCAL, "--log-interval", 1, "--eval-interval", 100000,
             "--eval-iters", 0]
        if self.kv_channels:
            a += ["--kv-channels", self.kv_channels]
        if self.qk_layernorm:
            a += ["--qk-layernorm"]
        if self.first_last_layers:
            a += ["--decoder-first-pipeline-num-layers", self.first_last_layers,
                  "--decoder-last-pipeline-num-layers", self.first_last_layers]
        return [str(x) for x in (*a, *self.extra)]

    def check(self) -> None:
        """The layout's arithmetic, as Megatron will check it."""
        if self.world % (self.tp * self.pp) or self.dp % self.ep or self.experts % self.ep:
            raise ValueError(f"{self.name}: world {self.world} TP{self.tp}·PP{self.pp}·EP{self.ep} with "
                             f"{self.experts} experts does not divide")
        inner = self.layers - 2 * (self.first_last_layers or 0)
        stages = self.pp - (2 if self.first_last_layers else 0)
        if stages <= 0 or inner % stages:
            raise ValueError(f"{self.name}: {self.layers} layers do not split over PP{self.pp}")


ROWS = {
    "mixtral": Row("mixtral", layers=32, hidden=4096, heads=32, groups=8, experts=8, topk=2, expert_ffn=14336,
                   vocab=32000, pp=4, ep=8, aux_coeff=1e-2, max_captured=32, rotary_base=1000000),
    "qwen3": Row("qwen3", layers=94, hidden=4096, heads=64, groups=4, experts=128, topk=8, expert_ffn=1536,
                 vocab=151936, pp=8, ep=32, aux_coeff=1e-3, max_captured=64, kv_channels=128, qk_layernorm=True,
                 first_last_layers=11, rotary_base=1000000),
}
SWEEP = ("script.args.moe_aux_loss_coeff=1e-3,1e-2", "script.args.moe_expert_capacity_factor=false,1.0")
"""The default 4-point router sweep of the Mixtral row: ``false`` removes the flag (dropless)."""


def flops_per_step(row: Row, iters: int) -> float | None:
    from integrations.megatron_workload import model_flops

    flops, _why = model_flops(row.args(iters), row.world)
    return flops


def moe_figures(moe: dict | None) -> tuple[list[Figure], list[str]]:
    """The routing statistics of a report's ``moe`` section, as figures."""
    if not moe or "error" in moe:
        return [Figure("moe section", None if not moe else moe["error"], IS_TRUE)], []
    o, eff = moe["overall"], moe.get("effect") or {}
    w = eff.get("a2a_wait_s") or {}
    lines = [f"  routing: {moe['num_experts']} experts, EP {moe['ep_sizes']}, {moe['dispatches']} dispatches "
             f"({moe['dispatches_verified']} verified), {moe['ranks_counted']} ranks counted; "
             f"dropped tokens: {moe.get('dropped_source')}",
             "  tokens per expert over the run: " + " ".join(str(n) for n in o["tokens_per_expert"][:32]) +
             (" ..." if len(o["tokens_per_expert"]) > 32 else "")]
    for s in moe.get("per_step") or []:
        lines.append(f"  step {s['step']}: tokens/expert max/mean {s['expert_imbalance']:.3f} (CV {s['expert_cv']:.3f}), "
                     f"tokens/EP rank max/mean {s['ep_rank_imbalance']:.3f}, dropped {s['dropped_tokens']}")
    fold = moe.get("fold") or {}
    if fold:
        lines.append(f"  EP folding: {fold.get('captured_ranks')} captured of {fold.get('world_size')}, EP positions "
                     f"{fold.get('ep_positions')}, {fold.get('ep_ranks_derived')} EP ranks' counts derived")
    figs = [Figure("moe section", True, IS_TRUE),
            Figure("tokens/expert max/mean", o.get("expert_imbalance"), None, ".3f"),
            Figure("tokens/expert CV", o.get("expert_cv"), None, ".3f"),
            Figure("tokens/EP rank max/mean", o.get("ep_rank_imbalance"), None, ".3f"),
            Figure("tokens/EP rank CV", o.get("ep_rank_cv"), None, ".3f"),
            Figure("dropped tokens", o.get("dropped_tokens")),
            Figure(f"aux loss ({o.get('aux_loss_name')})", o.get("aux_loss"), None, ".4g"),
            Figure("most loaded EP rank's all-to-all waits ms", None if not w else w["most_loaded"] * 1e3, None, ".2f"),
            Figure("mean EP rank's all-to-all waits ms", None if not w else w["mean"] * 1e3, None, ".2f")]
    return figs, lines


def summarize(rep: dict, row: Row, iters: int, captured: int | None) -> tuple[list[Figure], list[str]]:
    pred = rep["predicted"]
    thr = pred.get("throughput") or {}
    it = pred.get("iteration_time_s")
    flops = flops_per_step(row, iters)
    tflops = None if not (it and flops) else flops / it / row.world / 1e12
    peak = thr.get("peak_bf16_tflops")
    steps = pred.get("iteration_times_s") or []
    figs = [Figure("captured ranks", captured, Goal(f"<= {row.max_captured}", lambda v: v <= row.max_captured)),
            Figure("steps predicted", len(steps), Goal(">= 3", lambda v: v >= 3)),
            Figure("predicted iteration ms", None if it is None else it * 1e3, None, ".1f"),
            Figure("predicted iteration times ms (each step)", [round(x * 1e3, 1) for x in steps]),
            Figure("tokens/s per GPU", thr.get("tokens_per_s_per_gpu"), None, ",.0f"),
            Figure("model TFLOP/s per GPU (Megatron's formula)", tflops, None, ".1f"),
            Figure("MFU (Megatron's formula) %", None if not (tflops and peak) else 100 * tflops / peak, None, ".1f"),
            Figure("compute calibrated", str(pred.get("compute_source", "")).startswith("calibrated"), IS_TRUE)]
    mf, lines = moe_figures(rep.get("moe"))
    lines.insert(0, f"  compute source: {pred.get('compute_statement') or pred.get('compute_source')}; scaled to "
                    f"{pred.get('cluster_gpu')}: {pred.get('compute_scaled')}")
    return figs + mf, lines


def _base(a: argparse.Namespace, row: Row, work: Path) -> list[str]:
    return ["--nnodes", str(row.world // 8), "--nproc-per-node", "8", "device=cuda",
            f"sandbox.ranks=[{row.world - 1}]", f"trace.dir={work / 'trace'}", f"cluster={a.cluster}",
            "capture.payload=none", "capture.fold=true", f"capture.ep_sample={a.ep_sample}",
            f"capture.slots={a.slots}", "comm.timeout_s=600", f"calibrate.repeats={a.repeats}", *a.set]


def captured_ranks(trace: Path) -> int | None:
    from prism_launch.trace import TraceLayout, TraceReader

    reader = TraceReader(trace)
    if TraceLayout.FOLD in reader.json_files():
        return len(reader.read_json(TraceLayout.FOLD)["captured"])
    return None


def predict(a: argparse.Namespace, row: Row, trace: Path) -> dict:
    from prism_launch.config import compose, resolve
    from prism_launch.predict.prediction import predict as run_predict
    from prism_launch.report.moe_stats import moe_stats
    from prism_launch.trace import TraceLayout, TraceReader

    cfg = resolve(compose(["device=cuda", f"cluster={a.cluster}"]))
    reader, layout = TraceReader(trace), TraceLayout(trace)
    out = run_predict(cfg, reader, layout, [row.world - 1], {})
    return {"predicted": out["predicted"], "ranks": out["ranks"], "moe": moe_stats(cfg, reader, layout)}


def run_row(a: argparse.Namespace, row: Row) -> tuple[dict | None, dict]:
    from gpu_lean import prism
    from upstream import pretrain_gpt

    script = pretrain_gpt(a.mlm)
    if script is None:
        return None, {}
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix=f"prism-{row.name}-"))
    work.mkdir(parents=True, exist_ok=True)
    base, job, info = _base(a, row, work), row.args(a.iters), {}
    try:
        t0 = time.monotonic()
        if a.stage in ("capture", "all"):
            _r, info["capture_s"] = prism([*base, "--log-dir", work / "cap", "mode=capture", script, *job], work,
                                          a.timeout)
        if a.stage in ("calibrate", "all"):
            left = a.timeout - (time.monotonic() - t0)
            _r, info["calibrate_s"] = prism([*base, "--log-dir", work / "cal", "mode=calibrate", script, *job], work,
                                            max(60.0, left))
        if a.stage == "capture":
            return None, info
        t1 = time.monotonic()
        rep = predict(a, row, work / "trace")
        info["predict_s"] = time.monotonic() - t1
        info["captured_ranks"] = captured_ranks(work / "trace")
        return rep, info
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


def run_sweep(a: argparse.Namespace, row: Row) -> int:
    """The router sweep through prism-launch's own ``--multirun`` (mode=auto: capture, calibrate,
    emulate per point); prints its ranked table and checks every point's figures."""
    import csv
    import subprocess

    from upstream import pretrain_gpt

    script = pretrain_gpt(a.mlm)
    if script is None:
        return 2
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="prism-moe-sweep-"))
    sweep_dir = work / "sweep"
    points = [p for p in a.sweep_points.split(";") if p]
    cmd = [sys.executable, "-m", "prism_launch", "--multirun", *_base(a, row, work), *points,
           f"hydra.sweep.dir={sweep_dir}", str(script), *row.args(a.iters)]
    cmd = [c for c in cmd if not c.startswith("trace.dir=")]  # every point its own trace
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=a.timeout)
    print(r.stderr[-6000:], flush=True)
    print(f"  sweep: {time.monotonic() - t0:.0f} s, exit {r.returncode}")
    summary = sweep_dir / "summary.csv"
    rows = list(csv.DictReader(open(summary))) if summary.exists() else []
    figs = [Figure("sweep points ok", sum(1 for x in rows if x["status"] == "ok") if rows else None,
                   Goal(f"= {len(rows) or 4}", lambda v: v == (len(rows) or 4)))]
    for x in rows:
        label = x["overrides"]
        for col in ("iteration_time_s", "mfu", "moe_aux_loss", "moe_dropped_tokens", "moe_expert_imbalance"):
            v = x.get(col)
            figs.append(Figure(f"{label}: {col}", None if v in (None, "") else float(v), None, ".4g"))
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "returncode": r.returncode}, indent=1))
    return report(figs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", choices=[*ROWS, "sweep"], required=True)
    ap.add_argument("--stage", choices=["all", "capture", "calibrate", "predict"], default="all",
                    help="capture and calibrate in separate commands on one machine (with --work)")
    ap.add_argument("--work", help="folder for the trace (kept); default: a temporary one, removed")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--ep-sample", type=int, default=1,
                    help="capture.ep_sample: EP positions captured per stage (each captured Mixtral rank holds "
                         "~20 GiB: 4 stages x 4 positions = 16 ranks ran an 80 GB H100 out of memory)")
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cluster", default="h100_ib")
    ap.add_argument("--sweep-points", default=";".join(SWEEP), help="';'-separated Hydra sweep overrides")
    ap.add_argument("--mlm", default=str(ROOT / ".mlm"))
    ap.add_argument("--timeout", type=float, default=560.0)
    ap.add_argument("--print-args", action="store_true", help="print the script's arguments and exit")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a prism-launch setting for every run (e.g. capture.park=cuda_checkpoint)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    row = ROWS["mixtral" if a.row == "sweep" else a.row]
    row.check()
    if a.print_args:
        print(" ".join(row.args(a.iters)))
        return 0
    flops = flops_per_step(row, a.iters)
    print(f"{row.name}: {row.world} ranks TP{row.tp}·PP{row.pp}·EP{row.ep}·DP{row.dp}, global batch "
          f"{row.global_batch}, seq {row.seq}, {row.experts} experts top-{row.topk}, "
          f"{flops / row.global_batch / row.seq / 1e9:.1f} GFLOP per token (Megatron's formula), cluster {a.cluster}",
          flush=True)
    if a.row == "sweep":
        return run_sweep(a, row)
    if a.stage == "predict":
        if not a.work:
            ap.error("--stage predict needs --work (the folder of an earlier capture and calibration)")
        rep, info = predict(a, row, Path(a.work) / "trace"), {"captured_ranks": captured_ranks(Path(a.work) / "trace")}
    else:
        rep, info = run_row(a, row)
        if rep is None:
            print(f"  {a.stage} done: {info}" if info else "  nothing ran")
            return 0 if info else 2
    figs, lines = summarize(rep, row, a.iters, info.get("captured_ranks"))
    for line in lines:
        print(line)
    print(f"  times: {', '.join(f'{k} {v:.0f} s' for k, v in info.items() if k.endswith('_s'))}")
    if a.out:
        a.out.write_text(json.dumps({"info": info, "figures": {f.name: f.value for f in figs},
                                     "predicted": rep.get("predicted"), "moe": rep.get("moe")}, indent=1, default=str))
    return report(figs)


if __name__ == "__main__":
    sys.exit(main())
