"""Model FLOPs, tokens, throughput and MFU of a prediction, and the scaling of its compute
spans to the target GPU (:mod:`prism_launch.predict.gpu_scaling`).

FLOPs are those the captured ranks counted over one step (``model_flops`` of each rank's
summary in the trace's ``memory.json``, :mod:`prism_launch.rank.flops`); an uncaptured rank of
a folded trace did what its stand-in did. Tokens per step come from the recipe's integration
(``workload`` role of :mod:`prism_launch.config.registry`) where it knows them. MFU is the
model FLOPs of one predicted iteration over what every GPU of the world could do at the
target GPU's peak dense BF16 rate in that time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prism_launch.config.cluster import GpuSpec
from prism_launch.predict.gpu_scaling import DEFAULT_MIX, KernelMix, gpu_of, mix_from_flops, scaling_factors
from prism_launch.trace import TraceLayout

if TYPE_CHECKING:
    from prism_launch.config import PrismConfig
    from prism_launch.trace import TraceReader

__all__ = ["MFU_BAND", "Counted", "counted", "integration_flops", "mfu_warning", "scale_rows", "throughput"]

MFU_BAND = (0.10, 0.75)
"""Plausible MFU of a training job on a GPU cluster: outside it, a prediction is suspect."""


@dataclass(slots=True)
class Counted:
    """What the captured ranks counted over their counted step."""

    per_rank: dict[int, int]
    """Model FLOPs of the counted step, per captured rank."""
    embedded_tokens: int | None
    """The most tokens one rank embedded in the counted step (a first pipeline stage's)."""
    step: int | None
    incomplete: list[int]
    """Ranks whose counted step did not end (their figures are partial, not used)."""
    not_counted: str | None = None
    """Why a rank did not count (a torch.compile'd program, an error), where one did not."""


def counted(reader: TraceReader) -> Counted:
    """The trace's counted FLOPs (empty for a trace captured before ranks counted them)."""
    summaries = reader.read_json(TraceLayout.MEMORY) if TraceLayout.MEMORY in reader.json_files() else {}
    per_rank, tokens, step, incomplete, why = {}, None, None, [], None
    for r, s in summaries.items():
        f = (s or {}).get("model_flops") or {}
        if f.get("flops") is None:
            why = why or f.get("skipped") or f.get("error")
            continue
        if not f.get("complete"):
            incomplete.append(int(r))
            continue
        if f.get("uncounted_ops"):  # the count would be low by these ops' FLOPs: not used
            ops = f["uncounted_ops"]
            why = why or f"FLOPs of {', '.join(sorted(ops))} could not be counted ({next(iter(ops.values()))})"
            continue
        per_rank[int(r)] = int(f["flops"])
        step = f.get("step")
        if f.get("embedded_tokens"):
            tokens = max(tokens or 0, int(f["embedded_tokens"]))
    return Counted(per_rank=per_rank, embedded_tokens=tokens, step=step, incomplete=sorted(incomplete),
                   not_counted=why)


def step_flops(c: Counted, world_size: int, fold: dict | None) -> float | None:
    """Model FLOPs of one step of the whole world: each rank's own count, or its stand-in's."""
    if not c.per_rank:
        return None
    if fold is not None:
        rep = fold["rep"]
        if any(int(src) not in c.per_rank for src in rep):
            return None
        return float(sum(c.per_rank[int(src)] for src in rep))
    if len(c.per_rank) != world_size:
        return None
    return float(sum(c.per_rank.values()))


def tokens(cfg: PrismConfig, reader: TraceReader, c: Counted) -> tuple[int | None, str]:
    """Tokens per step from the recipe's integration, and how they were found."""
    from prism_launch.config import ConfigError
    from prism_launch.config.registry import get, load

    kind = cfg.integration.kind
    if kind == "none":
        return None, "tokens unknown (integration.kind=none)"
    try:
        if get(kind, where="integration.kind").workload is None:
            return None, f"tokens unknown (the {kind} integration does not say)"
        module = load(kind, "workload", where="integration.kind")
    except ConfigError as e:
        return None, f"tokens unknown ({e})"
    args = list(reader.manifest.extra.get("script_args") or [])
    return module.tokens_per_step(args, reader.manifest.world_size, c.embedded_tokens)


def integration_flops(cfg: PrismConfig, reader: TraceReader) -> tuple[float | None, str]:
    """Model FLOPs of one step by the recipe's integration's own count (its workload module's
    ``model_flops``), for a trace whose ranks could not count them (a torch.compile'd program);
    None, with why, where the integration has no such count."""
    from prism_launch.config import ConfigError
    from prism_launch.config.registry import get, load

    kind = cfg.integration.kind
    try:
        if kind == "none" or get(kind, where="integration.kind").workload is None:
            return None, f"the {kind} integration has no FLOP count of its own"
        module = load(kind, "workload", where="integration.kind")
    except ConfigError as e:
        return None, str(e)
    if not hasattr(module, "model_flops"):
        return None, f"the {kind} integration has no FLOP count of its own"
    args = list(reader.manifest.extra.get("script_args") or [])
    return module.model_flops(args, reader.manifest.world_size)


def throughput(iteration_s: float, flops: float | None, tokens_per_step: int | None, world: int,
               gpu: GpuSpec) -> dict:
    """Tokens/s (whole job and per GPU), model TFLOP/s per GPU and MFU of one iteration."""
    out: dict = {"model_flops_per_step": flops, "tokens_per_step": tokens_per_step,
                 "tokens_per_s": None, "tokens_per_s_per_gpu": None, "model_tflops_per_gpu": None,
                 "mfu": None, "peak_bf16_tflops": gpu.peak_bf16_tflops}
    if iteration_s <= 0:
        return out
    if tokens_per_step:
        out["tokens_per_s"] = tokens_per_step / iteration_s
        out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world
    if flops:
        out["model_tflops_per_gpu"] = flops / iteration_s / world / 1e12
        if gpu.peak_bf16_tflops:
            out["mfu"] = out["model_tflops_per_gpu"] / gpu.peak_bf16_tflops
    return out


def percent(v: float) -> str:
    """A fraction as a percentage that stays readable when tiny (CPU-time spans give ~1e-7)."""
    return f"{v:.2%}" if v >= 1e-4 or v == 0 else f"{v * 100:.1e}%"


HOST_BOUND_BUSY = 0.7
"""Below this GPU-busy share of the calibrated compute a low MFU is put down to the host."""


def mfu_warning(pred: dict) -> str:
    """Why an MFU outside :data:`MFU_BAND` on a GPU cluster is suspect ("" inside it, on a CPU
    cluster, or with no MFU)."""
    mfu = (pred.get("throughput") or {}).get("mfu")
    if mfu is None or pred.get("cluster_device") != "cuda":
        return ""
    lo, hi = MFU_BAND
    if lo <= mfu <= hi:
        return ""
    causes = []
    scaling = pred.get("gpu_scaling") or {}
    if pred.get("compute_device") == "cpu":
        causes.append("compute spans are this machine's CPU time, not a GPU's")
    elif not scaling.get("scaled"):
        causes.append(f"compute was not scaled to the target GPU ({scaling.get('why', 'measuring GPU unknown')})")
    if not str(pred.get("compute_source", "")).startswith("calibrated"):
        causes.append("spans are uncalibrated (ranks shared devices during capture)")
    busy = scaling.get("busy_share")
    if mfu < lo and busy is not None and busy < HOST_BOUND_BUSY and "host_gaps_removed" not in scaling:
        causes.append(f"the GPU was busy only {busy:.0%} of the calibrated compute: the program is host-bound "
                      "(many small kernels, e.g. unfused local layers), so the step follows the host's speed and a "
                      "fused implementation would run faster (replay.host_gaps=removed replays the step with a host "
                      "that keeps up)")
    if mfu > hi:
        causes.append("FLOPs counted may include recompute, or the cluster's GPU peak is wrong")
    causes.append(f"check the cluster ({pred.get('cluster')}) is the one meant")
    side = "below" if mfu < lo else "above"
    return (f"MFU {percent(mfu)} is {side} the plausible {lo:.0%}-{hi:.0%} of training on GPUs; likely: "
            + "; ".join(causes))


def _rank_compute(rows: list[dict], clock: str) -> dict[int, tuple[float, int]]:
    """Each rank's total compute seconds and its number of steps (step markers, at least 1)."""
    field = "compute_cpu_s" if clock == "cpu" else "compute_wall_s"
    out: dict[int, list] = {}
    for row in rows:
        acc = out.setdefault(row["rank"], [0.0, 0])
        acc[0] += row[field] or 0.0
        if row["kind"] == "marker":
            acc[1] += 1
    return {r: (s, max(1, n)) for r, (s, n) in out.items()}


def scale_rows(rows: list[dict], device: dict | None, target: GpuSpec, c: Counted, clock: str,
               mixes: dict[int, KernelMix] | None = None) -> dict:
    """Scale every compute span of ``rows`` (in place) from the measuring ``device`` to the
    ``target`` GPU, one factor per rank from its kernel mix (``mixes``: a profiler's, where
    known; else :func:`~prism_launch.predict.gpu_scaling.mix_from_flops` of its counted FLOPs
    over its mean step's compute); returns what the report shows of it."""
    if not device:
        return {"scaled": False, "why": "the trace does not record its measuring device (captured before it did)"}
    if device.get("kind") != "cuda":
        return {"scaled": False, "why": f"measured on a CPU ({device.get('name')}): no GPU to scale from",
                "measuring_device": device.get("name")}
    measured = gpu_of(device, target)
    if measured is None:
        return {"scaled": False, "measuring_device": device.get("name"),
                "why": f"no datasheet peaks known for {device.get('name')} (no cluster preset names it)"}
    if not target.peak_bf16_tflops or not target.hbm_bandwidth_tbps:
        return {"scaled": False, "measuring_device": measured.name,
                "why": f"cluster.gpu {target.name} has no peak_bf16_tflops/hbm_bandwidth_tbps"}
    per_rank = _rank_compute(rows, clock)
    factors: dict[int, object] = {}
    for r, (seconds, steps) in per_rank.items():
        mix = (mixes or {}).get(r) or mix_from_flops(c.per_rank.get(r), seconds / steps, measured)
        factors[r] = scaling_factors(measured, target, mix)
    for row in rows:
        f = factors[row["rank"]].factor
        if f != 1.0:
            row["compute_cpu_s"] = (row["compute_cpu_s"] or 0.0) * f
            row["compute_wall_s"] = (row["compute_wall_s"] or 0.0) * f
    fs = list(factors.values())
    sources = sorted({s.mix.source for s in fs})
    return {
        "scaled": True, "measuring_device": measured.name, "target_gpu": target.name,
        "compute_factor": fs[0].compute_factor if fs else 1.0,
        "memory_factor": fs[0].memory_factor if fs else 1.0,
        "mean_factor": statistics.fmean(s.factor for s in fs) if fs else 1.0,
        "compute_fraction": statistics.fmean(s.mix.compute for s in fs) if fs else 0.0,
        "memory_fraction": statistics.fmean(s.mix.memory for s in fs) if fs else 0.0,
        "comm_fraction": statistics.fmean(s.mix.comm for s in fs) if fs else 0.0,
        "other_fraction": statistics.fmean(s.mix.other for s in fs) if fs else 0.0,
        "busy_share": statistics.fmean(busy) if (busy := [s.mix.busy for s in fs if s.mix.busy is not None]) else None,
        "mix_source": ", ".join(sources) if sources else DEFAULT_MIX.source,
    }
