"""Typed configuration of one prism-launch run, registered in Hydra's ConfigStore.

The dataclasses below are the single source of every knob; ``configs/config.yaml``
only selects them. The torchrun flags fill ``target.nnodes`` / ``target.nproc_per_node``
(the **target** job); ``key=value`` overrides on the command line go through Hydra.
Composition errors name the field (OmegaConf's ``full_key``); :func:`validate` adds the
semantic checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from prism_launch.config.cluster import ClusterSpec
from omegaconf import MISSING  # noqa: F401  (re-exported for configs)


class Mode(StrEnum):
    real = "real"
    """Every rank physical, like torchrun (the baseline runner)."""
    capture = "capture"
    """Every logical rank runs; the coordinator computes collectives and writes a PrismTrace."""
    emulate = "emulate"
    """Only sandbox ranks run; virtual ranks are replayed from the trace."""
    calibrate = "calibrate"
    """Run slices of ranks for real against the bare trace; write the calibrated trace."""
    auto = "auto"
    """Capture when no matching trace exists, then emulate."""


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


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


class StartMethod(StrEnum):
    fork = "fork"
    """Ranks forked from the warmed launcher (fast, light: shared pages)."""
    spawn = "spawn"
    """Each rank a fresh ``python -m prism_launch.rank.bootstrap`` (always used with --no-python)."""


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
    global_batch_size: int | None = None
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 0-3 (``zero_optimization.stage``; ``integration.kind=deepspeed``)."""


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


@dataclass(kw_only=True, slots=True)
class SandboxConfig:
    ranks: list[int] = field(default_factory=lambda: [0])
    """Logical ranks that run the real program in emulation."""


@dataclass(kw_only=True, slots=True)
class TraceConfig:
    dir: str | None = None
    """Trace directory. Default: ``prism_traces/<script>-<fingerprint>`` under the working directory."""


class Park(StrEnum):
    auto = "auto"
    """``cuda_checkpoint`` on CUDA when ``capture.resident`` is set, else ``none``."""
    none = "none"
    """Parked ranks keep their state where it is (host memory on CPU)."""
    cuda_checkpoint = "cuda_checkpoint"
    """Parked ranks' GPU memory moves to host memory through the CUDA driver's checkpoint API
    (``cuCheckpointProcess*``) and back before they resume."""


@dataclass(kw_only=True, slots=True)
class CaptureConfig:
    warm_imports: list[str] = field(default_factory=lambda: ["torch", "megatron.core"])
    """Modules imported once in the launcher before ranks are forked (missing ones are skipped)."""
    slots: int | None = None
    """Logical ranks that run at once; the others are parked (blocked on communication) or
    waiting for a slot. Default: the number of GPUs on CUDA, of CPU cores on CPU. 0: no limit."""
    park: Park = Park.auto
    """What parking does with a blocked rank's device state."""
    resident: int | None = None
    """With ``park=cuda_checkpoint``: ranks whose GPU state may stay on the device at once
    (running + parked); more parked ranks are checkpointed to host memory. Default: ``slots``."""
    fold: bool | None = None
    """Symmetry-folded capture: capture only the ranks closed under the sandbox ranks'
    model-parallel groups and derive data-parallel replicas from them. Default (None):
    fold when the world has more than ``fold_threshold`` ranks."""
    fold_threshold: int = 64
    """World size above which ``fold`` (when unset) turns on."""
    replicated_groups: list[str] = field(default_factory=lambda: [
        "DATA_PARALLEL", "HYBRID_DP", "DISTRIBUTED_OPTIMIZER_INSTANCE", "default_pg"])
    """Substrings of group descriptions (``group_desc``) that mark groups spanning
    data-parallel replicas; folding never follows them. Groups without a description are
    treated as model-parallel (followed), which only makes the captured set larger."""


class DataPath(StrEnum):
    auto = "auto"
    """``device`` when the sandbox runs on CUDA, else ``host``."""
    device = "device"
    """Ops whose other members are all virtual complete on the sandbox's device: the virtual
    members' recorded data prefetched into a device pool, folded there with the live tensor
    (``nccl_ext/device_path.py``). Also runs on CPU (the "device" is host memory)."""
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


