"""Compute spans measured on one GPU, scaled to the target cluster's GPU by their kernel mix.

A span's time splits into classes of kernels: FLOP-bound (matmul, attention: they scale with
the ratio of the two GPUs' peak dense BF16 rates), memory-bound (elementwise, reductions,
norms, copies: they scale with the ratio of HBM bandwidths) and communication (NCCL kernels:
the network model prices them, so their time is taken out of the span). Time of no known
class is kept as measured. Where target and measuring GPU are the same model, every factor
is 1.

The kernel mix of a span comes from a profiler's kernel names where one was taken
(:func:`classify_kernel`, :func:`mix_from_kernels`); otherwise from one stated default,
:func:`mix_from_flops`: the FLOP-bound share of a rank's compute is its counted model FLOPs
over what the measuring GPU's peak does in the same time (``min(1, flops / (peak · t))``),
the rest memory-bound.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from prism_launch.config.cluster import GpuSpec

__all__ = ["KernelMix", "Scaling", "classify_kernel", "gpu_of", "mix_from_flops", "mix_from_kernels",
           "same_gpu", "scale_span", "scaling_factors"]


@dataclass(frozen=True, slots=True)
class KernelMix:
    """Fractions of a span's measured time spent in each class of kernel (they sum to <= 1;
    the rest is of no known class and is not scaled)."""

    compute: float
    """FLOP-bound kernels (GEMM, attention)."""
    memory: float
    """Memory-bound kernels (elementwise, reductions, norms, softmax, copies)."""
    comm: float = 0.0
    """Communication kernels (NCCL): priced by the network model, so left out of the span."""
    source: str = "default"
    """Where the mix came from (``profiler``, ``counted FLOPs``, ``default: all FLOP-bound``)."""
    busy: float | None = None
    """The share of the span the GPU spent in kernels where it was measured (the fractions above
    are then of the whole span, the idle rest in :attr:`other`); None where not measured."""

    def __post_init__(self) -> None:
        parts = (self.compute, self.memory, self.comm)
        if any(not 0.0 <= p <= 1.0 for p in parts) or sum(parts) > 1.0 + 1e-9:
            raise ValueError(f"kernel mix fractions must lie in [0, 1] and sum to <= 1 (got compute "
                             f"{self.compute}, memory {self.memory}, comm {self.comm})")

    @property
    def other(self) -> float:
        return max(0.0, 1.0 - self.compute - self.memory - self.comm)


# kernel-name rules, first match wins: communication before the rest (an NCCL kernel may
# name a reduction), FLOP-bound before memory-bound (a fused GEMM epilogue names an elementwise op)
_RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("comm", re.compile(r"nccl", re.I)),
    # cuBLASLt's Hopper GEMMs are ``nvjet_*``; ``xmma``/``wgmma`` name tensor-core kernels; Inductor's
    # matmul templates are ``triton_tem_*``, its pointwise and reduction kernels ``triton_poi/red/per_*``
    ("compute", re.compile(r"gemm|cutlass|cublas|nvjet|xmma|wgmma|triton_tem_|flash|sdpa|attention|fmha|"
                           r"matmul|(?:^|[^a-z])b?mm(?:[^a-z]|$)|conv", re.I)),
    ("memory", re.compile(r"elementwise|vectorized|reduce|norm|softmax|copy|memcpy|memset|cat|index|"
                          r"fill|embedding|gather|scatter|adam|dropout|triton_(?:poi|red|per)_", re.I)),
)


def classify_kernel(name: str) -> str | None:
    """``compute``, ``memory`` or ``comm`` for a CUDA kernel's name; None for no known class."""
    for cls, pattern in _RULES:
        if pattern.search(name):
            return cls
    return None


def mix_from_kernels(kernels: Iterable[tuple[str, float]]) -> KernelMix:
    """The mix of ``(kernel name, seconds)`` pairs, as a profiler (torch.profiler, CUPTI) lists them."""
    total, by = 0.0, {"compute": 0.0, "memory": 0.0, "comm": 0.0}
    for name, seconds in kernels:
        total += seconds
        cls = classify_kernel(name)
        if cls is not None:
            by[cls] += seconds
    if total <= 0:
        raise ValueError("kernel mix of no kernel time: the profiler listed no kernels with a duration")
    return KernelMix(compute=by["compute"] / total, memory=by["memory"] / total, comm=by["comm"] / total,
                     source="profiler")


