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
  --multirun           sweep: key=a,b overrides become points (Hydra's sweeper and launcher,
                       hydra/launcher=joblib|submitit_local|prism_slurm|prism_ray); writes
                       summary.csv, summary.png and a ranked table in hydra.sweep.dir

The torchrun flags describe the TARGET job: --nnodes x --nproc-per-node is the logical
world. Only sandbox ranks run for real in emulation; the rest are replayed.
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
    return parser


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
    return LaunchArgs(
        torchrun=ns,
        overrides=overrides,
        script=rest[0] if rest else "",
        script_args=rest[1:],
        print_config=ns.print_config,
        multirun=ns.multirun,
    )