@dataclass(kw_only=True, slots=True)
class EmulateConfig:
    timing: Timing = Timing.predicted
    """How virtual members' arrival times are replayed."""
    time_scale: float = 1.0
    """Multiplier on recorded waits (e.g. 0 to disable, 0.5 to halve)."""
    strict: bool = False
    """Divergence of a live contribution from the recorded one is an error instead of a warning."""
    check_divergence: bool = True
    """Compare every live contribution with the recorded one (hashing costs sandbox CPU time;
    calibration turns it off so slices measure the program, not the check)."""
    virtual_host: VirtualHost = VirtualHost.assistant
    """Who serves the virtual ranks' recorded contributions."""
    window: int = 32
    """Ops per sandbox rank the assistant may stream ahead (bounded memory)."""
    pruned_rings: bool = False
    """Collectives shared by several sandbox ranks run over pruned rings (live members plus the
    assistant playing one edge virtual rank per arc; ``nccl_ext/pruning.py``) instead of every
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
    wall = "wall"
    cpu = "cpu"


@dataclass(kw_only=True, slots=True)
class CalibrateConfig:
    slice_size: int = 2
    """Ranks run for real at once in each calibration slice (≤ free devices / cores for clean timings)."""
    ranks: list[int] | None = None
    """Ranks to calibrate (default: every captured rank)."""
    measure: Measure = Measure.wall
    """Which clock of the slice runs becomes the calibrated compute span."""
    in_auto: bool | None = None
    """Whether ``mode=auto`` calibrates after capturing. Default: on CUDA only (see replay.compute)."""


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


@dataclass(kw_only=True, slots=True)
class MemoryConfig:
    track: bool = True
    """Allocator-level accounting of every rank's memory (CUDA caching allocator / c10 CPU allocator)."""
    enforce_limit: bool | None = None
    """Cap sandbox ranks' allocators at ``cluster.gpu_memory_gib`` so a real OOM happens where the
    target's would. Default: on CUDA only."""


@dataclass(kw_only=True, slots=True)
class PhysicalConfig:
    """The machines the sandbox ranks run on (emulation)."""

    nodes: int = 1
    """Physical machines sharing the sandbox ranks; start one prism-launch per machine with the
    same command and its ``physical.node_rank``."""
    node_rank: int = 0
    """This machine's index; node 0 hosts the rendezvous store, the assistant and the report."""
    endpoint: str | None = None
    """``host:port`` of node 0's c10d TCPStore (required when ``nodes > 1``; node 0 listens on
    the port, like torchrun's ``--rdzv-endpoint``)."""


@dataclass(kw_only=True, slots=True)
class CommConfig:
    timeout_s: float = 300.0
    """Deadline of every communication wait; a wait past it fails naming rank, group, op and sequence number."""


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    start_method: StartMethod | None = None
    """How rank processes start. Default: fork on CPU; spawn on CUDA (a forked child cannot use
    a CUDA driver its parent touched)."""
    teardown_timeout_s: float = 10.0
    """Grace between SIGTERM and SIGKILL when tearing ranks down."""
    run_timeout_s: float | None = None
    """Wall-clock limit of the whole run (None: unlimited; comm deadlines still apply)."""


@dataclass(kw_only=True, slots=True)
class CompatConfig:
    modules: list[str] = field(default_factory=lambda: ["integrations.cpu_compat", "integrations.megatron_compat"])
    """Integration modules activated in every rank when ``device=cpu`` (each exposes ``install()``)."""


@dataclass(kw_only=True, slots=True)
class ReportConfig:
    dir: str | None = None
    """Where emulation writes its report. Default: ``<trace.dir>/report``."""
    loss_pattern: str = r"\bloss[\s=:|]+([-+0-9.eEinfa]+)"
    """Regex whose first group is the loss in a rank's log line (for the step table)."""
    step_pattern: str = r"\bstep[\s=:]+(\d+)"
    """Regex whose first group is the step number in the same line."""


@dataclass(kw_only=True, slots=True)
class FlagNames:
    """The recipe's own flag for each ``target.parallel`` field; None: the integration's
    default (Megatron-LM's names, e.g. ``--tensor-model-parallel-size``)."""

    tp: str | None = None
    pp: str | None = None
    ep: str | None = None
    cp: str | None = None
    etp: str | None = None
    micro_batch_size: str | None = None
    global_batch_size: str | None = None


