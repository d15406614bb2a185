"""Write a file so readers see the old content or the new one, never a part, and a crash
after the call returns keeps the new one. Every writer of a whole file in the project goes
through :func:`atomic_write`.

How: a temporary file in the same folder (a rename is atomic only within one file system),
created with ``O_EXCL`` (never an existing file or a link someone planted under that name)
and mode 0600 unless the caller asks for another; the data is fsynced, the file renamed over
the target and the folder fsynced (the rename itself is durable only once the folder's
entries are). On any failure the temporary file is removed and the target is untouched.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PRIVATE = 0o600
"""The mode of a written file unless the caller names another: this user's only."""

_TRIES = 16


def _open_exclusive(path: Path, mode: int) -> tuple[int, Path]:
    """A new temporary file beside ``path`` (its descriptor and name), never an existing one."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(_TRIES):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue  # another writer's (or a planted) name: draw another
    raise FileExistsError(f"could not create a temporary file beside {path} in {_TRIES} tries: "
                          f"remove the stale .{path.name}.*.tmp files there")


def fsync_dir(path: Path) -> None:
    """Make a folder's entries durable; a no-op where folders cannot be opened or synced."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # file systems that cannot sync a folder (some network and FUSE ones)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: str | bytes, *, mode: int = PRIVATE) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8), atomically and durably; the
    file gets ``mode`` exactly (the umask does not narrow it). The folder is created if
    missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = _open_exclusive(path, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask applies at creation; the caller's mode is meant exactly
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


atomic_write_text = atomic_write
"""The name most callers know it by (text or bytes alike)."""


__all__ = ["PRIVATE", "atomic_write", "atomic_write_text", "fsync_dir"]
