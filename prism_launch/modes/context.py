"""What every mode runner needs, built once per invocation from the resolved config and the
command line: the program, the target topology, the trace's fingerprint and layout, the
report's layout, the run id, and the launch agent."""

from __future__ import annotations

import shlex
import tempfile
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from prism_launch.launch.args import LaunchArgs
from prism_launch.config import Mode, PrismConfig
from prism_launch.config.plan import RankPlan
from prism_launch.launch.agent import Program, RankAgent, TorchrunFlags
from prism_launch.launch.env import Topology
from prism_launch.config.registry import get as integration
from prism_launch.config.registry import output_args
from prism_launch.launch.args import mask_output_args
from prism_launch.trace import ReportLayout, TraceLayout
from prism_launch.trace import fingerprint as fp


def compat_modules(cfg: PrismConfig) -> tuple[str, ...]:
    """The compatibility modules every rank installs first: those of ``compat.integrations``
    made for the ranks' device (the CPU layers on CPU; DeepSpeed's on CPU and CUDA)."""
    device = "cuda" if cfg.on_cuda else "cpu"
    found = (integration(n, where="compat.integrations") for n in cfg.compat.integrations)
    return tuple(i.compat for i in found if i.compat and device in i.compat_devices)


def probe_modules(cfg: PrismConfig) -> tuple[str, ...]:
    """The probes every capturing rank installs (:mod:`prism_launch.config.registry`): those of
    ``compat.integrations``, whatever the device."""
    found = (integration(n, where="compat.integrations") for n in cfg.compat.integrations)
    return tuple(i.probe for i in found if i.probe)


def program_config(cfg: PrismConfig) -> dict:
    """The part of the config that changes what the program computes (fingerprinted)."""
    return {"target": asdict(cfg.target), "device": str(cfg.device), "compat": list(compat_modules(cfg))}


def fork_entry(spec, program: Program) -> int:
    """What a forked child runs: the assistant (the one process without a logical rank), or
    the rank's bootstrap."""
    if "RANK" not in spec.env:
        from prism_launch.rank import assistant_main

        return assistant_main.main()
    from prism_launch.rank import bootstrap

    return bootstrap.run(program.script, list(program.args), module=program.module)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunContext:
    cfg: PrismConfig
    """The resolved config (:func:`prism_launch.config.resolve`)."""
    program: Program
    topo: Topology
    fingerprint: dict
    run_id: str
    trace: TraceLayout
    report: ReportLayout
    log_root: Path | None
    """``--log-dir``: every phase's logs in a new ``<log_root>/<run_id>-<mode>-<random>``."""
    agent: RankAgent
    local_rank_arg: bool = False
    profile_kernels: bool = False
    """A calibration slice whose ranks list their first steady step's kernels (``calibrate.kernel_mix``)."""

    @classmethod
    def build(cls, cfg: PrismConfig, args: LaunchArgs) -> RunContext:
        tr = args.torchrun
        program = Program(script=args.script, args=tuple(args.script_args), module=bool(tr.module),
                          no_python=bool(tr.no_python))
        topo = Topology(world_size=cfg.target.world_size, nproc_per_node=cfg.target.nproc_per_node,
                        nnodes=cfg.target.nnodes)
        keyed_args = mask_output_args(list(program.args), output_args(cfg.trace.ignore_args))
        fingerprint = fp.fingerprint(program_config=program_config(cfg), script=program.script,
                                     module=program.module, args=keyed_args)
        run_id = tr.rdzv_id if tr.rdzv_id not in (None, "none") else uuid.uuid4().hex[:12]
        if cfg.trace.dir:
            trace = TraceLayout(Path(cfg.trace.dir).expanduser().resolve())
        else:
            stem = Path(program.script).stem if not program.module else program.script.replace(".", "_")
            trace = TraceLayout((Path.cwd() / "prism_traces" / f"{stem}-{fp.combined(fingerprint)}").resolve())
        report = ReportLayout(Path(cfg.report.dir).resolve()) if cfg.report.dir else trace.default_report
        flags = TorchrunFlags(master_addr=tr.master_addr, master_port=tr.master_port, rdzv_endpoint=tr.rdzv_endpoint,
                              max_restarts=tr.max_restarts, role=tr.role, redirects=tr.redirects, tee=tr.tee)
        agent = RankAgent(program=program, topo=topo, torchrun=flags, launch=cfg.launch, run_id=run_id,
                          fork_entry=fork_entry, warm_imports=tuple(cfg.capture.warm_imports))
        return cls(cfg=cfg, program=program, topo=topo, fingerprint=fingerprint, run_id=run_id, trace=trace,
                   report=report, log_root=Path(tr.log_dir).resolve() if tr.log_dir else None, agent=agent,
                   local_rank_arg=args.local_rank_arg)

    def with_config(self, cfg: PrismConfig, *, report: ReportLayout | None = None,
                    profile_kernels: bool = False) -> RunContext:
        """The same run under another config value (a calibration slice); the fingerprint and
        trace stay this run's."""
        return replace(self, cfg=cfg, report=report or self.report, profile_kernels=profile_kernels)

    def log_dir(self, mode: Mode) -> Path:
        """A new directory (mode 0700) for one phase's logs, like torchrun's
        (``<log-dir>/<run_id>_<random>``): ``<log_root>/<run_id>-<mode>-<random>``, or one under
        the temporary directory. Never one that exists: another user cannot plant it, and a run
        never writes into an earlier run's logs."""
        if self.log_root is not None:
            self.log_root.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=f"{self.run_id}-{mode}-", dir=self.log_root))
        return Path(tempfile.mkdtemp(prefix=f"prism-{mode}-"))

    def capture_command(self) -> str:
        """The command line that records this run's trace (named in errors)."""
        argv = ["prism-launch", f"--nnodes={self.topo.nnodes}", f"--nproc-per-node={self.topo.nproc_per_node}",
                "mode=capture", f"trace.dir={self.trace.root}"]
        if self.topo.world_size != self.topo.nnodes * self.topo.nproc_per_node:
            argv.append(f"target.world_size={self.topo.world_size}")
        if self.program.module:
            argv.append("-m")
        return shlex.join([*argv, self.program.script, *self.program.args])

    def base_plan(self, mode: Mode, ranks: list[int]) -> RankPlan:
        """The plan fields every mode shares; the mode runner adds its own section."""
        cfg = self.cfg
        return RankPlan(
            mode=str(mode), device=str(cfg.device), compat=compat_modules(cfg), probes=probe_modules(cfg), timeout_s=cfg.comm.timeout_s,
            subgroups=cfg.comm.subgroups, local_ranks=tuple(ranks), memory_track=cfg.memory.track,
            memory_cpu_hook=cfg.memory.cpu_hook, memory_cache_dir=cfg.memory.cache_dir,
            local_rank_arg=self.local_rank_arg, hook=self.program.no_python,
        )