@dataclass(kw_only=True, slots=True)
class IntegrationConfig:
    """How ``target.parallel`` and ``script.args`` reach the recipe. Core code imports the
    integration modules by name only."""

    kind: str = "megatron"
    """Key into ``modules``: ``megatron`` (flags), ``deepspeed`` (JSON config), ``none``."""
    modules: dict[str, str] = field(default_factory=lambda: {
        "megatron": "integrations.megatron_flags", "deepspeed": "integrations.deepspeed_config"})
    """Renderer module per kind; each exposes ``render(cfg, script_args, out_dir) -> list[str]``."""
    flags: FlagNames = field(default_factory=FlagNames)
    render_dir: str | None = None
    """Where rendered files (DeepSpeed configs) go. Default: the run's output dir (a sweep
    point's directory; ``prism_rendered/`` for a single run)."""
    moe: str | None = "integrations.megatron_moe"
    """Module that finds MoE token dispatches in a trace (for the report's ``moe`` section)."""


@dataclass(kw_only=True, slots=True)
class ScriptConfig:
    args: dict[str, Any] = field(default_factory=dict)
    """Script flags set from the config (sweepable): ``script.args.moe_router_topk=1,2`` renders
    ``--moe-router-topk 1``; ``true`` adds a bare flag, ``false`` removes it, null leaves it."""


@dataclass(kw_only=True, slots=True)
class SweepConfig:
    rank_by: str = "iteration_time_s"
    """Summary column the terminal table is ranked by (ascending)."""


