"""The whole config: :class:`PrismConfig` (every section), its registration in Hydra's
ConfigStore, composition from ``configs/config.yaml`` with ``key=value`` overrides, and
:func:`resolve`, the one place where every ``auto``/unset default that depends on the machine
or on other fields becomes a concrete value."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from prism_launch.config.capture import CaptureConfig, Park, TraceConfig
from prism_launch.config.cluster import ClusterSpec
from prism_launch.config.emulate import DataPath, EmulateConfig
from prism_launch.config.errors import ConfigError
from prism_launch.config.integration import CompatConfig, IntegrationConfig, ScriptConfig, SweepConfig
from prism_launch.config.predict import CalibrateConfig, ComputeSource, MemoryConfig, ReplayConfig
from prism_launch.config.run import CommConfig, LaunchConfig, Mode, PhysicalConfig, ReportConfig, StartMethod
from prism_launch.config.target import Device, SandboxConfig, TargetConfig

MISSING = "???"
"""OmegaConf's mark of a required value (``omegaconf.MISSING``), spelled here so that a rank,
which loads only its plan from this package, never imports Hydra or OmegaConf."""


@dataclass(kw_only=True, slots=True)
class PrismConfig:
    mode: Mode = Mode.auto
    """What the run does: ``auto`` captures when no matching trace exists, then emulates (and on
    CUDA calibrates in between, see ``calibrate.in_auto``)."""
    device: Device | None = None
    """Where the ranks compute. Default: ``cuda`` when a GPU is available, else ``cpu``. With
    ``cpu`` every rank activates the CPU compatibility layers of ``compat.integrations`` (so
    megatron-core's CUDA-bound code runs on the CPU), and the default ``cluster`` becomes
    ``cpu_local``."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The job being emulated."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The ranks that run the real program in emulation."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    """Where the trace is and what keys it."""
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    """How the trace is recorded."""
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    """How virtual ranks are replayed to the sandbox ranks."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Communication deadlines and sub-group creation."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Rank processes, progress and error output."""
    compat: CompatConfig = field(default_factory=CompatConfig)
    """Compatibility layers the ranks install."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """Where the report goes and how losses are read from rank logs."""
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    """Slice calibration of compute spans."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Memory accounting and the target's memory cap."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """The global replay that predicts the target job."""
    physical: PhysicalConfig = field(default_factory=PhysicalConfig)
    """The machines the sandbox ranks run on."""
    integration: IntegrationConfig = field(default_factory=IntegrationConfig)
    """How ``target.parallel`` and ``script.args`` reach the recipe."""
    script: ScriptConfig = field(default_factory=ScriptConfig)
    """Script flags set from the config."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """The sweep summary."""
    cluster: ClusterSpec = MISSING  # filled by the Hydra group ``cluster``
    """The target machine room (Hydra group ``cluster``: h100_ib, h200_ib, a100_ib, gb200_nvl72, cpu_local)."""

    @property
    def on_cuda(self) -> bool:
        """The ranks run on GPUs (``device`` resolved to cuda)."""
        return self.device is Device.cuda

    def validate(self) -> None:
        """Every section's own checks, then those that span sections; each error names the
        field and what to do."""
        self.target.validate()
        ws = self.target.world_size
        self.sandbox.validate(ws)
        self.calibrate.validate(ws)
        try:
            self.cluster.validate()
        except ValueError as e:
            raise ConfigError(f"cluster: {e}") from None
        self.comm.validate()
        self.launch.validate()
        self.report.validate()
        self.replay.validate()
        self.trace.validate()
        self.capture.validate()
        self.physical.validate(len(self.sandbox.ranks))
        self.emulate.validate(on_cuda=self.on_cuda)
        from prism_launch.config import registry

        if self.target.parallel.zero_stage is not None and self.integration.kind != "deepspeed":
            raise ConfigError("target.parallel.zero_stage renders into a DeepSpeed config: set "
                              "integration.kind=deepspeed")
        if self.integration.kind != "none":
            registry.get(self.integration.kind, where="integration.kind")
        for name in self.compat.integrations:
            registry.get(name, where="compat.integrations")
        if self.integration.moe is not None:
            registry.get(self.integration.moe, where="integration.moe")
        if self.on_cuda:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("device=cuda but no CUDA device is available here; use device=cpu")


def register() -> None:
    from hydra.core.config_store import ConfigStore

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
    overrides = list(overrides)
    if not any(o.lstrip("+~").split("=", 1)[0] == "cluster" for o in overrides) and _computes_on_cpu(overrides):
        overrides.append("cluster=cpu_local")  # the cluster CPU compute spans describe (see _computes_on_cpu)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=normalize_overrides(overrides))
        return OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ or e
        raise ConfigError(f"invalid configuration: {e}: {cause}") from None


def _computes_on_cpu(overrides: list[str]) -> bool:
    """``device=cpu`` given, or no device given on a machine without CUDA: the run's compute
    spans are this machine's CPU's, so the default cluster is ``cpu_local`` (measured here)
    rather than a GPU cluster whose compute they do not describe."""
    devices = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == "device" and "=" in o]
    if devices:
        return devices[-1] == "cpu"
    return _cuda_devices() == 0


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cpu_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def devices_present(cuda: bool) -> int:
    """The devices ranks can be given one each: GPUs on CUDA, cores on CPU."""
    return max(1, _cuda_devices()) if cuda else _cpu_cores()


def resolve(cfg: PrismConfig) -> PrismConfig:
    """A new config with every machine- or field-dependent default made concrete: ``device``,
    ``target.world_size``, ``launch.start_method``, ``capture.slots``/``park``/``fold``,
    ``emulate.data_path``, ``memory.enforce_limit``, ``calibrate.in_auto``/``slice_size``, ``replay.compute``.
    Nothing downstream resolves a default of its own. Idempotent."""
    r = dataclasses.replace
    device = cfg.device
    if device is None:
        device = Device.cuda if _cuda_devices() else Device.cpu
    cuda = device is Device.cuda
    target = cfg.target
    if target.world_size is None:
        target = r(target, world_size=target.nnodes * target.nproc_per_node)
    cap = cfg.capture
    # on CUDA as many ranks compute at once as there are cores to drive them, admitted by the GPUs'
    # memory (capture/slots.py): one rank at a time left the card idle between ops
    slots = cap.slots if cap.slots is not None else _cpu_cores()
    park = cap.park
    if park is Park.auto:  # checkpointing costs seconds per switch: only when a budget is given
        park = Park.cuda_checkpoint if cuda and cap.resident else Park.none
    fold = cap.fold if cap.fold is not None else target.world_size > cap.fold_threshold
    data_path = cfg.emulate.data_path
    if data_path is DataPath.auto:
        data_path = DataPath.device if cuda else DataPath.host
    compute = cfg.replay.compute
    if compute is ComputeSource.auto:
        compute = ComputeSource.calibrated if cuda else ComputeSource.cpu
    return r(
        cfg, device=device, target=target,
        launch=r(cfg.launch, start_method=cfg.launch.start_method or (StartMethod.spawn if cuda else StartMethod.fork)),
        capture=r(cap, slots=slots, park=park, fold=bool(fold)),
        emulate=r(cfg.emulate, data_path=data_path),
        memory=r(cfg.memory, enforce_limit=cuda if cfg.memory.enforce_limit is None else cfg.memory.enforce_limit),
        calibrate=r(cfg.calibrate, in_auto=cuda if cfg.calibrate.in_auto is None else cfg.calibrate.in_auto,
                    kernel_mix=cuda if cfg.calibrate.kernel_mix is None else cfg.calibrate.kernel_mix,
                    slice_size=devices_present(cuda) if cfg.calibrate.slice_size is None
                    else cfg.calibrate.slice_size),
        replay=r(cfg.replay, compute=compute),
    )


def validate(cfg: PrismConfig) -> None:
    """Semantic checks of a resolved config (see :meth:`PrismConfig.validate`)."""
    cfg.validate()
