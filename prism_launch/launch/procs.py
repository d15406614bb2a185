"""Rank-process manager: start, watch, log and tear down the rank processes of one launch.

This is PrismLLM's counterpart of torch.distributed.elastic's process contexts
(``MultiprocessContext`` / ``SubprocessContext``) and follows their conventions:

* Per-rank log layout ``<log_dir>/<rank>/{stdout.log,stderr.log,error.json}``.
* ``redirects`` / ``tee`` take torch's :class:`Std` flags (a single value for all
  ranks or a ``{rank: Std}`` mapping). A redirected stream goes to its log file
  only; a teed stream goes to its log file *and* to the launcher's console, each
  line prefixed with ``[default<rank>]:``; a stream that is neither is inherited
  from the launcher. Tee implies redirect, as in torchrun.
* Every rank gets ``TORCHELASTIC_ERROR_FILE=<log_dir>/<rank>/error.json``. Forked
  ranks record uncaught exceptions there with torch's ``ErrorHandler``; spawned
  programs do so themselves (e.g. via ``@record``). Failures are reported from
  that file when present, otherwise from the tail of the rank's ``stderr.log``.

Process hygiene:

* Each rank runs in its own session / process group, so teardown signals the
  whole group (grandchildren such as data-loader workers included).
* Each rank arms ``PR_SET_PDEATHSIG=SIGKILL`` (and re-checks its parent right
  after), so ranks die with the launcher even if it is ``SIGKILL``-ed.
* Teardown is ``SIGTERM`` to every group, ``SIGKILL`` after
  ``teardown_timeout_s``, then reaping. Every wait is bounded.

Exits are detected with ``waitid(..., WNOWAIT)``: exited ranks stay zombies (so
their pid / process-group id cannot be recycled while we may still signal the
group) and are reaped by :meth:`RankProcesses.close`, which :meth:`poll` calls
itself once the run is over.

Signal handling belongs to the caller. :meth:`RankProcesses.close` holds no locks
and is idempotent and resumable, so it is safe to call after an exception raised
by a signal handler interrupted :meth:`~RankProcesses.wait` (or ``close`` itself).
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, NoReturn, TextIO

from torch.distributed.elastic.multiprocessing.api import Std, to_map
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

__all__ = [
    "RankFailure",
    "RankProcesses",
    "RankSpec",
    "RanksTimeoutError",
    "RunResult",
    "Std",
]

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Environment variable naming a rank's error file (torchelastic's convention)."""

LOG_LINE_PREFIX_NAME = "default"
"""Role name used in console prefixes, ``[default<rank>]:`` like torchrun."""

_PR_SET_PDEATHSIG = 1
_KILL_REAP_TIMEOUT_S = 5.0  # how long to wait for SIGKILLed ranks to be reapable
_TEE_INTERVAL_S = 0.02  # tee polling period
_TEE_JOIN_TIMEOUT_S = 5.0  # bound on the final tee drain
_TEE_PARTIAL_FLUSH_S = 0.5  # a partial line older than this is printed anyway
_TEE_MAX_LINE = 64 * 1024  # a partial line longer than this is printed anyway
_TEE_READ_CHUNK = 1 << 20
_TEE_MAX_READ_PER_PASS = 8 << 20
_STDERR_TAIL_BYTES = 8192
_STDERR_TAIL_LINES = 40
_FORK_BLOCKED_SIGNALS = {
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
}
_EXIT_STATUS_LOST = 255  # reported when someone else reaped a rank (e.g. SIGCHLD=SIG_IGN)


