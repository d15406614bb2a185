"""Predictions: slice calibration, the global replay, memory accounting and the target's memory cap."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prism_launch.config.errors import ConfigError

class ComputeSource(StrEnum):
    auto = "auto"
    """``calibrated`` on CUDA; ``cpu`` on CPU, where a rank's thread CPU time between events is
    already free of time-slicing and calibration slices would mostly measure the emulation's own
    work (the sandbox folds collectives on the cores the program computes on)."""
    calibrated = "calibrated"
    """Slice-measured compute spans when a calibrated trace exists, else ``cpu``."""
    cpu = "cpu"
    """The capture's per-rank CPU time between events (free of time-slicing on CPU)."""
    wall = "wall"
    """The capture's wall time between events (distorted when ranks share devices)."""


class Measure(StrEnum):
    device = "device"
    """The device's own timeline between the rank's events (CUDA events on the program's stream:
    kernels, and the GPU's idle time while the CPU had not issued work yet); wall time where
    there is none (CPU runs, spans before the process used CUDA)."""
    wall = "wall"
    """Host wall time between the rank's events (a GPU backlog drains inside the next op that
    synchronizes, so spans before it come out short when the CPU runs ahead)."""
    cpu = "cpu"
    """The rank's thread CPU time."""


@dataclass(kw_only=True, slots=True)
class CalibrateConfig:
    slice_size: int | None = None
    """Ranks run for real at once in each calibration slice. Default, and the most a slice ever
    takes: one rank per device (the GPUs present on CUDA, the cores on CPU), so no two ranks of a
    slice share a device and no measured span carries another rank's contention."""
    ranks: list[int] | None = None
    """Ranks to calibrate, each measured itself (default: one member of every shard class,
    :mod:`prism_launch.predict.shard_classes`, its median applied to the whole class)."""
    repeats: int = 3
    """Measurements per shard class (distinct members where the class has them); the per-event
    median over them, and over the steady steps where those repeat the same events, becomes the
    class's spans, scaled so a steady step sums to the median (run, step) total."""
    measure: Measure = Measure.device
    """Which clock of the slice runs becomes the calibrated compute span."""
    kernel_mix: bool | None = None
    """Each slice's ranks list the kernels of their first steady step (step 2; left out of the pooled
    steps where two others remain) with ``torch.profiler``; each shard class's kernel time split into
    FLOP-bound, memory-bound and communication kernels becomes its kernel mix, and that time over
    the class's calibrated steady step its GPU-busy share (the rest, the GPU waiting on its host, is
    not scaled). The mix scales its spans to the cluster's GPU where that differs from the measuring
    one (``prism_launch.predict.gpu_scaling``; the report's ``compute_scaling``). Default: on CUDA
    only (on CPU the ops are listed but nothing is scaled)."""
    in_auto: bool | None = None
    """Whether ``mode=auto`` calibrates after capturing. Default: on CUDA only (see replay.compute)."""

    def validate(self, world_size: int) -> None:
        if self.repeats < 1:
            raise ConfigError(f"calibrate.repeats must be >= 1 (got {self.repeats})")
        if self.slice_size is not None and self.slice_size < 1:
            raise ConfigError(f"calibrate.slice_size must be >= 1 (got {self.slice_size})")
        bad = [r for r in (self.ranks or []) if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"calibrate.ranks: {bad} out of range for a world of {world_size}")


class HostGaps(StrEnum):
    measured = "measured"
    """Compute spans as calibrated: where the GPU waited on its host (a host-bound program: many
    small kernels), that wait is part of the span, as it is on the measuring host."""
    removed = "removed"
    """A what-if of a host that keeps up (CUDA graphs, a faster CPU): each span of a shard class
    whose GPU-busy share was profiled (``calibrate.kernel_mix``) keeps its kernels' share only;
    spans of classes never profiled stay as measured, and the report counts them."""


@dataclass(kw_only=True, slots=True)
class ReplayConfig:
    compute: ComputeSource = ComputeSource.auto
    """Where the global replay takes compute spans from."""
    cost_model: str = "nccl"
    """Network cost model (prism_launch.predict.cost_model registry)."""
    timeline_ranks: list[int] | None = None
    """Ranks in the timeline (default: sandbox ranks plus an even sample)."""
    timeline_max_ranks: int = 64
    """Cap on sampled timeline ranks."""
    compute_speedup: float = 1.0
    """Every compute span is divided by this after scaling to the target GPU: a what-if for a
    faster implementation than the one measured (e.g. Transformer Engine's fused layers against
    megatron-core's local ones, as measured by ``bench/gpu_layer_factor.py``). The report states it."""
    host_gaps: HostGaps = HostGaps.measured
    """Whether compute spans keep the time the GPU waited on its host (``removed``: the what-if
    of a host that keeps up). Applied before ``compute_speedup``; the report states it."""

    def validate(self) -> None:
        if self.timeline_max_ranks < 1:
            raise ConfigError(f"replay.timeline_max_ranks must be >= 1 (got {self.timeline_max_ranks})")
        if not self.compute_speedup > 0:
            raise ConfigError(f"replay.compute_speedup must be > 0 (got {self.compute_speedup})")


@dataclass(kw_only=True, slots=True)
class MemoryConfig:
    track: bool = True
    """Allocator-level accounting of every rank's memory (CUDA caching allocator / c10 CPU allocator)."""
    enforce_limit: bool | None = None
    """Cap sandbox ranks' allocators at ``cluster.gpu_memory_gib`` so a real OOM happens where the
    target's would. Default: on CUDA only."""
    cpu_hook: bool = True
    """On CPU, count every allocation exactly with a native hook on c10's CPU allocator (built once
    with the system C++ compiler); false falls back to sampling tensor storage."""
    cache_dir: str | None = None
    """Where the built CPU hook is cached. Default: ``$XDG_CACHE_HOME/prism_launch`` or
    ``~/.cache/prism_launch``."""
