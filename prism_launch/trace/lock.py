"""One writer at a time per trace or report directory, and no writer under its readers: an
advisory ``flock`` on a hidden sibling file (``<parent>/.<name>.lock``, outside the directory,
which a capture's swap replaces). A writer (a capture) takes it exclusive; readers (an
emulation, a calibration replaying the trace) take it shared, so a capture never swaps a
trace under running ranks. A run that cannot take it fails at once, naming the holders' pid,
host, start time and program; the kernel drops the lock when a holder exits, however it
exits, so a lock is never stale.

The file (mode 0600) holds one JSON line per holder: an exclusive holder rewrites it, a shared
one appends its line; a line whose process is gone (on this host) is not named. It never holds
the command line (arguments may carry paths or secrets of the user's program)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import TraceBusyError

__all__ = ["DirLock", "lock_path", "holders"]


def lock_path(directory: Path) -> Path:
    directory = Path(os.path.abspath(directory))
    return directory.parent / f".{directory.name}.lock"


def _program() -> str:
    """The program's name, never its arguments."""
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


class DirLock:
    """``with DirLock(path, setting="report.dir"):`` — held for the block (``shared=True``: by
    readers, any number at once); raises :class:`TraceBusyError` when another process holds it
    in a way that excludes this one."""

    def __init__(self, directory: str | Path, *, setting: str, shared: bool = False) -> None:
        self.directory = Path(os.path.abspath(directory))
        self.path = lock_path(self.directory)
        self.setting = setting
        self.shared = shared
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: a shared holder's one write of a short line is not interleaved with another's
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe(_read(fd))
            os.close(fd)
            raise TraceBusyError(self.directory, holder, setting=self.setting) from None
        try:
            if os.fstat(fd).st_uid == os.getuid():
                os.fchmod(fd, 0o600)  # a lock file made before it was private
        except OSError:
            pass
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time(),
                         "program": _program(), "shared": self.shared}) + "\n"
        if not self.shared:  # alone: the lines of earlier holders go
            os.ftruncate(fd, 0)
        os.write(fd, me.encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self if self._fd is not None else self.acquire()  # ``with`` over one already taken

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)


def _alive(record: dict) -> bool:
    if record.get("host") != socket.gethostname():
        return True  # another host's process: this one cannot ask, so it is named
    try:
        os.kill(int(record.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True


def holders(raw: bytes) -> list[dict]:
    """The holders a lock file names whose process still runs (or runs on another host)."""
    out = []
    for line in raw.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("pid") and _alive(record):
            out.append(record)
    return out


def describe(raw: bytes) -> str:
    found = holders(raw)
    if not found:
        return "holder unknown"

    def one(h: dict) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("started_unix", 0)))
        what = "reading" if h.get("shared") else "writing"
        return f"pid {h.get('pid')} on host {h.get('host')}, started {started}: {h.get('program', h.get('command', '?'))} ({what})"

    return "; ".join(one(h) for h in found)