# --------------------------------------------------------------------------- API types


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSpec:
    """What to run as one rank."""

    rank: int
    """Logical rank; used in log directory names, console prefixes and result keys."""

    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for this rank, on top of the launcher's ``os.environ``."""

    argv: list[str] | None = None
    """``spawn``: the command to exec. ``fork``: optional data for the target (e.g. a script's argv)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFailure:
    """Why one rank failed."""

    rank: int
    """Logical rank of the failed process."""

    exitcode: int
    """Exit code; negative ``-signum`` when the process was killed by a signal."""

    signal: str | None
    """Name of the killing signal (e.g. ``"SIGSEGV"``), ``None`` for a normal exit."""

    error_file: Path | None
    """The rank's ``error.json`` if the rank wrote one, else ``None``."""

    message: str
    """One-line summary: the error file's message, else the exit description (plus the last stderr line)."""

    traceback: str | None
    """The error file's ``py_callstack``, else the tail of ``stderr.log`` when stderr was redirected."""

    timestamp: float
    """Seconds since the epoch: when the error file was written, else when the exit was observed."""

    pid: int | None = None
    """OS pid the rank ran as."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """Outcome of a run: every rank's exit code and the ranks that failed on their own."""

    exitcodes: dict[int, int]
    """Exit code per rank (``-signum`` if killed by a signal), including ranks torn down by the manager."""

    failures: dict[int, RankFailure]
    """Ranks that exited non-zero (or died of a signal) *before* teardown began."""

    @property
    def ok(self) -> bool:
        """True when no rank failed and every rank exited 0."""
        return not self.failures and all(code == 0 for code in self.exitcodes.values())

    @property
    def first_failure(self) -> RankFailure | None:
        """The failure with the smallest timestamp (the likely root cause), if any."""
        if not self.failures:
            return None
        return min(self.failures.values(), key=lambda f: (f.timestamp, f.rank))


class RanksTimeoutError(TimeoutError):
    """Raised by :meth:`RankProcesses.wait` when ranks are still running at the deadline."""

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        self.ranks = sorted(ranks)
        self.timeout_s = timeout_s
        super().__init__(f"ranks {self.ranks} still running after {timeout_s:g}s")


# --------------------------------------------------------------------------- helpers


def _load_prctl() -> Callable[..., int] | None:
    """Resolve libc's ``prctl`` (in the parent, so children need no dlopen)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def _arm_parent_death_signal(prctl: Callable[..., int] | None, parent_pid: int) -> None:
    """In a fresh child: die with SIGKILL when the parent dies, and now if it already has."""
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _describe_exit(exitcode: int) -> str:
    name = _signal_name(exitcode)
    if name is not None:
        return f"killed by {name}"
    return f"exited with code {exitcode}"


def _exit_code_from(value: object) -> int:
    """Map a target's return value / SystemExit code to a process exit status."""
    if value is None:
        return 0
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        code = value & 0xFF
        return code if code or value == 0 else 1
    return 1


def _read_tail(path: Path, max_bytes: int = _STDERR_TAIL_BYTES, max_lines: int = _STDERR_TAIL_LINES) -> str | None:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read(max_bytes)
    except OSError:
        return None
    if not data.strip():
        return None
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and len(lines) > 1:
        lines = lines[1:]  # first line is probably cut
    return "\n".join(lines[-max_lines:])


def _parse_error_file(path: Path) -> tuple[str, str | None, float] | None:
    """Parse an ``ErrorHandler`` error file into (message, traceback, timestamp)."""
    try:
        st = path.stat()
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    timestamp = st.st_mtime
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        tb = extra.get("py_callstack") if isinstance(extra, dict) else None
        text = str(msg.get("message", "")) or "<no message>"
        return text, (str(tb) if tb else None), timestamp
    if isinstance(msg, str):
        return msg, None, timestamp
    return None


def _make_console_writable(stream: int) -> TextIO:
    """A fresh text stream on fd 1/2 for a forked child (whatever ``sys.stdout`` was before)."""
    raw = io.FileIO(stream, "w", closefd=False)
    if stream == 1:
        return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)


def _reset_child_signals() -> None:
    """Undo the launcher's Python-level signal setup in a forked child."""
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            try:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
    except (ValueError, OSError):
        pass


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - best effort
            pass


# --------------------------------------------------------------------------- tee


class _TeeSource:
    __slots__ = ("path", "prefix", "dst", "fh", "buf", "last_data")

    def __init__(self, path: Path, prefix: str, dst: TextIO) -> None:
        self.path = path
        self.prefix = prefix
        self.dst = dst
        self.fh: io.FileIO | None = None
        self.buf = bytearray()
        self.last_data = time.monotonic()


