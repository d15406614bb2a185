"""Heartbeats of the rank processes: how the launcher tells a rank that computes, or waits on a
peer, from one that is stopped or stuck for good.

A rank touches ``<log-dir>/<rank>/heartbeat`` (beside its ``error.json``) every
:data:`EVERY_S` from a daemon thread of its own (:func:`start`): the thread needs the
interpreter, so the file goes stale when the process is stopped (``SIGSTOP``, a debugger) or
stuck holding the interpreter in one C call (the GPU driver behind a wait that never ends, a
deadlocked extension). :class:`Heartbeats` is the launcher's side: a rank whose file is older
than the limit (``comm.timeout_s``: longer than any communication wait of a rank may last) has
stopped. A rank that never touched its file (a program that is not Python, or not started
through prism's bootstrap) is not judged: its exit still ends the run.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nccl_ext.core.ranklist import short_ranks
from prism_launch.errors import RanksStoppedError
from prism_launch.launch.failures import ERROR_FILE_ENV

EVERY_S = 1.0
"""How often a rank touches its heartbeat file."""

CHECK_S = 1.0
"""How often the launcher looks at the ranks' heartbeat files."""

FILE_NAME = "heartbeat"

_started: list[Path] = []


def heartbeat_path(error_path: Path | str) -> Path:
    """A rank's heartbeat file: beside its ``error.json``."""
    return Path(error_path).with_name(FILE_NAME)


def start(every_s: float = EVERY_S) -> Path | None:
    """In a rank: touch its heartbeat file every ``every_s`` from a daemon thread (once per
    process); None where the launcher gave no ``error.json`` path (not started by prism)."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        return None
    path = heartbeat_path(error_file)
    if _started and _started[0] == path:
        return path
    _started[:] = [path]

    def beat() -> None:
        while True:
            try:
                path.touch()
            except OSError:  # the log folder went away: the launcher is gone or tearing down
                return
            time.sleep(every_s)

    threading.Thread(target=beat, name="prism-heartbeat", daemon=True).start()
    return path


@dataclass(frozen=True, slots=True)
class Stopped:
    """A rank whose heartbeat stopped: ``age_s`` since its last one."""

    rank: int
    pid: int | None
    age_s: float


class Heartbeats:
    """The launcher's view of its ranks' heartbeat files (``paths``: rank -> file; the launch
    removed those of an earlier run before starting the ranks), judged against ``limit_s``; a
    file older than ``since`` (wall clock; None: any) is not the rank's."""

    def __init__(self, paths: dict[int, Path], limit_s: float, since: float | None = None):
        self.paths, self.limit_s = dict(paths), float(limit_s)
        self.since = since
        self._next = 0.0

    def stopped(self, running: dict[int, int | None]) -> list[Stopped]:
        """The ranks of ``running`` (rank -> pid) whose heartbeat is older than the limit;
        looks at most every :data:`CHECK_S`."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + CHECK_S
        wall, out = time.time(), []
        for rank, pid in sorted(running.items()):
            path = self.paths.get(rank)
            try:
                beat = path.stat().st_mtime if path is not None else None
            except OSError:
                beat = None
            if beat is None or (self.since is not None and beat < self.since):
                continue  # never started beating: not judged
            if wall - beat > self.limit_s:
                out.append(Stopped(rank, pid, wall - beat))
        return out


def stopped_message(stopped: list[Stopped], limit_s: float) -> str:
    """What the launcher says of ranks whose heartbeat stopped."""
    first = stopped[0]
    others = f"; also ranks {short_ranks(s.rank for s in stopped[1:])}" if len(stopped) > 1 else ""
    return (f"rank {first.rank} (pid {first.pid}) stopped: no heartbeat for {first.age_s:.0f} s, longer than any "
            f"communication wait may last (comm.timeout_s={limit_s:g}). Its process is stopped (SIGSTOP, a "
            f"debugger) or stuck holding the interpreter in one call (the GPU driver behind a wait that never "
            f"ends, a deadlocked extension): see its log and py-spy dump --pid {first.pid}{others}. The run was "
            "torn down; raise comm.timeout_s= if one call of the program legitimately holds the interpreter that long")


def stopped_error(stopped: list[Stopped], limit_s: float) -> RanksStoppedError:
    return RanksStoppedError(stopped_message(stopped, limit_s), stopped, limit_s)
