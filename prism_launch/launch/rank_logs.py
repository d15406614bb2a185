"""Rank log files: torchrun's ``redirects`` / ``tee`` layout, written by the ranks and streamed to the console.

Per-rank log layout ``<log_dir>/<rank>/{stdout.log,stderr.log}`` (beside the rank's
``error.json``, see :mod:`prism_launch.launch.failures`). ``redirects`` / ``tee``
take torch's ``Std`` flags (a single value for all ranks or a ``{rank: Std}``
mapping). A redirected stream goes to its log file only; a teed stream goes to its
log file *and* to the launcher's console, each line prefixed with
``[default<rank>]:``; a stream that is neither is inherited from the launcher. Tee
implies redirect, as in torchrun.

This module opens a rank's log files for its process to write (:func:`open_logs`)
and runs the one tee thread that copies teed files to the console (:func:`start_tee`).

A Python warning (``file:line: SomeWarning: message`` and the source line Python prints under
it) that the console already showed, from any rank of this launcher, is not shown again: a
third-party library warns once in every rank, and a thousand copies would bury the run's own
output (:class:`RepeatedWarnings`). The log files keep every copy; when the tee stops it says
how many it hid and where the logs are.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from torch.distributed.elastic.multiprocessing.api import Std

__all__ = ["LOG_LINE_PREFIX_NAME", "RUN_WARNINGS", "RepeatedWarnings", "Tee", "open_logs", "start_tee"]

# Records go to the rank-process manager's logger, beside its own.
logger = logging.getLogger("prism_launch.launch.procs")

LOG_LINE_PREFIX_NAME = "default"
"""Role name used in console prefixes, ``[default<rank>]:`` like torchrun."""

_TEE_INTERVAL_S = 0.02  # tee polling period
_TEE_JOIN_TIMEOUT_S = 5.0  # bound on the final tee drain
_TEE_PARTIAL_FLUSH_S = 0.5  # a partial line older than this is printed anyway
_TEE_MAX_LINE = 64 * 1024  # a partial line longer than this is printed anyway
_TEE_READ_CHUNK = 1 << 20
_TEE_MAX_READ_PER_PASS = 8 << 20


_WARNING_LINE = re.compile(r"^\S.*:\d+: (?:[A-Za-z_][\w.]*)?Warning: ")
"""The first line of a Python warning as ``warnings.showwarning`` prints it."""


class RepeatedWarnings:
    """The Python warnings the console has shown, shared by every tee of one launcher (one run):
    a warning line shown once is dropped from then on, with the indented source line under it."""

    def __init__(self) -> None:
        self._shown: set[str] = set()
        self._lock = threading.Lock()

    def keep(self, line: str) -> bool:
        """Whether a warning's first line is new (and now marks it shown)."""
        key = line.rstrip("\r\n")
        with self._lock:
            if key in self._shown:
                return False
            self._shown.add(key)
            return True


RUN_WARNINGS = RepeatedWarnings()
"""The launcher's own: a warning shown during group discovery is not shown again in capture or emulation."""


def open_logs(stdout_path: Path | None, stderr_path: Path | None) -> tuple[int | None, int | None]:
    """Create (truncate) a rank's log files; close-on-exec fds >= 3, ``None`` for a stream not redirected."""
    fds: list[int | None] = []
    try:
        for path in (stdout_path, stderr_path):
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


def start_tee(ranks: Iterable[tuple[int, Std, Path | None, Path | None]],
              warnings: RepeatedWarnings | None = None) -> Tee | None:
    """Start copying the teed streams of ``(rank, tee, stdout_path, stderr_path)`` to the console.

    Returns the running :class:`Tee` (stop it with :meth:`Tee.stop`), or ``None`` when
    no stream is teed. ``warnings``: the warnings already shown (default: the launcher's).
    """
    sources: list[_TeeSource] = []
    for rank, tee, stdout_path, stderr_path in ranks:
        prefix = f"[{LOG_LINE_PREFIX_NAME}{rank}]:"
        if tee & Std.OUT and stdout_path is not None:
            sources.append(_TeeSource(stdout_path, prefix, sys.stdout, rank))
        if tee & Std.ERR and stderr_path is not None:
            sources.append(_TeeSource(stderr_path, prefix, sys.stderr, rank))
    if not sources:
        return None
    tee_thread = Tee(sources, RUN_WARNINGS if warnings is None else warnings)
    tee_thread.start()
    return tee_thread


class _TeeSource:
    __slots__ = ("path", "prefix", "dst", "fh", "buf", "last_data", "rank", "hiding")

    def __init__(self, path: Path, prefix: str, dst: TextIO, rank: int = -1) -> None:
        self.path = path
        self.prefix = prefix
        self.dst = dst
        self.rank = rank
        self.fh: io.FileIO | None = None
        self.buf = bytearray()
        self.last_data = time.monotonic()
        self.hiding = False
        """The last line was a hidden warning: an indented line next is its source line."""


class Tee:
    """One thread that follows teed log files and copies their lines, prefixed, to the console.

    A single writer thread means lines of different ranks never interleave mid-line.
    Ranks write straight into their log files, so a slow console never blocks them.
    """

    def __init__(self, sources: list[_TeeSource], warnings: RepeatedWarnings | None = None) -> None:
        self._sources = sources
        self._warnings = warnings if warnings is not None else RepeatedWarnings()
        self.hidden = 0
        """Warnings this tee did not show because the console had shown them already."""
        self.hidden_ranks: set[int] = set()
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
        note = self.hidden_note()
        if note:
            try:
                sys.stderr.write(note + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def hidden_note(self) -> str:
        """One line on the warnings hidden, with where the rank logs keep them ('' if none)."""
        if not self.hidden:
            return ""
        where = {s.path.parent.parent for s in self._sources}
        logs = f"{where.pop()}/<rank>/stderr.log" if len(where) == 1 else "the rank logs"
        n, m = self.hidden, len(self.hidden_ranks)
        return (f"prism-launch: {n} repeated warning{'s' if n != 1 else ''} from {m} rank{'s' if m != 1 else ''} "
                f"hidden (each shown once); see {logs}")

    def _unrepeated(self, src: _TeeSource, lines: list[str]) -> list[str]:
        """``lines`` without the warnings the console has shown already (and their source lines)."""
        out = []
        for line in lines:
            if src.hiding and line[:1] in (" ", "\t"):
                src.hiding = False
                continue
            src.hiding = False
            if _WARNING_LINE.match(line) and not self._warnings.keep(line):
                src.hiding = True
                self.hidden += 1
                self.hidden_ranks.add(src.rank)
                continue
            out.append(line)
        return out

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
        shown = self._unrepeated(src, [line.decode("utf-8", errors="replace") for line in lines])
        if not shown:
            return
        text = "".join(src.prefix + line for line in shown)
        try:
            src.dst.write(text)
            src.dst.flush()
        except (OSError, ValueError):
            self._broken.add(id(src.dst))
            logger.warning("console stream closed; rank output continues in the log files only")
