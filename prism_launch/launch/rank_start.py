"""Starting one rank process: spawn its command, or fork it from the warmed launcher and run its target.

Either way the new process

* leads its own session / process group, so teardown can signal the whole group
  (grandchildren such as data-loader workers included);
* arms ``PR_SET_PDEATHSIG=SIGKILL`` (and re-checks its parent right after), so it
  dies with the launcher even if the launcher is ``SIGKILL``-ed;
* has its redirected streams on its log files (:func:`~prism_launch.launch.rank_logs.open_logs`)
  and ``TORCHELASTIC_ERROR_FILE`` set to its ``error.json``.

A forked rank also drops the launcher's Python-level signal setup, gets fresh
``sys.stdout`` / ``sys.stderr`` on fds 1/2, records an uncaught exception with
torch's ``ErrorHandler`` and leaves through ``os._exit`` with its target's exit
code. Asynchronous signals are blocked across ``fork()`` until the child has
dropped the launcher's handlers.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TextIO

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from prism_launch.launch.failures import ERROR_FILE_ENV
from prism_launch.launch.rank_logs import open_logs

__all__ = ["RankSpec", "fork_rank", "load_prctl", "spawn_rank"]

_PR_SET_PDEATHSIG = 1
_FORK_BLOCKED_SIGNALS = {
    signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSpec:
    """What to run as one rank."""

    rank: int
    """Logical rank; used in log directory names, console prefixes and result keys."""

    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for this rank, on top of the launcher's ``os.environ``."""

    argv: list[str] | None = None
    """``spawn``: the command to exec. ``fork``: optional data for the target (e.g. a script's argv)."""


def load_prctl() -> Callable[..., int] | None:
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


def spawn_rank(
    spec: RankSpec,
    *,
    error_path: Path,
    stdout_path: Path | None,
    stderr_path: Path | None,
    prctl: Callable[..., int] | None,
    parent_pid: int,
) -> subprocess.Popen[bytes]:
    """Exec ``spec.argv`` as a new rank process, its redirected streams on the given log files."""
    env = dict(os.environ)
    env.update(spec.env)
    env[ERROR_FILE_ENV] = str(error_path)
    out_fd, err_fd = open_logs(stdout_path, stderr_path)
    try:
        return subprocess.Popen(  # noqa: S603 - argv comes from the launcher
            list(spec.argv or ()),
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


def fork_rank(
    spec: RankSpec,
    target: Callable[[RankSpec], int] | None,
    *,
    error_path: Path,
    stdout_path: Path | None,
    stderr_path: Path | None,
    prctl: Callable[..., int] | None,
    parent_pid: int,
) -> int:
    """Fork a rank process that runs ``target(spec)`` and exits with its code; returns the child's pid."""
    out_fd, err_fd = open_logs(stdout_path, stderr_path)
    _flush_std()
    # Hold asynchronous signals until the child has dropped the launcher's handlers.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_BLOCKED_SIGNALS)
    try:
        pid = os.fork()
        if pid == 0:  # child: never returns
            _run_forked_child(spec, target, error_path, prctl, parent_pid, out_fd, err_fd)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for fd in (out_fd, err_fd):
            if fd is not None:
                os.close(fd)
    return pid


def _run_forked_child(
    spec: RankSpec,
    target: Callable[[RankSpec], int] | None,
    error_path: Path,
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
            os.environ.update(spec.env)
            os.environ[ERROR_FILE_ENV] = str(error_path)
            handler = ErrorHandler()
            handler.initialize()
            assert target is not None
            try:
                code = _exit_code_from(target(spec))
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


def _arm_parent_death_signal(prctl: Callable[..., int] | None, parent_pid: int) -> None:
    """In a fresh child: die with SIGKILL when the parent dies, and now if it already has."""
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


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
