"""Emulation: how virtual ranks meet the sandbox ranks (timing, data path, prefetch, pruned rings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from prism_launch.config.errors import ConfigError

class Timing(StrEnum):
    predicted = "predicted"
    """Virtual members arrive at each op with the lag the global replay predicts on the target
    cluster (the capture's compute spans + the network model), relative to the sandbox."""
    recorded = "recorded"
    """Virtual members arrive with their lag in the capture's wall clock (distorted when the
    capture context-switched ranks)."""
    none = "none"
    """Virtual members are always already there (fastest; results are unchanged)."""


class VirtualHost(StrEnum):
    assistant = "assistant"
    """A separate assistant process streams the virtual ranks' recorded data to the sandbox."""
    inprocess = "inprocess"
    """Each sandbox process reads the virtual ranks' recorded data from the trace itself."""


class RingBackend(StrEnum):
    gloo = "gloo"
    """Pruned rings move host tensors over gloo."""
    nccl = "nccl"
    """Pruned rings run on the GPUs over NCCL (device=cuda; the assistant takes a GPU of its own,
    the one after the node's sandbox ranks')."""


class DataPath(StrEnum):
    auto = "auto"
    """``device`` when the sandbox runs on CUDA, else ``host``."""
    device = "device"
    """Ops whose other members are all virtual complete on the sandbox's device: the virtual
    members' recorded data prefetched into a device pool, folded there with the live tensor
    (``nccl_ext/device_path/``). Also runs on CPU (the "device" is host memory)."""
    host = "host"
    """Every op folds on the host from the live tensor (copied there) and the recorded peers."""


class PrefetchMode(StrEnum):
    stream = "stream"
    """A side thread stages ops ahead of the program, in the trace's order, into a bounded pool."""
    off = "off"
    """Each op's data is moved when the op is entered, on its own stream."""
    preload = "preload"
    """The whole run's data is staged before the first op (the reference without any
    virtual-peer data movement; needs a pool holding all of it)."""
    inline = "inline"
    """As stream, but the program's own thread issues the copies as it enters ops, one op at a
    time, from the host tier (no stager thread or batches: a device synchronise of the
    program waits for at most the copies of the last ops entered). Needs the host tier
    (``host_tier_gib``); without it, stream."""


@dataclass(kw_only=True, slots=True)
class PrefetchConfig:
    mode: PrefetchMode = PrefetchMode.stream
    """How the device data path moves the virtual members' recorded data to the device ahead of
    the ops that consume it."""
    pool_mib: int = 512
    """Device pool size (raised to twice the largest op when that does not fit)."""
    grow: bool = True
    """On CUDA, when the device can spare the run's whole staged data beyond what the program
    will still need (the capture's peak for the rank, from the trace) and ``reserve_gib``,
    ``mode=stream`` (or ``inline``) takes a pool that holds it and fills it before the first op,
    as ``preload`` does: no staging copy then runs beside the program's steps. (A copy in flight is waited for
    by every device synchronise of the program — Megatron's pipeline send/recv makes one per
    transfer — and the host tier's loader may still be behind early steps.) Sandbox ranks that
    share a GPU split its spare memory. Otherwise the pool stays at ``pool_mib`` and streams."""
    reserve_gib: float = 4.0
    """Device memory a grown pool leaves free beyond the program's expected need."""
    threads: int = 4
    """Host threads copying recorded data into pinned memory and summing it for checks."""
    host_tier_gib: float = 16.0
    """On CUDA, when the run's staged data fits in this much pinned host memory, a loader fills it
    ahead of the program (staging is then one DMA per op); else each op is copied when staged."""

    def validate(self) -> None:
        if self.pool_mib < 1:
            raise ConfigError(f"emulate.prefetch.pool_mib must be >= 1 (got {self.pool_mib})")
        if self.reserve_gib < 0:
            raise ConfigError(f"emulate.prefetch.reserve_gib must be >= 0 (got {self.reserve_gib})")
        if self.threads < 1:
            raise ConfigError(f"emulate.prefetch.threads must be >= 1 (got {self.threads})")
        if self.host_tier_gib < 0:
            raise ConfigError(f"emulate.prefetch.host_tier_gib must be >= 0 (got {self.host_tier_gib}; 0 turns "
                              "the tier off)")


@dataclass(kw_only=True, slots=True)
class EmulateConfig:
    timing: Timing = Timing.predicted
    """How virtual members' arrival times are replayed."""
    time_scale: float = 1.0
    """Multiplier on recorded waits (e.g. 0 to disable, 0.5 to halve)."""
    strict: bool = False
    """A ``value`` divergence (live data beyond the tolerance of the recorded; ``nccl_ext/replay/divergence.py``)
    is an error instead of a warning. Divergences are reported by kind: ``value``; ``tolerance``
    (non-deterministic kernels within ``divergence_rtol``); ``host_scalar`` (small contributions
    from ``host_scalar_sites``: wall-clock times, counters). The last two are never errors."""
    divergence_rtol: float | None = None
    """Tolerance under which a mismatching floating contribution counts as a non-deterministic
    kernel's (kind ``tolerance``), relative to the recorded tensor's magnitude; null: by dtype
    (fp32 1e-4, bf16 2e-2, fp16 1e-2, fp64 1e-9). Integer data is never within tolerance."""
    host_scalar_sites: list[str] = field(default_factory=lambda: [
        "megatron/core/timers.py", "megatron/training/training.py:pretrain",
        "megatron/training/training.py:checkpoint_and_decide_exit"])
    """Call sites whose small contributions carry wall-clock times or rank-local counters (kind
    ``host_scalar``): a path fragment of the file issuing the collective (first frame outside
    torch and prism), or ``fragment:function``. Defaults: Megatron's timers, its start-time and
    exit-duration all-reduces (``nccl_ext/replay/divergence.py`` says where they were read)."""
    host_scalar_max_elements: int = 64
    """Largest contribution (elements) that can be a host scalar."""
    check_divergence: bool = True
    """Compare every live contribution with the recorded one (hashing costs sandbox CPU time;
    calibration turns it off so slices measure the program, not the check)."""
    virtual_host: VirtualHost = VirtualHost.assistant
    """Who serves the virtual ranks' recorded contributions."""
    window: int = 32
    """Ops per sandbox rank the assistant may stream ahead (bounded memory)."""
    pruned_rings: bool = False
    """Collectives shared by several sandbox ranks run over pruned rings (live members plus the
    assistant playing one edge virtual rank per arc; ``nccl_ext/pruning/rings.py``) instead of every
    sandbox member gathering all live contributions and folding on the host."""
    ring_backend: RingBackend = RingBackend.gloo
    """Transport of the pruned rings: one communicator per logical group that runs them."""
    ring_tags: bool = True
    """Match the rings' messages by tag as well as order (gloo). false: by issue order only, as
    NCCL does — runs the gloo rings under NCCL's matching rule (a check that needs no GPU)."""
    data_path: DataPath = DataPath.auto
    """Where ops shared only with virtual ranks complete (device or host)."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """Tensor prefetching of the device data path."""

    def validate(self, *, on_cuda: bool) -> None:
        if self.window < 1:
            raise ConfigError(f"emulate.window must be >= 1 (got {self.window})")
        self.prefetch.validate()
        if self.ring_backend is RingBackend.nccl:
            if not on_cuda:
                raise ConfigError("emulate.ring_backend=nccl runs the pruned rings on GPUs: set device=cuda, or use "
                                  "emulate.ring_backend=gloo")
            if not self.pruned_rings:
                raise ConfigError("emulate.ring_backend=nccl is the transport of the pruned rings: set "
                                  "emulate.pruned_rings=true as well")
        if self.divergence_rtol is not None and not self.divergence_rtol >= 0:
            raise ConfigError(f"emulate.divergence_rtol must be >= 0 or null (got {self.divergence_rtol})")
        if self.host_scalar_max_elements < 0:
            raise ConfigError(f"emulate.host_scalar_max_elements must be >= 0 (got {self.host_scalar_max_elements})")
        if self.time_scale < 0:
            raise ConfigError(f"emulate.time_scale must be >= 0 (got {self.time_scale})")
