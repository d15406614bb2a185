"""Typed configuration of one prism-launch run, registered in Hydra's ConfigStore.

The dataclasses are the single source of every knob, one module per topic (``target``,
``capture``, ``emulate``, ``predict``, ``run``, ``integration``, ``cluster``), each section
validating itself; ``configs/config.yaml`` only selects them. The torchrun flags fill
``target.nnodes`` / ``target.nproc_per_node`` (the **target** job); ``key=value`` overrides go
through Hydra. :func:`resolve` turns every ``auto`` into a concrete value, once;
:mod:`prism_launch.config.plan` is what the launcher hands each rank.
"""

from prism_launch.config.capture import CaptureConfig, Park, Payload, TraceConfig
from prism_launch.config.cluster import ClusterSpec, LinkSpec
from prism_launch.config.emulate import DataPath, EmulateConfig, PrefetchConfig, PrefetchMode, RingBackend, Timing, VirtualHost
from prism_launch.config.errors import ConfigError
from prism_launch.config.integration import CompatConfig, FlagNames, IntegrationConfig, ScriptConfig, SweepConfig
from prism_launch.config.predict import CalibrateConfig, ComputeSource, HostGaps, Measure, MemoryConfig, ReplayConfig
from prism_launch.config.root import PrismConfig, compose, config_dir, normalize_overrides, register, resolve, validate
from prism_launch.config.run import CommConfig, LaunchConfig, Mode, PhysicalConfig, ReportConfig, StartMethod
from prism_launch.config.target import Device, ParallelConfig, SandboxConfig, TargetConfig

__all__ = [
    "CalibrateConfig", "CaptureConfig", "ClusterSpec", "CommConfig", "CompatConfig", "ComputeSource", "ConfigError",
    "DataPath", "Device", "EmulateConfig", "FlagNames", "HostGaps", "IntegrationConfig", "LaunchConfig", "LinkSpec", "Measure",
    "MemoryConfig", "Mode", "Park", "Payload", "ParallelConfig", "PhysicalConfig", "PrefetchConfig", "PrefetchMode",
    "PrismConfig", "ReplayConfig", "ReportConfig", "RingBackend", "SandboxConfig", "ScriptConfig", "StartMethod",
    "SweepConfig", "TargetConfig", "TraceConfig", "Timing", "VirtualHost", "compose", "config_dir",
    "normalize_overrides", "register", "resolve", "validate",
]
