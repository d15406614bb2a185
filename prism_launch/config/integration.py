"""Framework specifics named by the config (integrations are loaded through the registry), script-argument rendering and sweeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class CompatConfig:
    integrations: list[str] = field(default_factory=lambda: ["cpu", "megatron"])
    """Integrations (names in the registry, :mod:`prism_launch.config.registry`) whose compatibility
    layer is activated in every rank when ``device=cpu`` (and on CUDA for those whose registry
    entry says so: DeepSpeed's). ``deepspeed`` joins by default when the script's arguments carry
    ``--deepspeed_config``/``--deepspeed``; it touches nothing until the script imports DeepSpeed."""


@dataclass(kw_only=True, slots=True)
class FlagNames:
    """The recipe's own flag for each ``target.parallel`` field; None: the integration's
    default (Megatron-LM's names, e.g. ``--tensor-model-parallel-size``)."""

    tp: str | None = None
    """Flag for ``target.parallel.tp`` (Megatron-LM: ``--tensor-model-parallel-size``)."""
    pp: str | None = None
    """Flag for ``target.parallel.pp`` (Megatron-LM: ``--pipeline-model-parallel-size``)."""
    ep: str | None = None
    """Flag for ``target.parallel.ep`` (Megatron-LM: ``--expert-model-parallel-size``)."""
    cp: str | None = None
    """Flag for ``target.parallel.cp`` (Megatron-LM: ``--context-parallel-size``)."""
    etp: str | None = None
    """Flag for ``target.parallel.etp`` (Megatron-LM: ``--expert-tensor-parallel-size``)."""
    micro_batch_size: str | None = None
    """Flag for ``target.parallel.micro_batch_size`` (Megatron-LM: ``--micro-batch-size``)."""
    global_batch_size: str | None = None
    """Flag for ``target.parallel.global_batch_size`` (Megatron-LM: ``--global-batch-size``)."""


@dataclass(kw_only=True, slots=True)
class IntegrationConfig:
    """How ``target.parallel`` and ``script.args`` reach the recipe. Integrations are named,
    never imported, by core code: :mod:`prism_launch.config.registry` loads them."""

    kind: str = "megatron"
    """The integration whose renderer writes ``target.parallel`` into the script's arguments:
    ``megatron`` (flags), ``deepspeed`` (a rendered JSON config), or ``none``."""
    flags: FlagNames = field(default_factory=FlagNames)
    """The recipe's own flag names, where they are not Megatron-LM's (``integration.flags.tp=--tp``)."""
    render_dir: str | None = None
    """Where rendered files (DeepSpeed configs) go. Default: the run's output dir (a sweep
    point's directory; ``prism_rendered/`` for a single run)."""
    moe: str | None = "megatron"
    """The integration that finds MoE token dispatches in a trace (the report's ``moe`` section);
    null turns the section off."""


@dataclass(kw_only=True, slots=True)
class ScriptConfig:
    args: dict[str, Any] = field(default_factory=dict)
    """Script flags set from the config (sweepable): ``script.args.moe_router_topk=1,2`` renders
    ``--moe-router-topk 1``; ``true`` adds a bare flag, ``false`` removes it, null leaves it."""


@dataclass(kw_only=True, slots=True)
class SweepConfig:
    rank_by: str = "iteration_time_s"
    """Summary column the terminal table is ranked by (ascending); ``iteration_time_host_kept_up_s``
    ranks host-bound points by their step on a host that keeps up."""
