"""The integrations registry: framework specifics (Megatron-core, DeepSpeed, the CPU
compatibility layer) are named by the config and loaded here, the one place that turns a
name into a module. Core code never imports ``integrations``.

An :class:`Integration` says which of its modules fill which role:
- ``compat``: activated in every rank when ``device=cpu`` (the module's ``install()``), and on
  CUDA too for an integration whose ``compat_devices`` name it (DeepSpeed's);
- ``renderer``: writes ``target.parallel``/``script.args`` into the script's arguments
  (``render(cfg, script_args, out_dir) -> list[str]``);
- ``moe``: finds MoE token dispatches in a trace (``dispatches``/``describe``);
- ``waits``: vouches for or against waits on the GPU during capture (``capture.gpu_waits``
  unset) for a recipe's script arguments (``gpu_waits(script_args) -> (bool, why) | None``);
- ``workload``: what one step of a recipe processes, from its script arguments
  (``tokens_per_step(script_args, world_size, embedded_tokens)``; optionally the framework's
  own FLOP count, ``model_flops(script_args, world_size)``, which the report uses where the
  capture could not count FLOPs: a torch.compile'd program);
- ``probe``: installed in every capturing rank on any device (the module's ``install()``):
  records what the program computes that no op carries (megatron-core's routers' auxiliary
  losses and pre-drop token counts, read back by the ``moe`` module) and keeps the program's
  host copies off waits on the GPU;
- ``recipe_flags``: script flags by which a recipe of this kind is recognised (DeepSpeed's
  ``--deepspeed_config``), so its compat layer joins by default and ``warm_imports`` are
  imported before ranks are forked.

Out-of-tree integrations register an ``Integration`` under the entry-point group
``prism_launch.integrations`` (``name = "package.module:OBJECT"``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Literal

from prism_launch.config.errors import ConfigError

Role = Literal["compat", "renderer", "moe", "waits", "workload", "probe"]
ENTRY_POINT_GROUP = "prism_launch.integrations"


@dataclass(frozen=True, slots=True, kw_only=True)
class Integration:
    name: str
    """The name the config uses (``integration.kind``, ``compat.integrations``, ``integration.moe``)."""
    compat: str | None = None
    """Module whose ``install()`` every rank runs when the compatibility layer is active."""
    renderer: str | None = None
    """Module whose ``render(cfg, script_args, out_dir)`` writes ``target.parallel``/``script.args``
    into the script's arguments."""
    moe: str | None = None
    """Module that finds MoE token dispatches in a trace (``dispatches``/``describe``)."""
    waits: str | None = None
    """Module whose ``gpu_waits(script_args)`` vouches for or against ``capture.gpu_waits``."""
    workload: str | None = None
    """Module whose ``tokens_per_step(script_args, world_size, embedded_tokens)`` says how many
    tokens a step trains on (throughput in reports and sweeps), and optionally
    ``model_flops(script_args, world_size)`` its own count of a step's FLOPs."""
    probe: str | None = None
    """Module whose ``install()`` every capturing rank runs, on any device, for the integrations of
    ``compat.integrations``."""
    compat_devices: tuple[str, ...] = ("cpu",)
    """The devices (``cpu``, ``cuda``) on which the ``compat`` module is activated."""
    recipe_flags: tuple[str, ...] = ()
    """Script flags that mark a recipe of this kind (its compat layer then joins by default)."""
    warm_imports: tuple[str, ...] = ()
    """Modules a recognised recipe needs, imported once in the launcher before ranks are forked."""
    recipe_kind: bool = False
    """A recipe recognised by ``recipe_flags`` takes this integration as ``integration.kind``
    (its renderer and workload) unless the user sets one. Not DeepSpeed's: Megatron-DeepSpeed
    recipes carry ``--deepspeed`` beside Megatron-LM's flags."""
    output_args: tuple[str, ...] = ()
    """Script flags whose value only says where outputs go (checkpoints, logs, experiment
    names): a trace matches a run whatever their values (their presence still counts)."""


