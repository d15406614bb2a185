"""The implementation factor: one transformer layer of megatron-core's local spec (what the device
machine runs: no Transformer Engine) against a torch-native layer of the same shape (SDPA's flash
attention, elementwise ops fused by ``torch.compile``), forward and backward, bf16, on one GPU.

    source .mlm/activate.sh && python bench/gpu_layer_factor.py [--shapes 1.7b,7.1b] [--out f.json]

Shapes are Megatron-LM README rows (GPT: LayerNorm, MHA, FFN 4h with GeLU, seq 4096, micro-batch 1),
each layer at its tensor-parallel width on one GPU (7.1B: TP2, so half the heads and half the FFN),
and ``8b-tp8``: one TP8 rank of ``bench/gpu_predict8b.py``'s Llama-3-8B shape (4 query heads, 1
key-value group, SwiGLU 1,792, RMSNorm; no RoPE). Prints each shape's local and native time per
layer, their ratio, and the GPU's kernel-busy time beside the wall time (a ratio well under 1 is a
host-bound layer: launches, not FLOPs), and the one factor (the geometric mean of the README
shapes' ratios) that ``bench/gpu_megatron_rows.py`` applies to every row
through ``replay.compute_speedup``.

A third implementation, ``graphed``, is the native layer's forward and backward captured in one
CUDA graph (``torch.cuda.graph``, after warm-up): the same fused kernels replayed, so the host
launches one graph instead of each kernel. Its ratio, ``factor_graphed`` (local / graphed), is the speed-up of a
fused implementation with the host off the critical path, as Megatron's ``--cuda-graph-impl`` runs
one; a layer whose graphed time is near its kernel-busy time shows that the graphs removed the
host's share. ``kernel_factor_graphed`` is the local layer's kernel time over the graphed one's:
the ratio that no host's speed enters. Exits non-zero when a figure is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from figures import Figure, report  # noqa: E402

SHAPES = {  # hidden, heads, query groups, ffn, tensor-parallel size, SwiGLU + RMSNorm (else GeLU + LayerNorm)
    "1.7b": (2048, 16, 16, 8192, 1, False),
    "7.1b": (4096, 32, 32, 16384, 2, False),
    "8b-tp8": (4096, 32, 8, 14336, 8, True),  # one TP8 rank of gpu_predict8b.py's job (no RoPE here)
}
README_SHAPES = ("1.7b", "7.1b")
"""The shapes whose geometric mean is the factor applied to gpu_megatron_rows.py's rows."""
SEQ = 4096


def _busy(fn, x) -> tuple[float, dict[str, float], list]:
    """Seconds the GPU spent in kernels during one forward + backward (torch.profiler): against
    the wall time it tells a host-bound layer (launch overhead) from a device-bound one. Also the
    busy seconds of each kernel class (FLOP-bound, memory-bound, none known: the predictor's own
    :func:`~prism_launch.predict.gpu_scaling.classify_kernel`) and the longest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from prism_launch.predict.gpu_scaling import classify_kernel

    x.grad = None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total / 1e6) for e in prof.key_averages()
                      if e.self_device_time_total > 0), key=lambda kv: -kv[1])
    by: dict[str, float] = {}
    for name, seconds in kernels:
        cls = classify_kernel(name) or "other"
        by[cls] = by.get(cls, 0.0) + seconds
    return sum(s for _, s in kernels), by, [[k, s] for k, s in kernels[:12]]


def _time(fn, x, iters: int) -> float:
    """Median seconds of ``fn`` (a forward + backward) by CUDA events, after warm-up."""
    import torch

    times = []
    for i in range(iters + 3):
        x.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def measure(name: str, iters: int) -> dict:
    import torch

    hidden, heads, groups, ffn, tp, glu = SHAPES[name]
    h_heads, h_ffn = heads // tp, ffn // tp  # the layer one GPU of the TP group runs (its attention/FFN share)
    x = torch.randn(SEQ, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = {"shape": name, "hidden": hidden, "heads_per_gpu": h_heads, "groups_per_gpu": max(1, groups // tp),
           "ffn_per_gpu": h_ffn, "tp": tp, "swiglu": glu}
    for impl, build in (("local", local_layer), ("native", native_layer), ("graphed", graphed_layer)):
        try:
            layer = build(hidden, heads, groups, ffn, tp, glu)
            fn = layer if impl == "graphed" else (lambda x, f=layer: f(x).float().sum().backward())
            out[f"{impl}_s"] = _time(fn, x, iters)
            out[f"{impl}_busy_s"], out[f"{impl}_class_s"], out[f"{impl}_kernels"] = _busy(fn, x)
        except Exception as e:  # noqa: BLE001 - printed as the missing figure's cause
            if impl != "graphed":
                raise
            out["graphed_error"] = f"{type(e).__name__}: {e}"[:500]
            out.update(graphed_s=None, graphed_busy_s=None, graphed_class_s={}, graphed_kernels=[])
    out["factor"] = out["local_s"] / out["native_s"]
    out["factor_graphed"] = out["local_s"] / out["graphed_s"] if out["graphed_s"] else None
    # kernels for kernels: the local layer's GPU-busy time over the graphed one's (host-free on both sides)
    out["kernel_factor_graphed"] = out["local_busy_s"] / out["graphed_busy_s"] if out["graphed_busy_s"] else None
    return out


def local_layer(hidden: int, heads: int, groups: int, ffn: int, tp: int, glu: bool):
    """megatron-core's local-spec GPT layer (LayerNorm, unfused core attention, GeLU MLP) at one TP
    rank's share: heads / tp of width hidden / heads, FFN / tp, without the TP all-reduces."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1)
    import torch.nn.functional as F

    glu_args = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                    add_bias_linear=False) if glu else {}
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads // tp,
                            num_query_groups=max(1, groups // tp), **glu_args,
                            kv_channels=hidden // heads, ffn_hidden_size=ffn // tp,
                            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                            hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec()).cuda().to(torch.bfloat16)  # as Float16Module does
    return lambda x: block(x, attention_mask=None)