DEFAULT_MIX = KernelMix(compute=1.0, memory=0.0, source="default: all FLOP-bound (no kernel mix, no counted FLOPs)")


def mix_from_flops(flops: float | None, seconds: float, measured: GpuSpec) -> KernelMix:
    """The stated default mix: FLOP-bound share ``min(1, flops / (peak · seconds))`` of the
    measuring GPU's peak dense BF16 rate, the rest memory-bound; :data:`DEFAULT_MIX` where
    the FLOPs, the time or the peak are not known."""
    peak = measured.peak_bf16_tflops
    if not flops or seconds <= 0 or not peak:
        return DEFAULT_MIX
    share = min(1.0, flops / (peak * 1e12 * seconds))
    return KernelMix(compute=share, memory=1.0 - share, source="counted FLOPs")


@dataclass(frozen=True, slots=True)
class Scaling:
    """How one span (or one rank's spans) was scaled."""

    factor: float
    """Scaled time over measured time."""
    compute_factor: float
    """Measuring GPU's peak BF16 over the target's (the factor of FLOP-bound time)."""
    memory_factor: float
    """Measuring GPU's HBM bandwidth over the target's (the factor of memory-bound time)."""
    mix: KernelMix


def _ratio(a: float | None, b: float | None, what: str, measured: GpuSpec, target: GpuSpec) -> float:
    if not a or not b:
        raise ValueError(f"cannot scale {measured.name} to {target.name}: {what} unknown for "
                         f"{measured.name if not a else target.name} (set cluster.gpu.{what})")
    return a / b


def same_gpu(measured: GpuSpec, target: GpuSpec) -> bool:
    """The same model by name (``NVIDIA H100 80GB HBM3`` is ``H100 80GB HBM3``), case aside."""
    a, b = (g.name.lower().replace("nvidia", "").strip() for g in (measured, target))
    return a == b


def scaling_factors(measured: GpuSpec, target: GpuSpec, mix: KernelMix) -> Scaling:
    """The factors of ``mix`` from ``measured`` to ``target`` (all 1 on the same GPU, comm excepted)."""
    if same_gpu(measured, target):
        cf = mf = 1.0
    else:
        cf = _ratio(measured.peak_bf16_tflops, target.peak_bf16_tflops, "peak_bf16_tflops", measured, target)
        mf = _ratio(measured.hbm_bandwidth_tbps, target.hbm_bandwidth_tbps, "hbm_bandwidth_tbps", measured, target)
    factor = mix.compute * cf + mix.memory * mf + mix.other  # communication: 0, the network model prices it
    return Scaling(factor=factor, compute_factor=cf, memory_factor=mf, mix=mix)


def scale_span(seconds: float, mix: KernelMix, measured: GpuSpec, target: GpuSpec) -> float:
    """``seconds`` of compute measured on ``measured``, as the ``target`` GPU would take them."""
    if seconds < 0:
        raise ValueError(f"a compute span cannot be negative (got {seconds} s)")
    return seconds * scaling_factors(measured, target, mix).factor


@cache
def _presets() -> tuple[GpuSpec, ...]:
    from prism_launch.config.cluster import load_cluster, preset_dir

    out = []
    for path in sorted(preset_dir().glob("*.yaml")):
        gpu = load_cluster(path).gpu
        if gpu.peak_bf16_tflops:
            out.append(gpu)
    return tuple(out)


def gpu_of(device: Mapping[str, Any] | None, target: GpuSpec) -> GpuSpec | None:
    """The measuring device a trace recorded (``measuring_device`` of its manifest) as a GpuSpec
    with datasheet peaks: the target's own where it is the same model, else a bundled preset's
    of that name; None for a CPU, an unrecorded device or a GPU of no known peaks."""
    if not device or device.get("kind") != "cuda" or not device.get("name"):
        return None
    named = GpuSpec(name=str(device["name"]))
    if same_gpu(named, target):
        return target
    return next((g for g in _presets() if same_gpu(named, g)), None)