@dataclass(kw_only=True, slots=True)
class PrismConfig:
    mode: Mode = Mode.auto
    """real | capture | emulate | auto."""
    device: Device | None = None
    """cpu | cuda; default cuda when available."""
    target: TargetConfig = field(default_factory=TargetConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    physical: PhysicalConfig = field(default_factory=PhysicalConfig)
    integration: IntegrationConfig = field(default_factory=IntegrationConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    cluster: ClusterSpec = MISSING
    """The target machine room (Hydra group ``cluster``: h100_ib, h200_ib, a100_ib, gb200_nvl72, cpu_local)."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def register() -> None:
    ConfigStore.instance().store(name="prism_schema", node=PrismConfig)


def config_dir() -> Path:
    import configs

    return Path(configs.__file__).parent


def normalize_overrides(overrides: list[str]) -> list[str]:
    """``script.args.KEY=V`` adds or replaces a key of an open dict: Hydra spells that ``++``."""
    return [f"++{o}" if o.startswith("script.args.") else o for o in overrides]


def compose(overrides: list[str]) -> PrismConfig:
    """Compose ``configs/config.yaml`` with ``overrides`` into a validated-type PrismConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=normalize_overrides(list(overrides)))
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ or e
        raise ConfigError(f"invalid configuration: {e}: {cause}") from None


def resolve_defaults(cfg: PrismConfig) -> PrismConfig:
    """Fill values that depend on the machine (device)."""
    if cfg.device is None:
        import torch

        cfg.device = Device.cuda if torch.cuda.is_available() else Device.cpu
    if cfg.target.world_size is None:
        cfg.target.world_size = cfg.target.nnodes * cfg.target.nproc_per_node
    return cfg


def validate(cfg: PrismConfig) -> None:
    """Semantic checks; each error names the field and what to do."""
    ws = cfg.target.world_size
    if ws is None or ws < 1:
        raise ConfigError(f"target.world_size must be >= 1 (got {ws}); set --nnodes/--nproc-per-node or target.world_size=")
    if cfg.target.nnodes < 1 or cfg.target.nproc_per_node < 1:
        raise ConfigError("--nnodes and --nproc-per-node must be >= 1")
    if not cfg.sandbox.ranks:
        raise ConfigError("sandbox.ranks must name at least one rank, e.g. sandbox.ranks=[0]")
    bad = [r for r in cfg.sandbox.ranks if not 0 <= r < ws]
    if bad:
        raise ConfigError(
            f"sandbox.ranks: rank(s) {bad} out of range for a logical world of {ws} ranks "
            f"(valid: 0..{ws - 1})"
        )
    if len(set(cfg.sandbox.ranks)) != len(cfg.sandbox.ranks):
        raise ConfigError(f"sandbox.ranks has duplicates: {cfg.sandbox.ranks}")
    if cfg.calibrate.slice_size < 1:
        raise ConfigError(f"calibrate.slice_size must be >= 1 (got {cfg.calibrate.slice_size})")
    bad = [r for r in (cfg.calibrate.ranks or []) if not 0 <= r < ws]
    if bad:
        raise ConfigError(f"calibrate.ranks: {bad} out of range for a world of {ws}")
    try:
        cfg.cluster.validate()
    except ValueError as e:
        raise ConfigError(f"cluster: {e}") from None
    if cfg.comm.timeout_s <= 0:
        raise ConfigError(f"comm.timeout_s must be > 0 (got {cfg.comm.timeout_s})")
    if cfg.capture.slots is not None and cfg.capture.slots < 0:
        raise ConfigError(f"capture.slots must be >= 0 (got {cfg.capture.slots}; 0 means no limit)")
    if cfg.capture.fold_threshold < 1:
        raise ConfigError(f"capture.fold_threshold must be >= 1 (got {cfg.capture.fold_threshold})")
    for name in ("tp", "pp", "ep", "cp", "etp", "micro_batch_size", "global_batch_size"):
        v = getattr(cfg.target.parallel, name)
        if v is not None and v < 1:
            raise ConfigError(f"target.parallel.{name} must be >= 1 (got {v})")
    zs = cfg.target.parallel.zero_stage
    if zs is not None and not 0 <= zs <= 3:
        raise ConfigError(f"target.parallel.zero_stage must be 0, 1, 2 or 3 (got {zs})")
    if zs is not None and cfg.integration.kind != "deepspeed":
        raise ConfigError("target.parallel.zero_stage renders into a DeepSpeed config: set integration.kind=deepspeed")
    if cfg.integration.kind != "none" and cfg.integration.kind not in cfg.integration.modules:
        raise ConfigError(f"integration.kind={cfg.integration.kind!r} is not one of "
                          f"{sorted(cfg.integration.modules)} or 'none' (see integration.modules)")
    ph = cfg.physical
    if ph.nodes < 1 or not 0 <= ph.node_rank < ph.nodes:
        raise ConfigError(f"physical.node_rank must be in [0, physical.nodes={ph.nodes}) (got {ph.node_rank})")
    if ph.nodes > 1:
        if not ph.endpoint or ":" not in ph.endpoint or not ph.endpoint.rsplit(":", 1)[1].isdigit():
            raise ConfigError(f"physical.nodes={ph.nodes} needs physical.endpoint=HOST:PORT of node 0's store "
                              f"(got {ph.endpoint!r})")
        if len(cfg.sandbox.ranks) < ph.nodes:
            raise ConfigError(f"physical.nodes={ph.nodes} but only {len(cfg.sandbox.ranks)} sandbox rank(s): "
                              "every node needs at least one sandbox rank")
    if cfg.emulate.window < 1:
        raise ConfigError(f"emulate.window must be >= 1 (got {cfg.emulate.window})")
    pf = cfg.emulate.prefetch
    if pf.pool_mib < 1:
        raise ConfigError(f"emulate.prefetch.pool_mib must be >= 1 (got {pf.pool_mib})")
    if pf.reserve_gib < 0:
        raise ConfigError(f"emulate.prefetch.reserve_gib must be >= 0 (got {pf.reserve_gib})")
    if pf.threads < 1:
        raise ConfigError(f"emulate.prefetch.threads must be >= 1 (got {pf.threads})")
    if pf.host_tier_gib < 0:
        raise ConfigError(f"emulate.prefetch.host_tier_gib must be >= 0 (got {pf.host_tier_gib}; 0 turns the tier off)")
    if cfg.emulate.ring_backend is RingBackend.nccl:
        if cfg.device is not Device.cuda:
            raise ConfigError("emulate.ring_backend=nccl runs the pruned rings on GPUs: set device=cuda, or use "
                              "emulate.ring_backend=gloo")
        if not cfg.emulate.pruned_rings:
            raise ConfigError("emulate.ring_backend=nccl is the transport of the pruned rings: set "
                              "emulate.pruned_rings=true as well")
    if cfg.emulate.time_scale < 0:
        raise ConfigError(f"emulate.time_scale must be >= 0 (got {cfg.emulate.time_scale})")
    if cfg.device is Device.cuda:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is available here; use device=cpu")
