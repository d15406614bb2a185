"""The launch agent: starts one set of rank processes for a plan and waits for them, as
torchrun's elastic agent does for its workers.

Each rank gets torchrun's environment for its logical rank (:mod:`prism_launch.launch.env`)
plus the run's :class:`~prism_launch.config.plan.RankPlan`; ranks are forked from this warmed
process (the caller supplies the function a forked child runs) or spawned as ``python -m
prism_launch.rank.bootstrap``. SIGINT/SIGTERM/SIGHUP end the run (:class:`~prism_launch.errors.Interrupted`, every rank
stopped; a repeated signal does not interrupt the teardown, and stays ignored after it, so
neither does it cut the caller's own cleanup short); a failed run raises
:class:`RunFailedError` with the first failure's message and traceback, as torchrun's error
summary shows it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import Std

from prism_launch.config import LaunchConfig, StartMethod
from prism_launch.config.plan import RankPlan
from prism_launch.errors import Interrupted, RanksStoppedError, RunFailedError
from prism_launch.launch.env import Topology, torchrun_env
from prism_launch.launch.procs import RankProcesses, RanksTimeoutError, RankSpec, RunResult

HOOK_DIR = Path(__file__).resolve().parents[1] / "rank" / "_hook"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True, slots=True)
class Program:
    """What the user asked to run: the script (or module, or --no-python command) and its args."""

    script: str
    args: tuple[str, ...]
    module: bool = False
    no_python: bool = False

    def argv(self) -> list[str]:
        if self.no_python:
            return [self.script, *self.args]
        return [sys.executable, "-u", "-m", "prism_launch.rank.bootstrap", *(["-m"] if self.module else []),
                self.script, *self.args]


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchrunFlags:
    """The torchrun flags that shape how ranks start and log."""

    master_addr: str | None = None
    master_port: int | str | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    role: str = "default"
    redirects: str = "0"
    tee: str = "0"

    def master_addr_for_ranks(self) -> str:
        """MASTER_ADDR as torchrun's static rendezvous reports it (torch 2.13): the host of
        --rdzv-endpoint, else --master-addr when --master-port was given, else localhost."""
        if self.rdzv_endpoint:
            return self.rdzv_endpoint.rsplit(":", 1)[0] or "localhost"
        if self.master_port:
            return self.master_addr or "127.0.0.1"
        return "localhost"


ForkEntry = Callable[[RankSpec, Program], int]
"""What a forked child runs: the rank's bootstrap, or the assistant."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm(imports: Sequence[str]) -> None:
    """Import what every forked rank needs once, here, and freeze the heap they inherit."""
    import ctypes
    import gc
    import importlib

    import torch

    torch.set_num_threads(1)  # one thread per rank; also keeps forked children out of OpenMP deadlocks
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - warming is an optimisation only
            pass
    # Children inherit the launcher's heap (modules, and after a capture the trace rows):
    # frozen objects are never rescanned by the children's collector, so the ranks' GC
    # pauses and copy-on-write page faults do not grow with the launcher's state.
    gc.collect()
    gc.freeze()
    try:  # hand freed heap back to the OS: children must not inherit (and copy) the capture's garbage
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(kw_only=True, slots=True)
class RankAgent:
    program: Program
    topo: Topology
    torchrun: TorchrunFlags
    launch: LaunchConfig
    run_id: str
    fork_entry: ForkEntry
    warm_imports: tuple[str, ...] = ()

    def rank_env(self, rank: int, plan_env: dict[str, str], master_port: int) -> dict[str, str]:
        tr = self.torchrun
        env = torchrun_env(rank, self.topo, master_addr=tr.master_addr_for_ranks(), master_port=master_port,
                           run_id=self.run_id, max_restarts=tr.max_restarts, role=tr.role,
                           omp_threads=os.environ.get("OMP_NUM_THREADS", "1"))
        env.update(plan_env)
        if self.program.no_python:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(HOOK_DIR), str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return env

    def assistant_spec(self, plan: RankPlan, log_dir: Path) -> RankSpec:
        """The assistant: a physical process, not a logical rank; its logs go under ``<log-dir>/<world_size>``."""
        return RankSpec(rank=self.topo.world_size, env={**plan.to_env(log_dir), "OMP_NUM_THREADS": "1"},
                        argv=[sys.executable, "-u", "-m", "prism_launch.rank.assistant_main"])

    def run(self, plan: RankPlan, *, log_dir: Path, extra_specs: Sequence[RankSpec] = (),
            on_tick: Callable[[], None] | None = None, on_start: Callable[[], None] | None = None,
            fresh_port: bool = False) -> Path:
        """Start ``plan.local_ranks`` (and ``extra_specs``), wait for all; returns the log dir."""
        tr = self.torchrun
        port = free_port() if fresh_port or not tr.master_port else int(tr.master_port)
        spawn = self.program.no_python or self.launch.start_method is StartMethod.spawn
        argv = self.program.argv()
        plan_env = plan.to_env(log_dir)
        specs = [RankSpec(rank=r, env=self.rank_env(r, plan_env, port), argv=argv if spawn else None)
                 for r in plan.local_ranks]
        specs += [RankSpec(rank=x.rank, env=x.env, argv=x.argv if spawn else None) for x in extra_specs]
        redirects, tee = Std.from_str(tr.redirects), Std.from_str(tr.tee)
        if redirects == Std.NONE and tee == Std.NONE:
            tee = Std.ALL  # keep per-rank logs for the report while showing output like torchrun
        target = None
        if not spawn:
            warm(self.warm_imports)
            program, entry = self.program, self.fork_entry

            def target(spec: RankSpec) -> int:
                return entry(spec, program)

        procs = RankProcesses(specs, start_method="spawn" if spawn else "fork", target=target, log_dir=log_dir,
                              redirects=redirects, tee=tee, teardown_timeout_s=self.launch.teardown_timeout_s)
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        stopping = []

        def on_signal(signum, _frame):
            if stopping:  # already tearing down (bounded by launch.teardown_timeout_s): let it finish
                return
            stopping.append(signum)
            raise Interrupted(signum)

        for s in previous:
            signal.signal(s, on_signal)
        try:
            procs.start()
            if on_start is not None:
                on_start()
            # capture and emulation: every communication wait of a rank ends by comm.timeout_s, so a
            # rank without a heartbeat that long is stopped (launch.run_timeout_s's docstring)
            beats = procs.heartbeats(plan.timeout_s) if plan.mode in ("capture", "emulate") else None
            result = procs.wait(self.launch.run_timeout_s, on_tick=on_tick, tick_s=0.0 if on_tick else 0.05,
                                heartbeats=beats)
        except RanksTimeoutError as e:
            raise RunFailedError(f"run exceeded launch.run_timeout_s={self.launch.run_timeout_s}: {e}") from None
        except RanksStoppedError as e:
            raise RunFailedError(f"{e}\nper-rank logs: {log_dir}") from None
        except BaseException:
            procs.close("launcher interrupted")
            raise
        finally:
            procs.close()
            for s, h in previous.items():
                # after a signal stopped the run a repeat stays ignored: the caller's own teardown
                # (the trace's removal, the exit code of the first signal) must not be cut short
                signal.signal(s, signal.SIG_IGN if stopping else h)
        if not result.ok:
            raise RunFailedError(describe_failure(result, log_dir))
        return log_dir