def native_layer(hidden: int, heads: int, groups: int, ffn: int, tp: int, glu: bool, mode: str | None = None):
    """The same share in plain torch: SDPA (flash) attention, elementwise ops compiled (``mode``:
    ``torch.compile``'s)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    hh, d, f, g = heads // tp, hidden // heads, ffn // tp, max(1, groups // tp)
    norm = nn.RMSNorm if glu else nn.LayerNorm

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = norm(hidden), norm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, (hh + 2 * g) * d, bias=not glu), nn.Linear(hh * d, hidden, bias=not glu)
            self.fc1, self.fc2 = nn.Linear(hidden, f * (2 if glu else 1), bias=not glu), nn.Linear(f, hidden, bias=not glu)

        def forward(self, x):  # x: [s, b, h] as Megatron's
            s, b, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(s, b, hh + 2 * g, d).permute(1, 2, 0, 3).split([hh, g, g], dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != hh)
            x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, hh * d))
            h = self.fc1(self.ln2(x))
            h = F.silu(h[..., :f]) * h[..., f:] if glu else F.gelu(h, approximate="tanh")
            return x + self.fc2(h)

    return torch.compile(Layer().cuda().to(torch.bfloat16), mode=mode)


def graphed_layer(hidden: int, heads: int, groups: int, ffn: int, tp: int, glu: bool):
    """The native layer's forward and backward (of the sum of its output) captured in one CUDA graph
    after three warm-up steps on a side stream, as torch's whole-network capture does; the returned
    step replays it on its own static input (the argument is ignored: same shape, same work)."""
    import torch

    layer = native_layer(hidden, heads, groups, ffn, tp, glu)
    x = torch.randn(SEQ, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer(x).float().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x).float().sum().backward()
    return lambda _x: graph.replay()


def factor(shapes: list[str], iters: int) -> tuple[float | None, list[dict]]:
    """Each shape's measurement and the geometric mean of their factors."""
    import torch

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = [measure(s, iters) for s in shapes]
    readme = [r for r in rows if r["shape"] in README_SHAPES]
    return geomean([r.get("factor") for r in readme]), rows


def geomean(values: list[float | None]) -> float | None:
    """The geometric mean, or None when any value is missing."""
    if not values or any(not v for v in values):
        return None
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1.7b,7.1b,8b-tp8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    f, rows = factor([s.strip() for s in a.shapes.split(",") if s.strip()], a.iters)
    figs = []
    for r in rows:
        print(f"{r['shape']}: layer at TP{r['tp']} (hidden {r['hidden']}, {r['heads_per_gpu']} heads, FFN "
              f"{r['ffn_per_gpu']} per GPU), seq {SEQ}: local {r['local_s'] * 1e3:.2f} ms "
              f"(GPU busy {r['local_busy_s'] * 1e3:.2f} ms), native {r['native_s'] * 1e3:.2f} ms "
              f"(busy {r['native_busy_s'] * 1e3:.2f} ms), graphed " + (
                  f"{r['graphed_s'] * 1e3:.2f} ms (busy {r['graphed_busy_s'] * 1e3:.2f} ms)" if r["graphed_s"]
                  else f"failed: {r.get('graphed_error')}") + " forward + backward")
        for impl in ("local", "native", "graphed"):
            print(f"  {impl} busy by kernel class: " + ", ".join(
                f"{c} {t * 1e3:.2f} ms" for c, t in sorted(r[f"{impl}_class_s"].items())))
        figs.append(Figure(f"{r['shape']} local GPU busy / wall", r["local_busy_s"] / r["local_s"], None, ".3f"))
        figs.append(Figure(f"{r['shape']} local / native", r.get("factor"), None, ".3f"))
        figs.append(Figure(f"{r['shape']} graphed GPU busy / wall",  # no kernels seen in the graphs: missing
                           (r["graphed_busy_s"] or 0) / r["graphed_s"] or None if r["graphed_s"] else None, None, ".3f"))
        figs.append(Figure(f"{r['shape']} local / graphed", r.get("factor_graphed"), None, ".3f"))
        figs.append(Figure(f"{r['shape']} local / graphed, kernel time", r.get("kernel_factor_graphed"), None, ".3f"))
    figs.append(Figure("implementation factor (geometric mean)", f, None, ".3f"))
    readme = [r for r in rows if r["shape"] in README_SHAPES]
    graphed = geomean([r.get("factor_graphed") for r in readme]) if readme else None
    kernel = geomean([r.get("kernel_factor_graphed") for r in readme]) if readme else None
    if readme:
        figs.append(Figure("graphed implementation factor (geometric mean)", graphed, None, ".3f"))
        figs.append(Figure("kernel-time factor, local / graphed (geometric mean)", kernel, None, ".3f"))
    if a.out:
        a.out.write_text(json.dumps({"factor": f, "factor_graphed": graphed, "kernel_factor_graphed": kernel,
                                     "shapes": rows}, indent=1))
    return report(figs)


if __name__ == "__main__":
    sys.exit(main())