BUILTIN: tuple[Integration, ...] = (
    Integration(name="cpu", compat="integrations.cpu_compat"),
    # Megatron-LM's output flags, checked against megatron/training/arguments.py (core_r0.19.0)
    Integration(name="megatron", compat="integrations.megatron_compat", renderer="integrations.megatron_flags",
                moe="integrations.megatron_moe", waits="integrations.megatron_flags",
                workload="integrations.megatron_workload", probe="integrations.megatron_probe",
                # (not --data-cache-path: ranks read the dataset index cache that rank 0 builds there)
                output_args=("--save", "--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir")),
    Integration(name="deepspeed", compat="integrations.deepspeed_compat", renderer="integrations.deepspeed_config",
                moe="integrations.deepspeed_moe",
                compat_devices=("cpu", "cuda"),  # device mapping, rank-0 checks, padding, group labels
                recipe_flags=("--deepspeed_config", "--deepspeed-config", "--deepspeed"), warm_imports=("deepspeed",),
                # DeepSpeedExamples' and HF-style training scripts' output and run-name flags
                output_args=("--output_dir", "--output-dir", "--save_dir", "--logging_dir", "--log_dir",
                             "--tensorboard_dir", "--job_name", "--run_name")),
    Integration(name="torchtitan", compat="integrations.torchtitan_compat", renderer="integrations.torchtitan_flags",
                workload="integrations.torchtitan_workload",
                # on CUDA too: pipeline metadata inference on zeros (each patch a no-op where not needed)
                compat_devices=("cpu", "cuda"),
                recipe_kind=True,
                recipe_flags=("--job.config_file", "--job.config-file", "--model.name", "--model.flavor"),
                # torchtitan's output folders (config/job_config.py of 0.2.2: all relative to --job.dump_folder)
                output_args=("--job.dump_folder", "--metrics.save_tb_folder",
                             "--profiling.save_traces_folder", "--profiling.save_memory_snapshot_folder",
                             "--checkpoint.folder", "--comm.save_traces_folder")),
)


@cache
def integrations() -> dict[str, Integration]:
    """Every known integration by name: the bundled ones, then entry points (which may not
    replace a bundled name)."""
    found = {i.name: i for i in BUILTIN}
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue
        obj = ep.load()
        if not isinstance(obj, Integration):
            raise ConfigError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP} is not a prism_launch.config.registry."
                              f"Integration (got {type(obj).__name__})")
        found[ep.name] = obj
    return found


def get(name: str, *, where: str) -> Integration:
    """The integration called ``name``; ``where`` names the config field for the error."""
    known = integrations()
    if name not in known:
        raise ConfigError(f"{where}: no integration named {name!r} (known: {', '.join(sorted(known))})")
    return known[name]


def load(name: str, role: Role, *, where: str) -> ModuleType:
    """Import the module that fills ``role`` for integration ``name``."""
    module = getattr(get(name, where=where), role)
    if module is None:
        with_role = sorted(n for n, i in integrations().items() if getattr(i, role))
        raise ConfigError(f"{where}: integration {name!r} has no {role} (integrations with one: "
                          f"{', '.join(with_role)})")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{where}: integration {name!r} cannot load its {role} module {module}: {e}") from None


def output_args(extra: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """Every integration's output-only flags, plus ``extra`` (``trace.ignore_args``)."""
    return frozenset(f for i in integrations().values() for f in i.output_args) | frozenset(extra)


def recognised(script_args: list[str]) -> list[str]:
    """Integrations whose recipe flags appear among ``script_args`` (``--flag`` or ``--flag=v``)."""
    flags = {a.split("=", 1)[0] for a in script_args}
    return [n for n, i in integrations().items() if flags.intersection(i.recipe_flags)]


DEFAULT_MOE = "megatron"
"""``integration.moe``'s default (:class:`prism_launch.config.integration.IntegrationConfig`)."""


def choose_moe(setting: str | None, script_args: list[str]) -> str | None:
    """The MoE detector for a trace: ``integration.moe`` as set, except that the default
    (``megatron``) gives way to the integration the recipe's flags name when that one has a
    ``moe`` role (a DeepSpeed recipe's ``--deepspeed_config``: DeepSpeed's dispatch); null: none."""
    if setting != DEFAULT_MOE:
        return setting
    own = [n for n in recognised(script_args) if integrations()[n].moe]
    return own[0] if own else setting


def gpu_waits_verdicts(script_args: list[str]) -> list[tuple[str, bool, str]]:
    """(integration, whether waits on the GPU suit the recipe, why) from every integration with
    a ``waits`` role that has a word on ``script_args``."""
    out = []
    for name, i in integrations().items():
        if i.waits:
            said = load(name, "waits", where="capture.gpu_waits").gpu_waits(list(script_args))
            if said is not None:
                out.append((name, bool(said[0]), str(said[1])))
    return out


def choose_gpu_waits(setting: bool | None, script_args: list[str]) -> tuple[bool, str]:
    """``capture.gpu_waits``: as set, or (unset) on where an integration vouches for the recipe
    and none speaks against it; with the reason, for the launcher to say."""
    if setting is not None:
        return bool(setting), f"capture.gpu_waits={str(bool(setting)).lower()}"
    verdicts = gpu_waits_verdicts(script_args)
    against = [f"{n}: {why}" for n, ok, why in verdicts if not ok]
    if against:
        return False, "; ".join(against)
    vouched = [f"{n}: {why}" for n, ok, why in verdicts if ok]
    if vouched:
        return True, "; ".join(vouched)
    return False, "no integration knows the recipe to run with them"