def describe_failure(result: RunResult, log_dir: Path) -> str:
    first = result.first_failure
    if first is None:
        bad = {r: c for r, c in result.exitcodes.items() if c != 0}
        return f"ranks exited with {bad}; logs in {log_dir}"
    how = "signal " + first.signal if first.signal else f"exitcode {first.exitcode}"
    lines = [f"rank {first.rank} failed ({how}): {first.message}"]
    if first.traceback:
        lines.append("traceback (most recent call last) of rank %d:\n%s" % (first.rank, program_frames(first.traceback)))
    if first.error_file:
        lines.append(f"error file: {first.error_file}")
    others = sorted(r for r in result.failures if r != first.rank)
    if others:
        lines.append(f"also failed: ranks {others}")
    lines.append(f"per-rank logs: {log_dir}")
    return "\n".join(lines)


_LAUNCHER_FRAMES = ('File "<frozen runpy>"', "prism_launch/rank/bootstrap.py", "prism_launch/launch/",
                    "prism_launch/modes/context.py")


def program_frames(tb: str) -> str:
    """A rank's traceback from its program's first frame on: the frames of the fork, the
    bootstrap and runpy above it say nothing about the failure (a chained traceback is kept
    whole)."""
    lines = tb.rstrip().splitlines()
    if sum(line.startswith("Traceback (most recent call last)") for line in lines) != 1:
        return "\n".join(lines)
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    ours = [i for i in frames if any(m in lines[i] for m in _LAUNCHER_FRAMES)]
    rest = [i for i in frames if i > (ours[-1] if ours else -1)]
    if not ours or not rest:
        return "\n".join(lines)
    return "\n".join([lines[0], *lines[rest[0]:]])
