"""Rank-process manager: start, watch and tear down the rank processes of one launch.

This is PrismLLM's counterpart of torch.distributed.elastic's process contexts
(``MultiprocessContext`` / ``SubprocessContext``) and follows their conventions.
This module owns the set of ranks of one launch: checking what to run, starting
every rank, watching for exits, tearing the others down on the first failure and
collecting the :class:`RunResult`. Beside it:

* :mod:`~prism_launch.launch.rank_start` starts one rank process (fork or spawn, in
  its own session / process group, with ``PR_SET_PDEATHSIG=SIGKILL``) and defines
  :class:`RankSpec`;
* :mod:`~prism_launch.launch.rank_logs` owns the per-rank log files
  (``<log_dir>/<rank>/{stdout.log,stderr.log}``, torchrun's ``redirects`` / ``tee``);
* :mod:`~prism_launch.launch.failures` owns ``error.json`` files and the result
  types (:class:`RunResult`, :class:`RankFailure`).

Teardown is ``SIGTERM`` to every rank's process group (grandchildren included),
``SIGKILL`` after ``teardown_timeout_s``, then reaping. Every wait is bounded.

Exits are detected with ``waitid(..., WNOWAIT)``: exited ranks stay zombies (so
their pid / process-group id cannot be recycled while we may still signal the
group) and are reaped by :meth:`RankProcesses.close`, which :meth:`poll` calls
itself once the run is over.

Signal handling belongs to the caller. :meth:`RankProcesses.close` holds no locks
and is idempotent and resumable, so it is safe to call after an exception raised
by a signal handler interrupted :meth:`~RankProcesses.wait` (or ``close`` itself).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Literal

from torch.distributed.elastic.multiprocessing.api import Std, to_map

from prism_launch.trace.layout import RankLogs
from prism_launch.errors import RanksTimeoutError
from prism_launch.launch.failures import ERROR_FILE_ENV, RankFailure, RunResult, rank_failure
from prism_launch.launch.heartbeat import Heartbeats, heartbeat_path, stopped_error
from prism_launch.launch.rank_logs import LOG_LINE_PREFIX_NAME, Tee, start_tee
from prism_launch.launch.rank_start import RankSpec, fork_rank, load_prctl, spawn_rank

__all__ = [
    "RankFailure",
    "RankProcesses",
    "RankSpec",
    "RanksTimeoutError",
    "RunResult",
    "Std",
]
# ERROR_FILE_ENV and LOG_LINE_PREFIX_NAME are imported above so they stay importable from here.

logger = logging.getLogger(__name__)

_KILL_REAP_TIMEOUT_S = 5.0  # how long to wait for SIGKILLed ranks to be reapable
_EXIT_STATUS_LOST = 255  # reported when someone else reaped a rank (e.g. SIGCHLD=SIG_IGN)
POLL_S = 0.02
"""How often :meth:`RankProcesses.wait` checks the ranks' exits (with an ``on_tick``, it ticks between)."""


class _Rank:
    """Internal per-rank bookkeeping."""

    __slots__ = (
        "spec", "dir", "stdout_path", "stderr_path", "error_path", "pid", "popen",
        "exitcode", "natural", "exit_time", "reaped", "lost",
    )

    def __init__(self, spec: RankSpec, rank_dir: Path, redirect: Std) -> None:
        self.spec = spec
        self.dir = rank_dir
        logs, rank = RankLogs(rank_dir.parent), spec.rank
        self.stdout_path = logs.stdout(rank) if redirect & Std.OUT else None
        self.stderr_path = logs.stderr(rank) if redirect & Std.ERR else None
        self.error_path = logs.error_file(rank)
        self.pid: int | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.exitcode: int | None = None  # known once the process has exited
        self.natural = False  # exited before teardown began
        self.exit_time = 0.0
        self.reaped = False
        self.lost = False  # exit status unavailable (reaped by someone else)


