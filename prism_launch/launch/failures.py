"""Run outcomes: what a run's ranks exited with and why the failed ones failed.

Owns the result types (:class:`RunResult`, :class:`RankFailure`) and how a failed
rank is described, following torchelastic's conventions:

* Every rank gets ``TORCHELASTIC_ERROR_FILE=<log_dir>/<rank>/error.json``
  (:data:`ERROR_FILE_ENV`). Forked ranks record uncaught exceptions there with
  torch's ``ErrorHandler``; spawned programs do so themselves (e.g. via ``@record``).
* A failure is reported from that file when present (its message, ``py_callstack``
  and mtime), otherwise from the exit status (``-signum`` is named, e.g.
  ``killed by SIGSEGV``) and the tail of the rank's ``stderr.log``.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ERROR_FILE_ENV", "RankFailure", "RunResult", "rank_failure"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Environment variable naming a rank's error file (torchelastic's convention)."""

_STDERR_TAIL_BYTES = 8192
_STDERR_TAIL_LINES = 40


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
        """The likely root cause, if any: a rank killed by a signal, else the failure with the
        smallest timestamp. A killed rank writes no error file, so its time is only when its
        exit was seen — after its peers' errors about the connection it dropped."""
        if not self.failures:
            return None
        return min(self.failures.values(), key=lambda f: (f.signal is None, f.timestamp, f.rank))


def rank_failure(
    *,
    rank: int,
    exitcode: int,
    pid: int | None,
    error_path: Path,
    stderr_path: Path | None,
    exit_time: float,
    lost: bool,
) -> RankFailure:
    """Describe a rank that exited with ``exitcode``: from its error file, else its exit and stderr tail.

    ``exit_time`` is when the exit was observed; ``lost`` says the exit status was
    unavailable because someone else reaped the process.
    """
    parsed = _parse_error_file(error_path)
    if parsed is not None:
        message, tb, timestamp = parsed
        error_file: Path | None = error_path
    else:
        error_file, timestamp = None, exit_time
        message = _describe_exit(exitcode)
        if lost:
            message += " (exit status unavailable: the process was reaped elsewhere)"
        tb = _read_tail(stderr_path) if stderr_path is not None else None
        if tb:
            message += f": {tb.splitlines()[-1].strip()}"
    return RankFailure(
        rank=rank,
        exitcode=exitcode,
        signal=_signal_name(exitcode),
        error_file=error_file,
        message=message,
        traceback=tb,
        timestamp=timestamp,
        pid=pid,
    )


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
