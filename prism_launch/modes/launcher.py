"""Runs one prism-launch invocation: real, capture, emulate or auto.

The launcher owns the rank processes (:mod:`prism_launch.launch.procs`), the capture
coordinator and the trace; ranks themselves start in :mod:`prism_launch.rank.bootstrap`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import Std

from prism_launch.trace import fingerprint as fp
from prism_launch.cli.args import LaunchArgs
from prism_launch.config import Mode, PrismConfig, StartMethod, VirtualHost
from prism_launch.launch.env import Topology, torchrun_env
from prism_launch.errors import PrismError, RunFailedError, TraceMismatchError
from prism_launch.launch.procs import RankProcesses, RanksTimeoutError, RankSpec, RunResult
from prism_launch.trace import TraceError, TraceMissingError, TraceReader, TraceWriter

HOOK_DIR = Path(__file__).resolve().parents[1] / "rank" / "_hook"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class RunOutcome:
    mode: Mode
    trace_dir: Path | None
    report_dir: Path | None
    log_dir: Path


class Launcher:
    def __init__(self, cfg: PrismConfig, args: LaunchArgs):
        self.cfg = cfg
        self.args = args
        self.topo = Topology(world_size=cfg.target.world_size, nproc_per_node=cfg.target.nproc_per_node,
                             nnodes=cfg.target.nnodes)
        self.module = bool(args.torchrun.module)
        self.no_python = bool(args.torchrun.no_python)
        self.fingerprint = fp.fingerprint(program_config=self.program_config(), script=args.script,
                                          module=self.module, args=args.script_args)
        self.run_id = args.torchrun.rdzv_id if args.torchrun.rdzv_id not in (None, "none") else uuid.uuid4().hex[:12]

    # -- derived settings -------------------------------------------------------------
    def program_config(self) -> dict:
        """The part of the config that changes what the program computes."""
        return {
            "target": asdict(self.cfg.target),
            "device": str(self.cfg.device),
            "compat": list(self.cfg.compat.modules) if str(self.cfg.device) == "cpu" else [],
        }

    @property
    def trace_dir(self) -> Path:
        if self.cfg.trace.dir:
            return Path(self.cfg.trace.dir).expanduser().resolve()
        stem = Path(self.args.script).stem if not self.module else self.args.script.replace(".", "_")
        return (Path.cwd() / "prism_traces" / f"{stem}-{fp.combined(self.fingerprint)}").resolve()

    @property
    def report_dir(self) -> Path:
        return Path(self.cfg.report.dir).resolve() if self.cfg.report.dir else self.trace_dir / "report"

    def log_dir(self, mode: Mode) -> Path:
        base = self.args.torchrun.log_dir
        if base:
            return Path(base).resolve() / f"{self.run_id}-{mode}"
        return Path(tempfile.mkdtemp(prefix=f"prism-{mode}-"))

    def capture_command(self) -> str:
        argv = ["prism-launch", f"--nnodes={self.topo.nnodes}", f"--nproc-per-node={self.topo.nproc_per_node}",
                "mode=capture", f"trace.dir={self.trace_dir}"]
        if self.cfg.target.world_size != self.topo.nnodes * self.topo.nproc_per_node:
            argv.append(f"target.world_size={self.cfg.target.world_size}")
        if self.module:
            argv.append("-m")
        return shlex.join([*argv, self.args.script, *self.args.script_args])

    # -- entry --------------------------------------------------------------------------
    def run(self) -> RunOutcome:
        mode = self.cfg.mode
        if mode is Mode.real:
            log_dir = self.log_dir(Mode.real)
            mem = (lambda r: {"PRISM_MEMORY_OUT": str(log_dir / str(r) / "memory.json")}) if self.cfg.memory.track else {}
            self._run_ranks(Mode.real, list(range(self.topo.world_size)), mem, log_dir=log_dir)
            return RunOutcome(mode, None, None, log_dir)
        if mode is Mode.capture:
            log_dir = self.capture()
            return RunOutcome(mode, self.trace_dir, None, log_dir)
        if mode is Mode.emulate:
            log_dir = self.emulate(self.open_trace())
            return RunOutcome(mode, self.trace_dir, self.report_dir, log_dir)
        if mode is Mode.calibrate:
            from prism_launch.predict.calibrate import calibrate

            calibrate(self, self.open_trace())
            return RunOutcome(mode, self.trace_dir, None, self.trace_dir)
        # auto
        try:
            reader = self.open_trace()
        except (TraceMissingError, TraceMismatchError) as e:
            print(f"prism-launch: {'no trace yet' if isinstance(e, TraceMissingError) else e}; capturing "
                  f"{self.topo.world_size} logical ranks into {self.trace_dir}", file=sys.stderr)
            self.capture()
            reader = self.open_trace()
        missing = [r for r in self.cfg.sandbox.ranks if r not in reader.manifest.ranks_captured]
        if missing:
            print(f"prism-launch: sandbox ranks {missing} are outside the folded capture in {self.trace_dir}; "
                  "capturing again around them", file=sys.stderr)
            self.capture()
            reader = self.open_trace()
        from prism_launch.predict.calibrate import calibrate, calibrated_dir

        in_auto = self.cfg.calibrate.in_auto
        if in_auto is None:
            in_auto = str(self.cfg.device) == "cuda"
        if in_auto and not (calibrated_dir(self.trace_dir) / "manifest.json").exists():
            calibrate(self, reader)
        log_dir = self.emulate(reader)
        return RunOutcome(mode, self.trace_dir, self.report_dir, log_dir)

    # -- trace checks ---------------------------------------------------------------------
    def open_trace(self) -> TraceReader:
        reader = TraceReader(self.trace_dir, hint=self.capture_command())
        recorded = reader.manifest.fingerprint
        differs = [k for k in ("config", "script", "args", "versions") if recorded.get(k) != self.fingerprint[k]]
        if differs:
            extra = reader.manifest.extra
            details = []
            if "args" in differs:
                details.append(f"script args: recorded {extra.get('script_args')} vs now {self.args.script_args}")
            if "config" in differs:
                details.append(f"config: recorded {extra.get('program_config')} vs now {self.program_config()}")
            if "versions" in differs:
                details.append(f"versions: recorded {reader.manifest.versions} vs now {fp.versions()}")
            if "script" in differs:
                details.append(f"script: {self.args.script} changed since the capture")
            raise TraceMismatchError(
                f"trace {self.trace_dir} was captured for a different {', '.join(differs)}; "
                + "; ".join(details)
                + f". Capture again: {self.capture_command()}"
            )
        return reader

    # -- rank processes -------------------------------------------------------------------
    def _rank_env(self, rank: int, mode: Mode, extra: dict[str, str]) -> dict[str, str]:
        tr = self.args.torchrun
        env = torchrun_env(
            rank, self.topo, master_addr=self._master_addr, master_port=self._master_port,
            run_id=self.run_id, max_restarts=tr.max_restarts, role=tr.role,
            omp_threads=os.environ.get("OMP_NUM_THREADS", "1"),
        )
        env.update({
            "PRISM_MODE": str(mode),
            "PRISM_DEVICE": str(self.cfg.device),
            "PRISM_COMPAT": ",".join(self.cfg.compat.modules) if str(self.cfg.device) == "cpu" else "",
            "PRISM_TIMEOUT_S": str(self.cfg.comm.timeout_s),
            "PRISM_MEMORY": "1" if self.cfg.memory.track else "0",
        })
        if self.no_python:
            env["PRISM_HOOK"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(HOOK_DIR), str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")) if p
            )
        env.update(extra)
        return env

    def _torchrun_master_addr(self) -> str:
        """MASTER_ADDR as torchrun's static rendezvous reports it (torch 2.13): the host of
        --rdzv-endpoint, else --master-addr when --master-port was given, else localhost."""
        tr = self.args.torchrun
        if tr.rdzv_endpoint:
            return tr.rdzv_endpoint.rsplit(":", 1)[0] or "localhost"
        if tr.master_port:
            return tr.master_addr or "127.0.0.1"
        return "localhost"

    def _argv(self) -> list[str]:
        if self.no_python:
            return [self.args.script, *self.args.script_args]
        return [sys.executable, "-u", "-m", "prism_launch.rank.bootstrap", *(["-m"] if self.module else []),
                self.args.script, *self.args.script_args]

    def _warm(self) -> None:
        import importlib

        import torch

        torch.set_num_threads(1)  # one thread per rank; also keeps forked children out of OpenMP deadlocks
        for name in self.cfg.capture.warm_imports:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - warming is an optimisation only
                pass
        import gc

        # Children inherit the launcher's heap (modules, and after a capture the trace rows):
        # frozen objects are never rescanned by the children's collector, so the ranks' GC
        # pauses and copy-on-write page faults do not grow with the launcher's state.
        gc.collect()
        gc.freeze()
        try:  # hand freed heap back to the OS: children must not inherit (and copy) the capture's garbage
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def _run_ranks(self, mode: Mode, ranks: list[int], extra_env: dict[str, str], on_tick=None, on_start=None,
                   extra_specs: list[RankSpec] = (), log_dir: Path | None = None) -> Path:
        tr = self.args.torchrun
        self._master_addr = self._torchrun_master_addr()
        self._master_port = _free_port() if mode is Mode.real or not tr.master_port else int(tr.master_port)
        method = self.cfg.launch.start_method
        if method is None:
            method = StartMethod.spawn if str(self.cfg.device) == "cuda" else StartMethod.fork
        spawn = self.no_python or method is StartMethod.spawn
        argv = self._argv()
        specs = [RankSpec(rank=r, env={**self._rank_env(r, mode, extra_env(r) if callable(extra_env) else extra_env),
                                       "PRISM_DEVICE_SLOT": str(i), "PRISM_DEVICE_SLOTS": str(len(ranks))},
                          argv=argv if spawn else None) for i, r in enumerate(ranks)]
        specs += [RankSpec(rank=x.rank, env=x.env, argv=x.argv if spawn else None) for x in extra_specs]
        log_dir = log_dir or self.log_dir(mode)
        redirects = Std.from_str(tr.redirects)
        tee = Std.from_str(tr.tee)
        if redirects == Std.NONE and tee == Std.NONE:
            tee = Std.ALL  # keep per-rank logs for the report while showing output like torchrun
        target = None
        if not spawn:
            self._warm()
            from prism_launch.rank import bootstrap

            script, args, module = self.args.script, self.args.script_args, self.module

            def target(spec: RankSpec) -> int:
                if spec.env.get("PRISM_ROLE") == "assistant":
                    from prism_launch.rank import assistant_main

                    return assistant_main.main()
                return bootstrap.run(script, args, module=module)

        procs = RankProcesses(specs, start_method="spawn" if spawn else "fork", target=target, log_dir=log_dir,
                              redirects=redirects, tee=tee, teardown_timeout_s=self.cfg.launch.teardown_timeout_s)
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

        def on_signal(signum, _frame):
            raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

        for s in previous:
            signal.signal(s, on_signal)
        try:
            procs.start()
            if on_start is not None:
                on_start()
            result = procs.wait(self.cfg.launch.run_timeout_s, on_tick=on_tick, tick_s=0.0 if on_tick else 0.05)
        except RanksTimeoutError as e:
            raise RunFailedError(f"run exceeded launch.run_timeout_s={self.cfg.launch.run_timeout_s}: {e}") from None
        except BaseException:
            procs.close("launcher interrupted")
            raise
        finally:
            procs.close()
            for s, h in previous.items():
                signal.signal(s, h)
        if not result.ok:
            raise RunFailedError(self._describe_failure(result, log_dir))
        return log_dir

    def _describe_failure(self, result: RunResult, log_dir: Path) -> str:
        first = result.first_failure
        if first is None:
            bad = {r: c for r, c in result.exitcodes.items() if c != 0}
            return f"ranks exited with {bad}; logs in {log_dir}"
        lines = [f"rank {first.rank} failed ({'signal ' + first.signal if first.signal else f'exitcode {first.exitcode}'}): "
                 f"{first.message}"]
        if first.traceback:
            lines.append("traceback (most recent call last) of rank %d:\n%s" % (first.rank, first.traceback.rstrip()))
        if first.error_file:
            lines.append(f"error file: {first.error_file}")
        others = sorted(r for r in result.failures if r != first.rank)
        if others:
            lines.append(f"also failed: ranks {others}")
        lines.append(f"per-rank logs: {log_dir}")
        return "\n".join(lines)

    # -- capture --------------------------------------------------------------------------
    def fold_wanted(self) -> bool:
        fold = self.cfg.capture.fold
        return self.topo.world_size > self.cfg.capture.fold_threshold if fold is None else bool(fold)

    def discover_groups(self) -> list[tuple[list[int], str]]:
        """Run one logical rank up to its first communication op; return every ``new_group``
        call it made (rank list, description) — the whole world's group layout."""
        out_dir = Path(tempfile.mkdtemp(prefix="prism-discover-"))
        out = out_dir / "groups.json"
        rank = self.cfg.sandbox.ranks[0]
        try:
            self._run_ranks(Mode.capture, [rank], {"PRISM_DISCOVER": str(out)}, log_dir=out_dir / "logs")
        except RunFailedError as e:  # its logs stay for the user to read
            raise RunFailedError(f"group discovery for the folded capture failed (capture.fold=false skips it): {e}") from None
        if not out.exists():
            raise RunFailedError(f"group discovery: rank {rank} ended without reporting its groups; logs in {out_dir}")
        groups = [(list(r), d) for r, d in json.loads(out.read_text())["groups"]]
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
        return groups

    def fold_plan(self):
        from prism_launch.capture.fold import FoldPlan, plan

        ws = self.topo.world_size
        if not self.fold_wanted():
            return FoldPlan.identity(ws)
        t0 = time.monotonic()
        groups = self.discover_groups()
        p = plan(groups, self.cfg.sandbox.ranks, ws, self.cfg.capture.replicated_groups)
        print(f"prism-launch: folded capture: {len(p.captured)} of {ws} logical ranks closed under the "
              f"model-parallel groups of sandbox ranks {list(self.cfg.sandbox.ranks)} "
              f"({len(groups)} new_group calls, {time.monotonic() - t0:.1f}s)", file=sys.stderr)
        return p

    def capture_slots(self) -> int | None:
        slots = self.cfg.capture.slots
        if slots is None:
            if str(self.cfg.device) == "cuda":
                import torch

                slots = max(1, torch.cuda.device_count())
            else:
                slots = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return slots or None

    def parker(self, slots: int | None):
        from prism_launch.config import Park

        park = self.cfg.capture.park
        if park is Park.auto:  # checkpointing costs seconds per switch: only when a budget is given
            park = Park.cuda_checkpoint if str(self.cfg.device) == "cuda" and self.cfg.capture.resident else Park.none
        if park is Park.none:
            return None
        from prism_launch.launch.parking import CudaCheckpointParker

        return CudaCheckpointParker(self.cfg.capture.resident or slots or 1)

    def capture(self) -> Path:
        from prism_launch.capture.coordinator import CaptureError, Coordinator
        from prism_launch.report.build import parse_rank_log

        ws = self.topo.world_size
        fold = self.fold_plan()
        ranks = list(fold.captured)
        slots = self.capture_slots()
        parker = self.parker(slots)
        sock_dir = Path(tempfile.mkdtemp(prefix="prism-coord-"))
        authkey = os.urandom(16)
        coord = Coordinator(str(sock_dir / "coord.sock"), authkey, ws, self.cfg.comm.timeout_s, slots=slots,
                            parker=parker, fold=fold if fold.folded else None)
        env = {"PRISM_COORD": coord.address, "PRISM_AUTHKEY": authkey.hex()}
        if fold.folded:
            env["PRISM_CAPTURED"] = ",".join(map(str, ranks))
        t0 = time.monotonic()
        try:
            try:
                log_dir = self._run_ranks(Mode.capture, ranks, env,
                                          on_tick=lambda: coord.pump(0.02), on_start=coord.start)
            except CaptureError as e:
                raise RunFailedError(f"capture failed: {e}") from None
            for _ in range(50):  # drain what ranks sent right before exiting
                coord.pump(0.01)
            left = coord.unfinished()
            if left:
                raise RunFailedError(f"capture incomplete: {left}")
        finally:
            coord.close()
            for p in sock_dir.iterdir():
                p.unlink(missing_ok=True)
            sock_dir.rmdir()
        wall = time.monotonic() - t0
        steps = {r: parse_rank_log(log_dir / str(r) / "stdout.log", self.cfg.report) for r in ranks}
        sched = coord.scheduler
        capture_stats = {"wall_s": wall, "slots": slots, "max_running": sched.max_running,
                         "resumes": sched.switches, "extra_slots": sched.extra,
                         "parking": parker.stats.to_dict() if parker is not None else None,
                         "ranks": len(ranks), "folded": fold.folded}
        with TraceWriter(self.trace_dir) as writer:
            writer.add_events(coord.events)
            for r in ranks:
                if coord.tensors[r]:
                    writer.add_tensors(r, coord.tensors[r])
            writer.write_json("steps.json", {str(r): s for r, s in steps.items()})
            writer.write_json("memory.json", {str(r): m for r, m in coord.memory.items()})
            writer.write_json("capture.json", capture_stats)
            if fold.folded:
                writer.write_json("fold.json", {**fold.to_dict(), "approximated_groups": coord.approximated_groups})
            writer.commit(
                fingerprint=self.fingerprint, versions=fp.versions(), world_size=ws,
                topology=self.topo.to_dict(), groups=coord.groups(), ranks_captured=ranks,
                extra={"script": self.args.script, "script_args": self.args.script_args, "module": self.module,
                       "program_config": self.program_config(), "capture_wall_s": wall,
                       "ops": coord.ops_completed, "log_dir": str(log_dir), "capture": capture_stats},
            )
        nbytes = sum(t.numel() * t.element_size() for d in coord.tensors for t in d.values())
        what = f"{len(ranks)} of {ws} logical ranks (folded)" if fold.folded else f"{ws} logical ranks"
        print(f"prism-launch: captured {what}, {coord.ops_completed} ops, {len(coord.events)} events, "
              f"{nbytes / 2**20:.1f} MiB of tensors in {wall:.1f}s ({slots or 'unlimited'} slots, "
              f"{sched.switches} resumes) -> {self.trace_dir}", file=sys.stderr)
        return log_dir

    # -- emulate --------------------------------------------------------------------------
    def emulate(self, reader: TraceReader, *, quiet: bool = False) -> Path:
        import torch.distributed as dist

        from prism_launch.report.build import build_report

        sandbox = list(self.cfg.sandbox.ranks)
        missing = [r for r in sandbox if r not in reader.manifest.ranks_captured]
        if missing:
            raise PrismError(
                f"sandbox.ranks {missing} are not in the trace {self.trace_dir} (a folded capture holds only the "
                f"ranks closed under its sandbox ranks' model-parallel groups); capture around them: "
                f"{self.capture_command()} with sandbox.ranks={list(self.cfg.sandbox.ranks)}, or use mode=auto")
        report_dir = self.report_dir
        ph = self.cfg.physical
        local = self.local_sandbox()
        summaries = report_dir / "sandbox" if ph.node_rank == 0 else report_dir / f"node{ph.node_rank}" / "sandbox"
        store = None
        env = {
            "PRISM_TRACE_DIR": str(self.trace_dir),
            "PRISM_SANDBOX": ",".join(map(str, sandbox)),
            "PRISM_TIMING": str(self.cfg.emulate.timing),
            "PRISM_TIME_SCALE": str(self.cfg.emulate.time_scale),
            "PRISM_STRICT": "1" if self.cfg.emulate.strict else "0",
            "PRISM_CHECK": "1" if self.cfg.emulate.check_divergence else "0",
            "PRISM_DATA_PATH": self.data_path(),
            "PRISM_PREFETCH": str(self.cfg.emulate.prefetch.mode),
            "PRISM_PRUNED": "1" if self.cfg.emulate.pruned_rings else "0",
            "PRISM_RING_BACKEND": str(self.cfg.emulate.ring_backend),
            "PRISM_RING_TAGS": "1" if self.cfg.emulate.ring_tags else "0",
            "PRISM_POOL_MIB": str(self.cfg.emulate.prefetch.pool_mib),
            "PRISM_POOL_GROW": "1" if self.cfg.emulate.prefetch.grow else "0",
            "PRISM_POOL_RESERVE_BYTES": str(int(self.cfg.emulate.prefetch.reserve_gib * 2**30)),
            "PRISM_PREFETCH_THREADS": str(self.cfg.emulate.prefetch.threads),
            "PRISM_HOST_TIER_BYTES": str(int(self.cfg.emulate.prefetch.host_tier_gib * 2**30)),
        }
        enforce = self.cfg.memory.enforce_limit
        if enforce is None:
            enforce = str(self.cfg.device) == "cuda"
        if enforce:
            env["PRISM_MEMORY_LIMIT"] = str(int(self.cfg.cluster.gpu_memory_gib * 2**30))
        assistant = self.cfg.emulate.virtual_host is VirtualHost.assistant
        import datetime

        timeout = datetime.timedelta(seconds=self.cfg.comm.timeout_s)
        if ph.nodes > 1:  # node 0 hosts the store every node's sandbox ranks rendezvous through
            host, port = ph.endpoint.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=ph.node_rank == 0, wait_for_workers=False,
                                  timeout=timeout)
            env["PRISM_STORE"] = ph.endpoint
        elif len(sandbox) + assistant > 1:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
            env["PRISM_STORE"] = f"127.0.0.1:{store.port}"
        extra_specs = []
        if assistant:  # on node 0; every node's sandbox ranks count it in the physical group
            env["PRISM_ASSISTANT"] = "1"
            env["PRISM_WINDOW"] = str(self.cfg.emulate.window)
        if assistant and ph.node_rank == 0:
            # The assistant is a physical process, not a logical rank; its logs go under <log-dir>/<world_size>.
            extra_specs.append(RankSpec(
                rank=self.topo.world_size,
                env={**env, "PRISM_ROLE": "assistant", "PRISM_TIMEOUT_S": str(self.cfg.comm.timeout_s),
                     "PRISM_DEVICE_SLOT": str(len(local)),  # the GPU after this node's sandbox ranks
                     "PRISM_SUMMARY": str(summaries / "assistant.json"), "OMP_NUM_THREADS": "1"},
                argv=[sys.executable, "-u", "-m", "prism_launch.rank.assistant_main"],
            ))
        for old in summaries.glob("*.json") if summaries.exists() else ():
            old.unlink()
        from prism_launch.config import Timing

        if self.cfg.emulate.timing is Timing.predicted:
            from nccl_ext.atomic import atomic_write_text
            from prism_launch.predict.prediction import schedule

            path = summaries / "schedule.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(schedule(self.cfg, reader, self.trace_dir)))
            env["PRISM_SCHEDULE"] = str(path)
        t0 = time.monotonic()
        log_dir = self.log_dir(Mode.emulate)
        oom = None
        try:
            self._run_ranks(Mode.emulate, local, lambda r: {**env, "PRISM_SUMMARY": str(summaries / f"rank{r}.json")},
                            extra_specs=extra_specs, log_dir=log_dir)
        except RunFailedError as e:
            # running out of memory at the target's limit is a finding, not a crash: report it
            oom = None if ph.nodes > 1 else self._sandbox_oom(log_dir, local)
            if oom is None:
                raise
            oom["limit_bytes"] = int(env.get("PRISM_MEMORY_LIMIT", 0)) or None
        if ph.nodes > 1:
            self._exchange_summaries(store, sandbox, local, summaries)
        wall = time.monotonic() - t0
        del store
        if ph.node_rank != 0:
            print(f"prism-launch: node {ph.node_rank} ran sandbox ranks {local}; the report is written by node 0",
                  file=sys.stderr)
        elif not quiet or oom is not None:
            report = build_report(self, reader, sandbox, log_dir, summaries, wall, sandbox_oom=oom)
            if oom is not None:
                raise RunFailedError(
                    f"{oom['message']}\nthe sandbox ran out of memory at the target's limit "
                    f"(cluster.gpu_memory_gib={self.cfg.cluster.gpu_memory_gib:g}); predicted OOM ranks: "
                    f"{report['predicted']['oom_ranks'][:16]}; report: {self.report_dir / 'report.json'}")
        return log_dir

    def _sandbox_oom(self, log_dir: Path, ranks: list[int]) -> dict | None:
        """The first sandbox rank whose error file says it ran out of memory, if any (the
        assistant failing because that rank stopped early is a consequence, not the cause)."""
        for r in ranks:
            path = log_dir / str(r) / "error.json"
            try:
                msg = json.loads(path.read_text()).get("message", "")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(msg, dict):  # torchelastic's error file nests {"message": ..., "extraInfo": ...}
                msg = msg.get("message", "")
            text = msg if isinstance(msg, str) else json.dumps(msg)
            if "OutOfMemoryError" in text:
                return {"rank": r, "message": f"rank {r}: {text.splitlines()[0]}"}
        return None

    def data_path(self) -> str:
        """The resolved ``emulate.data_path``: the device path whenever the sandbox runs on CUDA."""
        from prism_launch.config import DataPath

        choice = self.cfg.emulate.data_path
        if choice is DataPath.auto:
            return "device" if str(self.cfg.device) == "cuda" else "host"
        return str(choice)

    def local_sandbox(self) -> list[int]:
        """The sandbox ranks this physical node runs: the sandbox list split into
        ``physical.nodes`` contiguous chunks, in order."""
        sandbox, ph = list(self.cfg.sandbox.ranks), self.cfg.physical
        k, extra = divmod(len(sandbox), ph.nodes)
        start = ph.node_rank * k + min(ph.node_rank, extra)
        return sandbox[start : start + k + (ph.node_rank < extra)]

    def _exchange_summaries(self, store, sandbox: list[int], local: list[int], summaries: Path) -> None:
        """Other nodes hand their sandbox ranks' summaries to node 0 through the store."""
        import datetime

        if self.cfg.physical.node_rank != 0:
            for r in local:
                path = summaries / f"rank{r}.json"
                store.set(f"prism/summary/{r}", path.read_text() if path.exists() else "")
            return
        from nccl_ext.atomic import atomic_write_text

        remote = [r for r in sandbox if r not in local]
        keys = [f"prism/summary/{r}" for r in remote]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.cfg.comm.timeout_s))
        except Exception as e:  # noqa: BLE001 - c10d raises its own error types
            late = [r for r, k in zip(remote, keys) if not store.check([k])]
            raise RunFailedError(f"node 0: sandbox ranks {late} on other nodes never reported within "
                                 f"comm.timeout_s={self.cfg.comm.timeout_s:g}s ({e})") from None
        for r, key in zip(remote, keys):
            text = store.get(key).decode()
            if text:
                atomic_write_text(summaries / f"rank{r}.json", text)