class RankProcesses:
    """Start, watch, log and tear down the rank processes of one launch.

    Usage::

        with RankProcesses(specs, start_method="spawn", target=None, log_dir=d,
                           redirects=Std.NONE, tee=Std.ALL) as procs:
            procs.start()
            result = procs.wait(on_tick=pump)

    The first rank to exit non-zero (or die of a signal) ends the run: :meth:`poll`
    tears down all other ranks and returns a failed :class:`RunResult`.
    """

    def __init__(
        self,
        specs: list[RankSpec],
        *,
        start_method: Literal["fork", "spawn"],
        target: Callable[[RankSpec], int] | None,
        log_dir: Path,
        redirects: Std | dict[int, Std],
        tee: Std | dict[int, Std],
        teardown_timeout_s: float = 10.0,
    ) -> None:
        if not specs:
            raise ValueError("no ranks to run")
        ranks = [s.rank for s in specs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"duplicate ranks in {ranks}")
        if min(ranks) < 0:
            raise ValueError(f"ranks must be >= 0, got {ranks}")
        if start_method == "fork":
            if target is None:
                raise ValueError("start_method='fork' needs a target")
            if not hasattr(os, "fork"):
                raise ValueError("start_method='fork' is not available on this platform")
        elif start_method == "spawn":
            if target is not None:
                raise ValueError("start_method='spawn' runs RankSpec.argv; target must be None")
            missing = [s.rank for s in specs if not s.argv]
            if missing:
                raise ValueError(f"start_method='spawn' needs argv for ranks {missing}")
        else:
            raise ValueError(f"unknown start_method {start_method!r}")
        if teardown_timeout_s < 0:
            raise ValueError("teardown_timeout_s must be >= 0")

        self._start_method = start_method
        self._target = target
        self._log_dir = Path(log_dir)
        self._teardown_timeout_s = float(teardown_timeout_s)
        size = max(ranks) + 1
        redirect_map = to_map(redirects, size)
        tee_map = to_map(tee, size)
        self._tee_map = {r: Std(tee_map[r]) for r in ranks}
        self._ranks: dict[int, _Rank] = {
            s.rank: _Rank(s, self._log_dir / str(s.rank), Std(redirect_map[s.rank] | tee_map[s.rank]))
            for s in specs
        }
        self._started = False
        self._closed = False
        self._tearing_down = False
        self._result: RunResult | None = None
        self._tee: Tee | None = None

    # ------------------------------------------------------------------ properties

    @property
    def pids(self) -> dict[int, int]:
        """OS pid of every started rank."""
        return {r: st.pid for r, st in self._ranks.items() if st.pid is not None}

    def heartbeats(self, limit_s: float) -> Heartbeats:
        """The ranks' heartbeat files (beside their ``error.json``), judged against ``limit_s``."""
        return Heartbeats({r: heartbeat_path(st.error_path) for r, st in self._ranks.items()}, limit_s)

    @property
    def log_dir(self) -> Path:
        """Root of the per-rank log directories."""
        return self._log_dir

    def rank_dir(self, rank: int) -> Path:
        """``<log_dir>/<rank>``: where the rank's ``stdout.log``, ``stderr.log`` and ``error.json`` live."""
        return self._ranks[rank].dir

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Create the log directories and start every rank; tee threads start after all forks."""
        if self._started:
            raise RuntimeError("RankProcesses.start() called twice")
        if self._closed:
            raise RuntimeError("RankProcesses is closed")
        self._started = True
        for st in self._ranks.values():
            st.dir.mkdir(parents=True, exist_ok=True)
            for stale in (st.error_path, st.stdout_path, st.stderr_path, heartbeat_path(st.error_path)):
                if stale is not None:
                    stale.unlink(missing_ok=True)
        prctl = load_prctl()
        if prctl is None:
            logger.warning("prctl unavailable: ranks will not be killed automatically if the launcher dies")
        parent_pid = os.getpid()
        try:
            for st in self._ranks.values():
                self._start_rank(st, prctl, parent_pid)
        except BaseException:
            self.close(reason="start failed")
            raise
        self._start_tee()

    def _start_rank(self, st: _Rank, prctl: Callable[..., int] | None, parent_pid: int) -> None:
        files = {"error_path": st.error_path, "stdout_path": st.stdout_path, "stderr_path": st.stderr_path}
        if self._start_method == "fork":
            st.pid = fork_rank(st.spec, self._target, **files, prctl=prctl, parent_pid=parent_pid)
            logger.debug("forked rank %d as pid %d", st.spec.rank, st.pid)
        else:
            st.popen = spawn_rank(st.spec, **files, prctl=prctl, parent_pid=parent_pid)
            st.pid = st.popen.pid
            logger.debug("spawned rank %d as pid %d: %s", st.spec.rank, st.pid, st.spec.argv)

    def _start_tee(self) -> None:
        self._tee = start_tee(
            (rank, self._tee_map[rank], st.stdout_path, st.stderr_path) for rank, st in self._ranks.items()
        )

    # ------------------------------------------------------------------ watching

    def _peek(self, st: _Rank) -> int | None:
        """Exit code of an exited (not yet reaped) rank, without reaping it; None while running."""
        if st.exitcode is not None or st.pid is None:
            return st.exitcode
        try:
            res = os.waitid(os.P_PID, st.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            code, st.lost, st.reaped = _EXIT_STATUS_LOST, True, True
        except InterruptedError:
            return None
        else:
            if res is None or res.si_pid == 0:
                return None
            code = res.si_status if res.si_code == os.CLD_EXITED else -res.si_status
        st.exitcode = code
        st.natural = not self._tearing_down
        st.exit_time = time.time()
        return code

    def _refresh(self) -> None:
        for st in self._ranks.values():
            self._peek(st)

    def _reap(self, st: _Rank) -> bool:
        """Reap an exited rank; True once reaped (or no longer ours)."""
        if st.reaped or st.pid is None:
            return True
        try:
            pid, status = os.waitpid(st.pid, os.WNOHANG)
        except ChildProcessError:
            st.reaped = True
            if st.exitcode is None:
                st.exitcode, st.lost = _EXIT_STATUS_LOST, True
        except InterruptedError:
            return False
        else:
            if pid == 0:
                return False
            st.reaped = True
            st.exitcode = os.waitstatus_to_exitcode(status)
        if st.popen is not None and st.popen.returncode is None:
            st.popen.returncode = st.exitcode
        return True

    def poll(self) -> RunResult | None:
        """Non-blocking check: ``None`` while ranks run and none failed, else the final result.

        On the first failure every other rank is torn down before returning. Once
        the run is over (or after :meth:`close`), the same result is returned again.
        """
        if self._result is not None:
            return self._result
        if not self._started:
            raise RuntimeError("RankProcesses.poll() before start()")
        if self._closed:
            self._result = self._build_result()
            return self._result
        self._refresh()
        failed = sorted(r for r, st in self._ranks.items() if st.exitcode not in (None, 0))
        if failed:
            self.close(reason=f"rank(s) {failed} failed")
        elif all(st.exitcode is not None for st in self._ranks.values()):
            self.close(reason="all ranks exited")
        else:
            return None
        self._result = self._build_result()
        return self._result

    def wait(
        self,
        timeout_s: float | None = None,
        *,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.05,
        heartbeats: Heartbeats | None = None,
    ) -> RunResult:
        """Poll until the run is over, calling ``on_tick`` between polls.

        Raises :class:`RanksTimeoutError` (ranks are left running; call :meth:`close`)
        if the run is not over within ``timeout_s`` seconds, and
        :class:`~prism_launch.launch.heartbeat.RanksStoppedError` where a running rank's
        heartbeat stopped (``heartbeats``).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if now >= next_poll:  # with a busy on_tick (the capture's pump), exits are checked every POLL_S
                result = self.poll()
                if result is not None:
                    return result
                next_poll = now + POLL_S
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                running = [r for r, st in self._ranks.items() if st.exitcode is None]
                raise RanksTimeoutError(running, timeout_s or 0.0)
            if heartbeats is not None:
                stopped = heartbeats.stopped({r: st.pid for r, st in self._ranks.items() if st.exitcode is None})
                if stopped:
                    raise stopped_error(stopped, heartbeats.limit_s)
            if on_tick is not None:
                on_tick()
                now = time.monotonic()
            pause = tick_s if deadline is None else min(tick_s, max(0.0, deadline - now))
            if pause > 0:
                time.sleep(pause)

    # ------------------------------------------------------------------ teardown

    def _signal_group(self, st: _Rank, sig: signal.Signals) -> None:
        if st.pid is None or st.reaped:
            return
        try:
            os.killpg(st.pid, sig)  # each rank leads its own process group
            return
        except OSError:
            pass
        try:  # a forked rank may not have called setsid() yet
            os.kill(st.pid, sig)
        except OSError:
            pass

    def close(self, reason: str = "") -> None:
        """Stop every rank (SIGTERM, SIGKILL after ``teardown_timeout_s``), reap them, stop the tee.

        Idempotent; if interrupted (e.g. by an exception from a signal handler), calling it
        again resumes the teardown. Also run on context-manager exit.
        """
        if self._closed:
            return
        started = [st for st in self._ranks.values() if st.pid is not None]
        if started:
            if not self._tearing_down:
                self._refresh()  # exits observed before teardown count as the ranks' own
                self._tearing_down = True
            live = [st.spec.rank for st in started if st.exitcode is None]
            logger.info("stopping ranks %s%s", live, f" ({reason})" if reason else "")
            for st in started:
                self._signal_group(st, signal.SIGTERM)
            deadline = time.monotonic() + self._teardown_timeout_s
            while time.monotonic() < deadline:
                self._refresh()
                if all(st.exitcode is not None for st in started):
                    break
                time.sleep(0.01)
            stubborn = [st.spec.rank for st in started if st.exitcode is None]
            if stubborn:
                logger.warning(
                    "ranks %s ignored SIGTERM for %.1fs; sending SIGKILL", stubborn, self._teardown_timeout_s
                )
            for st in started:  # also catches stragglers in already-exited ranks' groups
                self._signal_group(st, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_REAP_TIMEOUT_S
            while True:
                self._refresh()
                pending = [st for st in started if not (st.exitcode is not None and self._reap(st))]
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            for st in pending:
                logger.error("rank %d (pid %s) could not be reaped after SIGKILL", st.spec.rank, st.pid)
                if st.exitcode is None:
                    st.exitcode = -int(signal.SIGKILL)
        if self._tee is not None:
            self._tee.stop()
            self._tee = None
        self._closed = True

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(reason="context exit" if exc is None else f"{type(exc).__name__}")

    # ------------------------------------------------------------------ results

    def _build_result(self) -> RunResult:
        exitcodes = {r: st.exitcode for r, st in self._ranks.items() if st.exitcode is not None}
        failures = {
            r: self._failure(st)
            for r, st in self._ranks.items()
            if st.natural and st.exitcode is not None and st.exitcode != 0
        }
        return RunResult(exitcodes=exitcodes, failures=failures)

    def _failure(self, st: _Rank) -> RankFailure:
        assert st.exitcode is not None
        return rank_failure(
            rank=st.spec.rank,
            exitcode=st.exitcode,
            pid=st.pid,
            error_path=st.error_path,
            stderr_path=st.stderr_path,
            exit_time=st.exit_time,
            lost=st.lost,
        )
