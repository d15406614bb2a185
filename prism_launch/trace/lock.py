"""One writer at a time per trace or report directory: an advisory ``flock`` on a hidden
sibling file (``<parent>/.<name>.lock``, outside the directory, which a capture's swap
replaces), holding who took it. A second run on the same directory fails at once, naming the
holder's pid, host, start time and command; the kernel drops the lock when the holder exits,
however it exits, so a lock is never stale."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import TraceBusyError

__all__ = ["DirLock", "lock_path"]


def lock_path(directory: Path) -> Path:
    directory = Path(os.path.abspath(directory))
    return directory.parent / f".{directory.name}.lock"


class DirLock:
    """``with DirLock(path, setting="report.dir"):`` — held for the block; raises
    :class:`TraceBusyError` when another process holds it."""

    def __init__(self, directory: str | Path, *, setting: str) -> None:
        self.directory = Path(os.path.abspath(directory))
        self.path = lock_path(self.directory)
        self.setting = setting
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise TraceBusyError(self.directory, holder, setting=self.setting) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time(),
              "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode() or "{}")
    except ValueError:
        h = {}
    if not h:
        return "holder unknown"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("started_unix", 0)))
    return f"pid {h.get('pid')} on host {h.get('host')}, started {started}: {h.get('command', '?')}"
