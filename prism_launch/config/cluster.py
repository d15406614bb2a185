"""The target cluster as a config: link classes and the machine room's shape (the Hydra
``cluster`` group, presets in ``configs/cluster``). The cost model
(:mod:`prism_launch.predict.cost_model`) turns it into times."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["COLLECTIVE_KINDS", "ClusterSpec", "FabricSpec", "GpuSpec", "KindCost", "LinkSpec", "cluster_from_config", "load_cluster", "preset_dir"]


# --------------------------------------------------------------------------- specs


@dataclass(kw_only=True, slots=True)
class LinkSpec:
    """One class of link (inside a node, or between nodes) as NCCL sees it."""

    bandwidth_gbps: float
    """Achievable unidirectional bus bandwidth in GB/s (1e9 B/s). For ``intra_node`` it is
    per GPU (what nccl-tests reports as all_reduce busbw inside one node); for
    ``inter_node`` it is per NIC, and a GPU's share of the network is
    ``nics_per_node × bandwidth_gbps / gpus_per_node``."""
    latency_us: float
    """Latency of one algorithm step (one hop of a ring or tree) over this link, in µs."""
    half_size_mib: float = 0.0
    """Bytes (MiB) one member streams over this link in one dependent step of an algorithm at
    which NCCL reaches half of ``bandwidth_gbps`` (pipeline fill, protocol and channel start-up;
    the curve's shape is ``curve_exponent``); 0 is the bare α–β model. The step's bytes are
    ``cost_model.curve_key``'s: ``size / p`` for a ring of ``p`` (nccl-tests ``size``), the
    member's ``1/k`` slice for a tree, the per-peer chunk for all_to_all over NVLink, the
    member's off-node bytes over the network. Fitted to published nccl-tests figures by
    ``bench/nccl_fit.py``."""
    curve_exponent: float = 1.0
    """Steepness ``k`` of the size curve: bus bandwidth is ``bandwidth_gbps × s^k / (1 + s^k)``
    with ``s = step bytes / half_size`` (1.0: the plain hyperbola; below 1, a slower ramp, as
    NCCL's protocol and channel-count changes spread it over more sizes)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "link") -> None:
        bw = self.bandwidth_gbps
        if not (isinstance(bw, (int, float)) and bw > 0 and math.isfinite(bw)):
            raise ValueError(f"{where}.bandwidth_gbps must be a finite number > 0 (got {self.bandwidth_gbps!r})")
        if not (isinstance(self.latency_us, (int, float)) and self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"{where}.latency_us must be a finite number >= 0 (got {self.latency_us!r})")
        h = self.half_size_mib
        if not (isinstance(h, (int, float)) and h >= 0 and math.isfinite(h)):
            raise ValueError(f"{where}.half_size_mib must be a finite number >= 0 (got {h!r})")
        k = self.curve_exponent
        if not (isinstance(k, (int, float)) and 0 < k <= 4 and math.isfinite(k)):
            raise ValueError(f"{where}.curve_exponent must be a number in (0, 4] (got {k!r})")


@dataclass(kw_only=True, slots=True)
class FabricSpec:
    """The network between nodes: a rail-optimised two-level fat tree (leaf switches per rail,
    spines above them), as DGX SuperPOD and most H100 clouds build it."""

    nodes_per_leaf: int = 32
    """Nodes whose same-rail NICs share one leaf switch (a scalable unit; DGX H100 SuperPOD: 32).
    Traffic between NICs of one leaf stays there; any other crosses the leaf's uplinks."""
    oversubscription: float = 1.0
    """Leaf down-link to up-link bandwidth ratio (1.0: non-blocking; 2.0: a leaf's uplinks carry
    half of what its NICs can send). Slows only traffic that leaves a leaf."""

    def validate(self, where: str = "cluster.fabric") -> None:
        if not isinstance(self.nodes_per_leaf, int) or self.nodes_per_leaf < 1:
            raise ValueError(f"{where}.nodes_per_leaf must be an integer >= 1 (got {self.nodes_per_leaf!r})")
        o = self.oversubscription
        if not (isinstance(o, (int, float)) and o >= 1.0 and math.isfinite(o)):
            raise ValueError(f"{where}.oversubscription must be a finite number >= 1.0 (got {o!r})")


COLLECTIVE_KINDS: tuple[str, ...] = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
)
"""Collective kinds a cost model prices (``nccl_ext.core.ops.Collective`` values)."""


@dataclass(kw_only=True, slots=True)
class KindCost:
    """One collective kind's own per-op cost, measured (``cluster.kinds``): where kinds differ by more
    than their hop counts and bytes (gloo on one host: a 512 KiB all_reduce costs several times a
    broadcast of the same size), this replaces, for that kind, the cluster's ``protocol_latency_us``
    and its links' ``latency_us`` and ``bandwidth_gbps`` in the same ring formulas."""

    overhead_us: float = 0.0
    """Fixed cost of one op of this kind in µs."""
    latency_us: float = 0.0
    """Per-hop latency in µs."""
    bandwidth_gbps: float
    """Bus bandwidth in GB/s."""

    def validate(self, where: str) -> None:
        for f in ("overhead_us", "latency_us"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{where}.{f} must be a finite number >= 0 (got {v!r})")
        b = self.bandwidth_gbps
        if not (isinstance(b, (int, float)) and b > 0 and math.isfinite(b)):
            raise ValueError(f"{where}.bandwidth_gbps must be a finite number > 0 (got {b!r})")


@dataclass(kw_only=True, slots=True)
class GpuSpec:
    """One GPU of the target cluster as its datasheet states it (dense figures, no sparsity):
    what compute spans measured on another device are scaled to, and the peak that MFU is
    reported against. A figure left null is unknown: nothing that needs it is computed."""

    name: str = "unknown"
    """The GPU's model as ``torch.cuda.get_device_name`` spells it (``NVIDIA H100 80GB HBM3``) or
    a short form of it (``H100 SXM``); a trace measured on a GPU of the same name is not scaled."""
    peak_bf16_tflops: float | None = None
    """Peak dense BF16 tensor-core rate in TFLOP/s (1e12 FLOP/s): the peak MFU is reported
    against, and the rate FLOP-bound kernels are scaled by."""
    peak_fp8_tflops: float | None = None
    """Peak dense FP8 tensor-core rate in TFLOP/s (null: the GPU has no FP8 tensor cores)."""
    hbm_bandwidth_tbps: float | None = None
    """Peak memory (HBM) bandwidth in TB/s (1e12 B/s): the rate memory-bound kernels are scaled by."""
    memory_gb: float | None = None
    """Memory of one GPU in GB (1e9 B) as the datasheet states it (``gpu_memory_gib`` is what
    the OOM verdict uses)."""

    def validate(self, where: str = "cluster.gpu") -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}.name must be a non-empty string (got {self.name!r})")
        for f in ("peak_bf16_tflops", "peak_fp8_tflops", "hbm_bandwidth_tbps", "memory_gb"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{where}.{f} must be a finite number > 0 or null (got {v!r})")


@dataclass(kw_only=True, slots=True)
class ClusterSpec:
    """The target cluster's shape and interconnect (a Hydra ``cluster`` preset)."""

    name: str
    """Preset name, used in reports."""
    gpus_per_node: int
    """GPUs sharing the fast intra-node fabric (NVLink domain); node of a rank = rank // gpus_per_node."""
    gpu_memory_gib: float
    """Memory of one GPU in GiB (nominal capacity)."""
    intra_node: LinkSpec
    """Link between GPUs of one node (NVLink/NVSwitch, or loopback for a local preset)."""
    inter_node: LinkSpec
    """Link between nodes; ``bandwidth_gbps`` is per NIC."""
    nics_per_node: int
    """Network adapters per node; the node's network bandwidth is ``nics_per_node × inter_node.bandwidth_gbps``."""
    protocol_latency_us: float = 7.0
    """Fixed cost of launching one NCCL operation in µs, paid once per collective or transfer."""
    nvls: bool = False
    """NVLink SHARP (NVSwitch in-switch reduction, H100/H200/GB200): all_reduce among GPUs of one
    NVLink domain may use NCCL's NVLS algorithm (and NVLS-tree across nodes) when it is faster."""
    nvls_bandwidth_gbps: float = 0.0
    """Algorithm bandwidth (bytes of the buffer per second, GB/s) of an NVLS all_reduce at large
    sizes: busbw = this × 2(p−1)/p (8× H100: ~275 GB/s algbw = ~480 GB/s busbw)."""
    sharp: bool = False
    """InfiniBand SHARP (in-network reduction, NCCL's CollNet): all_reduce across nodes may reduce
    in the switches, so each node sends and receives the buffer once whatever the node count."""
    fabric: FabricSpec = field(default_factory=FabricSpec)
    """Shape of the network between nodes (leaf width, oversubscription)."""
    device: str = "cuda"
    """Kind of device the cluster's ranks compute on (``cuda`` or ``cpu``): a prediction whose
    compute spans were measured on another kind says so in its report (they are not scaled)."""
    gpu: GpuSpec = field(default_factory=GpuSpec)
    """The cluster's GPU (name, datasheet peaks): compute measured on another GPU is scaled to it,
    and a prediction's MFU is reported against its ``peak_bf16_tflops``."""
    kinds: dict[str, KindCost] = field(default_factory=dict)
    """Per collective kind (``all_reduce``, ``reduce_scatter``, ...), its own measured cost
    (:class:`KindCost`, e.g. ``bench/fidelity.py``'s gloo figures); kinds not named use the links'."""
    comm_overlaps_compute: bool | None = None
    """Whether a rank computes while its asynchronous collectives move data. Default: true on
    ``cuda`` (copy engines and NCCL's own SMs move the bytes), false on ``cpu`` (gloo moves them
    with the cores that compute: an overlapped collective's time is paid on the issuing rank's
    timeline all the same)."""

    @property
    def comm_on_cores(self) -> bool:
        """Collectives take their time from the issuing rank's compute (see ``comm_overlaps_compute``)."""
        overlaps = self.comm_overlaps_compute
        return not (self.device == "cuda" if overlaps is None else overlaps)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"cluster.gpus_per_node must be an integer >= 1 (got {self.gpus_per_node!r})")
        if not isinstance(self.nics_per_node, int) or self.nics_per_node < 1:
            raise ValueError(f"cluster.nics_per_node must be an integer >= 1 (got {self.nics_per_node!r})")
        if not (isinstance(self.gpu_memory_gib, (int, float)) and self.gpu_memory_gib > 0):
            raise ValueError(f"cluster.gpu_memory_gib must be > 0 (got {self.gpu_memory_gib!r})")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"cluster.device must be cuda or cpu (got {self.device!r})")
        if not (isinstance(self.protocol_latency_us, (int, float)) and self.protocol_latency_us >= 0):
            raise ValueError(f"cluster.protocol_latency_us must be >= 0 (got {self.protocol_latency_us!r})")
        for field_name in ("intra_node", "inter_node"):
            link = getattr(self, field_name)
            if not isinstance(link, LinkSpec):
                raise ValueError(f"cluster.{field_name} must be a LinkSpec (got {type(link).__name__})")
            link.validate(f"cluster.{field_name}")
        if not isinstance(self.fabric, FabricSpec):
            raise ValueError(f"cluster.fabric must be a FabricSpec (got {type(self.fabric).__name__})")
        self.fabric.validate()
        if not isinstance(self.nvls, bool) or not isinstance(self.sharp, bool):
            raise ValueError(f"cluster.nvls and cluster.sharp must be true or false (got {self.nvls!r}, {self.sharp!r})")
        nb = self.nvls_bandwidth_gbps
        if not (isinstance(nb, (int, float)) and nb >= 0 and math.isfinite(nb)) or (self.nvls and nb <= 0):
            raise ValueError(f"cluster.nvls_bandwidth_gbps must be > 0 when nvls is true, >= 0 otherwise (got {nb!r})")
        if self.comm_overlaps_compute not in (None, True, False):
            raise ValueError(f"cluster.comm_overlaps_compute must be true, false or null "
                             f"(got {self.comm_overlaps_compute!r})")
        for kind, cost in self.kinds.items():
            if kind not in COLLECTIVE_KINDS:
                raise ValueError(f"cluster.kinds: unknown collective kind {kind!r} (valid: {', '.join(COLLECTIVE_KINDS)})")
            if not isinstance(cost, KindCost):
                raise ValueError(f"cluster.kinds.{kind} must be a KindCost (got {type(cost).__name__})")
            cost.validate(f"cluster.kinds.{kind}")
        if not isinstance(self.gpu, GpuSpec):
            raise ValueError(f"cluster.gpu must be a GpuSpec (got {type(self.gpu).__name__})")
        self.gpu.validate()

    @property
    def network_share_gbps(self) -> float:
        """One GPU's share of its node's network bandwidth, in GB/s."""
        return self.nics_per_node * self.inter_node.bandwidth_gbps / self.gpus_per_node


def preset_dir() -> Path:
    """Directory of the bundled ``cluster`` presets (``configs/cluster``)."""
    import configs

    return Path(configs.__file__).resolve().parent / "cluster"


def cluster_from_config(cfg: Any) -> ClusterSpec:
    """A validated :class:`ClusterSpec` from a ClusterSpec, a mapping or an OmegaConf node."""
    if isinstance(cfg, ClusterSpec):
        cfg.validate()
        return cfg
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(ClusterSpec), cfg)
    spec = OmegaConf.to_object(merged)
    assert isinstance(spec, ClusterSpec)
    return spec


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """Load a cluster YAML: a path, or the name of a bundled preset (``h100_ib``)."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = preset_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in preset_dir().glob("*.yaml"))
        raise FileNotFoundError(
            f"no cluster config {str(name_or_path)!r} (a YAML path or one of the presets: {', '.join(names)})"
        )
    try:
        return cluster_from_config(OmegaConf.load(path))
    except Exception as e:  # OmegaConf errors carry the offending key
        raise ValueError(f"invalid cluster config {path}: {e}") from None
