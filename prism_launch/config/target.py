"""The target job: the logical world, its parallel layout, and the sandbox ranks that run for real."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from prism_launch.config.errors import ConfigError

class Device(StrEnum):
    cpu = "cpu"
    """Ranks compute on the CPU, through the CPU compatibility layers."""
    cuda = "cuda"
    """Ranks compute on GPUs, one device slot each."""


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallelism of the target job, rendered into the recipe's own arguments by the
    integration (``integration.kind``). None leaves the script's arguments alone."""

    tp: int | None = None
    """Tensor-parallel size."""
    pp: int | None = None
    """Pipeline-parallel size."""
    ep: int | None = None
    """Expert-parallel size."""
    cp: int | None = None
    """Context-parallel size."""
    etp: int | None = None
    """Expert tensor-parallel size."""
    micro_batch_size: int | None = None
    """Micro-batch size per rank."""
    global_batch_size: int | None = None
    """Global batch size (must divide by ``micro_batch_size`` × data-parallel size)."""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 0-3 (``zero_optimization.stage``; ``integration.kind=deepspeed``)."""

    def validate(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "etp", "micro_batch_size", "global_batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"target.parallel.{name} must be >= 1 (got {v})")
        zs = self.zero_stage
        if zs is not None and not 0 <= zs <= 3:
            raise ConfigError(f"target.parallel.zero_stage must be 0, 1, 2 or 3 (got {zs})")


@dataclass(kw_only=True, slots=True)
class TargetConfig:
    """The job being emulated."""

    world_size: int | None = None
    """Logical world size; default nnodes × nproc_per_node from the torchrun flags."""
    nnodes: int = 1
    """Nodes of the target job (from ``--nnodes``)."""
    nproc_per_node: int = 1
    """Ranks per target node (from ``--nproc-per-node``)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallelism rendered into the script's arguments (sweep it: ``target.parallel.tp=2,4``)."""

    def validate(self) -> None:
        ws = self.world_size
        if ws is None or ws < 1:
            raise ConfigError(f"target.world_size must be >= 1 (got {ws}); set --nnodes/--nproc-per-node or "
                              "target.world_size=")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ConfigError("--nnodes and --nproc-per-node must be >= 1")
        self.parallel.validate()


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    ranks: list[int] = field(default_factory=lambda: [0])
    """Logical ranks that run the real program in emulation."""

    def validate(self, world_size: int) -> None:
        if not self.ranks:
            raise ConfigError("sandbox.ranks must name at least one rank, e.g. sandbox.ranks=[0]")
        bad = [r for r in self.ranks if not 0 <= r < world_size]
        if bad:
            raise ConfigError(f"sandbox.ranks: rank(s) {bad} out of range for a logical world of {world_size} "
                              f"ranks (valid: 0..{world_size - 1})")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"sandbox.ranks has duplicates: {self.ranks}")