class _Tee:
    """One thread that follows teed log files and copies their lines, prefixed, to the console.

    A single writer thread means lines of different ranks never interleave mid-line.
    Ranks write straight into their log files, so a slow console never blocks them.
    """

    def __init__(self, sources: list[_TeeSource]) -> None:
        self._sources = sources
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prism-rank-tee", daemon=True)
        self._broken: set[int] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = _TEE_JOIN_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("rank log tee did not finish within %.1fs", timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.wait(_TEE_INTERVAL_S):
                self._pump(final=False)
            self._pump(final=True)
        except Exception:  # noqa: BLE001 - never let the tee kill the launcher
            logger.exception("rank log tee failed")
        finally:
            for src in self._sources:
                if src.fh is not None:
                    src.fh.close()
                    src.fh = None

    def _pump(self, *, final: bool) -> None:
        now = time.monotonic()
        for src in self._sources:
            if src.fh is None:
                try:
                    src.fh = open(src.path, "rb", buffering=0)  # noqa: SIM115
                except OSError:
                    continue
            budget = _TEE_MAX_READ_PER_PASS * (8 if final else 1)
            while budget > 0:
                chunk = src.fh.read(_TEE_READ_CHUNK)
                if not chunk:
                    break
                budget -= len(chunk)
                src.buf += chunk
                src.last_data = now
            if not src.buf:
                continue
            cut = src.buf.rfind(b"\n") + 1
            lines = bytes(src.buf[:cut]).splitlines(keepends=True) if cut else []
            del src.buf[:cut]
            if src.buf and (final or len(src.buf) > _TEE_MAX_LINE or now - src.last_data > _TEE_PARTIAL_FLUSH_S):
                lines.append(bytes(src.buf) + b"\n")
                src.buf.clear()
            if lines:
                self._emit(src, lines)

    def _emit(self, src: _TeeSource, lines: list[bytes]) -> None:
        if id(src.dst) in self._broken:
            return
        text = "".join(src.prefix + line.decode("utf-8", errors="replace") for line in lines)
        try:
            src.dst.write(text)
            src.dst.flush()
        except (OSError, ValueError):
            self._broken.add(id(src.dst))
            logger.warning("console stream closed; rank output continues in the log files only")


# --------------------------------------------------------------------------- manager


class _Rank:
    """Internal per-rank bookkeeping."""

    __slots__ = (
        "spec", "dir", "stdout_path", "stderr_path", "error_path", "pid", "popen",
        "exitcode", "natural", "exit_time", "reaped", "lost",
    )

    def __init__(self, spec: RankSpec, rank_dir: Path, redirect: Std) -> None:
        self.spec = spec
        self.dir = rank_dir
        self.stdout_path = rank_dir / "stdout.log" if redirect & Std.OUT else None
        self.stderr_path = rank_dir / "stderr.log" if redirect & Std.ERR else None
        self.error_path = rank_dir / "error.json"
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
        self._tee: _Tee | None = None

    # ------------------------------------------------------------------ properties

    @property
    def pids(self) -> dict[int, int]:
        """OS pid of every started rank."""
        return {r: st.pid for r, st in self._ranks.items() if st.pid is not None}

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
            for stale in (st.error_path, st.stdout_path, st.stderr_path):
                if stale is not None:
                    stale.unlink(missing_ok=True)
        prctl = _load_prctl()
        if prctl is None:
            logger.warning("prctl unavailable: ranks will not be killed automatically if the launcher dies")
        parent_pid = os.getpid()
        try:
            for st in self._ranks.values():
                if self._start_method == "fork":
                    self._start_forked(st, prctl, parent_pid)
                else:
                    self._start_spawned(st, prctl, parent_pid)
        except BaseException:
            self.close(reason="start failed")
            raise
        self._start_tee()

    def _open_logs(self, st: _Rank) -> tuple[int | None, int | None]:
        fds: list[int | None] = []
        try:
            for path in (st.stdout_path, st.stderr_path):
                if path is None:
                    fds.append(None)
                    continue
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
                if fd < 3:  # keep clear of fds 0-2, which a forked child dup2()s over
                    fds.append(fd)
                    fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
                    os.close(fds.pop())
                fds.append(fd)
        except BaseException:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
            raise
        return fds[0], fds[1]

    def _start_spawned(self, st: _Rank, prctl: Callable[..., int] | None, parent_pid: int) -> None:
        env = dict(os.environ)
        env.update(st.spec.env)
        env[ERROR_FILE_ENV] = str(st.error_path)
        out_fd, err_fd = self._open_logs(st)
        try:
            st.popen = subprocess.Popen(  # noqa: S603 - argv comes from the launcher
                list(st.spec.argv or ()),
                env=env,
                stdout=out_fd,
                stderr=err_fd,
                start_new_session=True,
                preexec_fn=lambda: _arm_parent_death_signal(prctl, parent_pid),  # noqa: PLW1509
            )
        finally:
            for fd in (out_fd, err_fd):
                if fd is not None:
                    os.close(fd)
        st.pid = st.popen.pid
        logger.debug("spawned rank %d as pid %d: %s", st.spec.rank, st.pid, st.spec.argv)

    def _start_forked(self, st: _Rank, prctl: Callable[..., int] | None, parent_pid: int) -> None:
        out_fd, err_fd = self._open_logs(st)
        _flush_std()
        # Hold asynchronous signals until the child has dropped the launcher's handlers.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_BLOCKED_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:  # child: never returns
                self._run_forked_child(st, prctl, parent_pid, out_fd, err_fd)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for fd in (out_fd, err_fd):
                if fd is not None:
                    os.close(fd)
        st.pid = pid
        logger.debug("forked rank %d as pid %d", st.spec.rank, pid)

    def _run_forked_child(
        self,
        st: _Rank,
        prctl: Callable[..., int] | None,
        parent_pid: int,
        out_fd: int | None,
        err_fd: int | None,
    ) -> NoReturn:
        code = 1
        try:
            try:
                _arm_parent_death_signal(prctl, parent_pid)
                os.setsid()
                _reset_child_signals()  # also unblocks the signals held over fork()
                for fd, target_fd in ((out_fd, 1), (err_fd, 2)):
                    if fd is not None:
                        os.dup2(fd, target_fd)  # dup2'd fds are inheritable
                        os.close(fd)
                sys.stdout = _make_console_writable(1)
                sys.stderr = _make_console_writable(2)
                os.environ.update(st.spec.env)
                os.environ[ERROR_FILE_ENV] = str(st.error_path)
                handler = ErrorHandler()
                handler.initialize()
                assert self._target is not None
                try:
                    code = _exit_code_from(self._target(st.spec))
                except SystemExit as e:
                    if e.code is not None and not isinstance(e.code, int):
                        print(e.code, file=sys.stderr)
                    code = _exit_code_from(e.code)
                except BaseException as e:
                    try:
                        handler.record_exception(e)
                    except Exception:  # noqa: BLE001
                        pass
                    traceback.print_exc()
                    code = 130 if isinstance(e, KeyboardInterrupt) else 1
            except BaseException:
                try:
                    traceback.print_exc()
                except BaseException:  # noqa: BLE001
                    pass
                code = 1
            finally:
                _flush_std()
        finally:
            os._exit(code)

    def _start_tee(self) -> None:
        sources: list[_TeeSource] = []
        for rank, st in self._ranks.items():
            prefix = f"[{LOG_LINE_PREFIX_NAME}{rank}]:"
            t = self._tee_map[rank]
            if t & Std.OUT and st.stdout_path is not None:
                sources.append(_TeeSource(st.stdout_path, prefix, sys.stdout))
            if t & Std.ERR and st.stderr_path is not None:
                sources.append(_TeeSource(st.stderr_path, prefix, sys.stderr))
        if sources:
            self._tee = _Tee(sources)
            self._tee.start()

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
    ) -> RunResult:
        """Poll until the run is over, calling ``on_tick`` between polls.

        Raises :class:`RanksTimeoutError` (ranks are left running; call :meth:`close`)
        if the run is not over within ``timeout_s`` seconds.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            result = self.poll()
            if result is not None:
                return result
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                running = [r for r, st in self._ranks.items() if st.exitcode is None]
                raise RanksTimeoutError(running, timeout_s or 0.0)
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
        code = st.exitcode
        parsed = _parse_error_file(st.error_path)
        if parsed is not None:
            message, tb, timestamp = parsed
            error_file: Path | None = st.error_path
        else:
            error_file, timestamp = None, st.exit_time
            message = _describe_exit(code)
            if st.lost:
                message += " (exit status unavailable: the process was reaped elsewhere)"
            tb = _read_tail(st.stderr_path) if st.stderr_path is not None else None
            if tb:
                message += f": {tb.splitlines()[-1].strip()}"
        return RankFailure(
            rank=st.spec.rank,
            exitcode=code,
            signal=_signal_name(code),
            error_file=error_file,
            message=message,
            traceback=tb,
            timestamp=timestamp,
            pid=st.pid,
        )
