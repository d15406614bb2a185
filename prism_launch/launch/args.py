"""Command line: torchrun's own parser (every flag, dash/underscore spellings, ``PET_*``
environment fallbacks), plus Hydra-style ``key=value`` overrides between the flags and
the script.

    prism-launch [torchrun flags] [key=value ...] SCRIPT [SCRIPT ARGS]

The torchrun flags describe the **target** job. Hydra only sees the overrides, so
torchrun's ``-m`` (module) and ``-r`` (redirects) keep their torchrun meaning.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

_OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.\-/]*(@[\w.]+)?=")  # group/option=value too (hydra/launcher=joblib)

EPILOG = """\
prism-launch options (besides torchrun's):
  key=value            Hydra overrides of the PrismLLM config, before SCRIPT, e.g.
                       mode=capture|emulate|real|auto  sandbox.ranks=[5]  trace.dir=PATH
                       target.world_size=N  device=cpu|cuda  emulate.strict=true
                       comm.timeout_s=60 (see --cfg for every field)
  --cfg                print the composed config (YAML) and exit
  --help-config [SECTION]  every config key (or one section's) with its documentation
  --multirun           sweep: key=a,b overrides become points (Hydra's sweeper and launcher,
                       hydra/launcher=joblib|submitit_local|prism_slurm|prism_ray); writes
                       summary.csv, summary.png and a ranked table in hydra.sweep.dir

The torchrun flags describe the TARGET job: --nnodes x --nproc-per-node is the logical
world. Only sandbox ranks run for real in emulation; the rest are replayed.

deepspeed launcher flags (instead of torchrun's; the script then gets --local_rank=N):
  --num_gpus/--num_accelerators N   ranks per node (--nproc-per-node)
  --num_nodes N                     nodes (--nnodes)
  -H/--hostfile, -i/--include, -e/--exclude   hosts and slots, as deepspeed reads them
  --master_addr, --master_port, --node_rank, --module, --no_python   as in torchrun
  --no_local_rank                   do not pass --local_rank
  --launcher, --launcher_args, --no_ssh, --no_ssh_check, --force_multi, --ssh_port,
  --venv_script, --save_pid, --enable_each_rank_log, --bind_cores_to_rank,
  --bind_core_list, --log_level, -q/--quiet   accepted and ignored (prism-launch starts
                                    the ranks itself, on this machine)
"""


@dataclass(kw_only=True, slots=True)
class LaunchArgs:
    """What the command line says, before config composition."""

    torchrun: argparse.Namespace
    """torchrun's parsed flags."""
    overrides: list[str] = field(default_factory=list)
    """Hydra ``key=value`` overrides."""
    script: str = ""
    """Training script path, module (with -m) or executable (with --no-python)."""
    script_args: list[str] = field(default_factory=list)
    print_config: bool = False
    multirun: bool = False
    """Sweep the ``key=a,b`` overrides (prism_launch.sweep)."""
    local_rank_arg: bool = False
    """Pass ``--local_rank=N`` to the script, as the deepspeed launcher does (set when the
    command line used the deepspeed launcher's flags)."""

    @property
    def nnodes(self) -> int:
        return parse_nnodes(self.torchrun.nnodes)

    @property
    def nproc_per_node(self) -> int:
        return parse_nproc(self.torchrun.nproc_per_node)


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "prism-launch"
    parser.description = (
        "Drop-in replacement for torchrun that runs a large distributed training job "
        "in a virtual world: a few sandbox ranks for real, the rest replayed."
    )
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--cfg", "--print-config", dest="print_config", action="store_true",
                        help="Print the composed PrismLLM config and exit.")
    parser.add_argument("--multirun", dest="multirun", action="store_true",
                        help="Sweep: every combination of key=a,b overrides is one point (Hydra multirun).")
    add_deepspeed_flags(parser)
    return parser


# -- the deepspeed launcher's flags ----------------------------------------------------------

DS_IGNORED = ("--launcher", "--launcher_args", "--ssh_port", "--venv_script", "--save_pid", "--enable_each_rank_log",
              "--bind_core_list", "--log_level", "--no_ssh", "--no_ssh_check", "--force_multi", "--bind_cores_to_rank",
              "-q", "--quiet")
"""deepspeed-launcher flags accepted and ignored: how deepspeed would start remote processes
(pdsh/MPI/Slurm, ssh, virtualenvs, core binding, pid files, per-rank log files, its log
level). prism-launch starts every rank itself on this machine; ``--log-dir`` keeps per-rank logs."""


def add_deepspeed_flags(parser: argparse.ArgumentParser) -> None:
    """The deepspeed launcher's own flags (``deepspeed/launcher/runner.py``, 0.19); the ones it
    shares with torchrun (``--master_addr``, ``--master_port``, ``--node_rank``, ``--module``,
    ``--no_python``) are torchrun's already."""
    g = parser.add_argument_group("deepspeed launcher flags (the script then gets --local_rank=N)")
    g.add_argument("--num_gpus", "--num_accelerators", dest="ds_num_gpus", type=int, default=None,
                   help="ranks per node (= --nproc-per-node)")
    g.add_argument("--num_nodes", dest="ds_num_nodes", type=int, default=None, help="nodes (= --nnodes)")
    g.add_argument("-H", "--hostfile", dest="ds_hostfile", default=None,
                   help="MPI-style hostfile ('host slots=N' lines): nodes and ranks per node")
    g.add_argument("-i", "--include", dest="ds_include", default=None, help="NODE[:SLOT,...][@NODE...] to use")
    g.add_argument("-e", "--exclude", dest="ds_exclude", default=None, help="NODE[:SLOT,...][@NODE...] to leave out")
    g.add_argument("--no_local_rank", dest="ds_no_local_rank", action="store_true",
                   help="do not pass --local_rank=N to the script")
    for flag in DS_IGNORED:
        takes_value = flag in ("--launcher", "--launcher_args", "--ssh_port", "--venv_script", "--save_pid",
                               "--enable_each_rank_log", "--bind_core_list", "--log_level")
        g.add_argument(flag, dest="ds_ignored_" + flag.lstrip("-"), help=argparse.SUPPRESS,
                       **({"default": None} if takes_value else {"action": "store_true"}))


def _parse_hostfile(path: str) -> dict[str, int]:
    hosts: dict[str, int] = {}
    try:
        text = open(path).read()
    except OSError as e:
        raise SystemExit(f"prism-launch: error: --hostfile {path}: {e}") from None
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if m is None:
            raise SystemExit(f"prism-launch: error: --hostfile {path}: bad line {line!r} (expected 'HOST slots=N')")
        if m.group(1) in hosts:
            raise SystemExit(f"prism-launch: error: --hostfile {path}: host {m.group(1)} listed twice")
        hosts[m.group(1)] = int(m.group(2))
    if not hosts:
        raise SystemExit(f"prism-launch: error: --hostfile {path} lists no host")
    return hosts


def _node_specs(spec: str) -> dict[str, list[int] | None]:
    """``worker-0@worker-1:0,2`` -> {worker-0: None (all slots), worker-1: [0, 2]}."""
    out: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        if not host:
            raise SystemExit(f"prism-launch: error: bad node spec {spec!r}")
        out[host] = [int(s) for s in slots.split(",")] if slots else None
    return out


def deepspeed_resources(ns: argparse.Namespace) -> tuple[int, int] | None:
    """(nnodes, nproc_per_node) from the deepspeed launcher's flags, as its runner computes
    the resource pool (hostfile or local slots, include/exclude, then num_nodes/num_gpus);
    None when no such flag was given."""
    if ns.ds_hostfile is None and ns.ds_include is None and ns.ds_exclude is None:
        if ns.ds_num_gpus is None and ns.ds_num_nodes is None:
            return None
        return max(ns.ds_num_nodes or 1, 1), ns.ds_num_gpus if ns.ds_num_gpus is not None else _local_slots()
    if ns.ds_include and ns.ds_exclude:
        raise SystemExit("prism-launch: error: --include and --exclude are mutually exclusive")
    if ns.ds_hostfile is not None:
        pool = {h: list(range(n)) for h, n in _parse_hostfile(ns.ds_hostfile).items()}
    else:
        pool = {"localhost": list(range(_local_slots()))}
    if ns.ds_include:
        chosen = {}
        for host, slots in _node_specs(ns.ds_include).items():
            if host not in pool and ns.ds_hostfile is None and host != "localhost":
                pool[host] = list(range(_local_slots()))
            if host not in pool:
                raise SystemExit(f"prism-launch: error: --include names host {host!r}, which the hostfile lacks")
            chosen[host] = pool[host] if slots is None else slots
        pool = chosen
    if ns.ds_exclude:
        for host, slots in _node_specs(ns.ds_exclude).items():
            if host in pool:
                pool[host] = [] if slots is None else [s for s in pool[host] if s not in slots]
        pool = {h: s for h, s in pool.items() if s}
    hosts = list(pool.items())
    if ns.ds_num_nodes is not None and ns.ds_num_nodes > 0:
        hosts = hosts[: ns.ds_num_nodes]
    if ns.ds_num_gpus is not None and ns.ds_num_gpus > 0:
        hosts = [(h, s[: ns.ds_num_gpus]) for h, s in hosts]
    sizes = sorted({len(s) for _, s in hosts})
    if not hosts or not sizes[0]:
        raise SystemExit("prism-launch: error: the deepspeed flags leave no rank to run")
    if len(sizes) > 1:
        raise SystemExit(f"prism-launch: error: the deepspeed flags give nodes with different slot counts "
                         f"{dict((h, len(s)) for h, s in hosts)}; the target job needs the same ranks per node")
    return len(hosts), sizes[0]


def _local_slots() -> int:
    """deepspeed's default: every local accelerator (1 on a machine without GPUs)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _deepspeed_style(ns: argparse.Namespace) -> bool:
    return any(v not in (None, False) for k, v in vars(ns).items() if k.startswith("ds_"))


def recipe_overrides(overrides: list[str], script_args: list[str]) -> list[str]:
    """Defaults for a recipe the registry recognises by its script flags (DeepSpeed's
    ``--deepspeed_config``/``--deepspeed``, torchtitan's ``--model.name``) that the user did not
    override: the integration joins ``compat.integrations``, its framework (``deepspeed``) is
    imported once before ranks are forked, and one that claims its recipes (``recipe_kind``:
    torchtitan) becomes ``integration.kind``."""
    from prism_launch.config import registry

    kinds = registry.recognised(script_args)
    if not kinds:
        return overrides
    from prism_launch.config import CaptureConfig, CompatConfig

    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    extra = []
    if "compat.integrations" not in keys:
        names = [*CompatConfig().integrations, *kinds]
        extra.append(f"compat.integrations=[{','.join(dict.fromkeys(names))}]")
    own = [k for k in kinds if registry.get(k, where="script args").recipe_kind]
    if "integration.kind" not in keys and len(own) == 1:
        extra.append(f"integration.kind={own[0]}")
    if "capture.warm_imports" not in keys:
        warm = [*CaptureConfig().warm_imports, *(m for k in kinds for m in registry.get(k, where='script args').warm_imports)]
        extra.append(f"capture.warm_imports=[{','.join(dict.fromkeys(warm))}]")
    return [*extra, *overrides]


def parse_nnodes(value: str) -> int:
    """torchrun accepts ``N`` or ``MIN:MAX``; the target job is the largest size."""
    try:
        return int(str(value).split(":")[-1])
    except ValueError:
        raise SystemExit(f"prism-launch: error: --nnodes must be N or MIN:MAX, got {value!r}") from None


def parse_nproc(value: str) -> int:
    value = str(value)
    if value.isdigit():
        return int(value)
    import torch

    if value in ("gpu", "auto") and torch.cuda.is_available():
        return torch.cuda.device_count()
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    if value == "gpu":
        raise SystemExit("prism-launch: error: --nproc-per-node=gpu but no CUDA device here; give a number")
    raise SystemExit(f"prism-launch: error: --nproc-per-node must be a number, auto, cpu or gpu; got {value!r}")


def _split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull ``key=value`` tokens that stand before the script out of ``argv``.

    Options and their values are skipped using the parser's own table, so
    ``--rdzv-conf a=b`` stays a flag value and torchrun flags may follow overrides.
    """
    overrides, rest = [], []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest.extend(argv[i:])
            break
        if tok.startswith("-") and tok != "-":
            rest.append(tok)
            action = parser._option_string_actions.get(tok.split("=", 1)[0])
            takes_value = action is not None and action.nargs != 0 and "=" not in tok
            if takes_value and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
            i += 1
            continue
        if _OVERRIDE.match(tok) and not os.path.exists(tok):
            overrides.append(tok)
            i += 1
            continue
        rest.extend(argv[i:])  # the script and its own arguments
        break
    return overrides, rest


def parse(argv: list[str]) -> LaunchArgs:
    parser = build_parser()
    overrides, argv = _split_overrides(parser, argv)
    if not any(not t.startswith("-") for t in argv) and any(t in ("--cfg", "--print-config") for t in argv):
        argv = [*argv, "-"]  # --cfg needs no script
    ns = parser.parse_args(argv)
    rest = [ns.training_script, *ns.training_script_args]
    if rest == ["-"]:
        rest = []
    if not rest and not ns.print_config:
        parser.error("the training script is missing: prism-launch [flags] [key=value ...] SCRIPT [ARGS]")
    if ns.module and ns.no_python:
        parser.error("-m/--module and --no-python cannot be used together")
    resources = deepspeed_resources(ns)
    if resources is not None:
        ns.nnodes, ns.nproc_per_node = str(resources[0]), str(resources[1])
    return LaunchArgs(
        torchrun=ns,
        overrides=recipe_overrides(overrides, rest[1:]),
        script=rest[0] if rest else "",
        script_args=rest[1:],
        print_config=ns.print_config,
        multirun=ns.multirun,
        local_rank_arg=_deepspeed_style(ns) and not ns.ds_no_local_rank,
    )


IGNORED_VALUE = "<output>"


def _flag(arg: str) -> str | None:
    return arg.split("=", 1)[0] if arg.startswith("-") and len(arg) > 1 and not arg[1:2].isdigit() else None


def mask_output_args(script_args: list[str], flags: frozenset[str]) -> list[str]:
    """``script_args`` with the value of every output-only flag in ``flags`` replaced by one
    placeholder (``--save DIR`` and ``--save=DIR`` both): what keys a trace. A flag's
    presence still counts; only where its outputs go does not."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(script_args):
        if skip:
            skip = False
            out.append(IGNORED_VALUE)
            continue
        name = _flag(a)
        if name in flags:
            if "=" in a:
                out.append(f"{name}={IGNORED_VALUE}")
                continue
            nxt = script_args[i + 1] if i + 1 < len(script_args) else None
            skip = nxt is not None and _flag(nxt) is None
        out.append(a)
    return out


def differing_args(recorded: list[str], now: list[str]) -> list[str]:
    """The flags (or bare arguments) whose values differ between two argument lists."""
    a, b = args_by_flag(recorded), args_by_flag(now)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def args_by_flag(args: list[str]) -> dict[str, list[str]]:
    """Each flag's values in an argument list (``<positional>``: bare arguments)."""
    def by_flag(args: list[str]) -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}
        key = "<positional>"
        for a in args:
            name = _flag(a)
            if name is not None:
                key = name
                seen.setdefault(key, [])
                if "=" in a:
                    seen[key].append(a.split("=", 1)[1])
                    key = "<positional>"
            else:
                seen.setdefault(key, []).append(a)
                key = "<positional>"
        return seen

    return by_flag(args)
