"""Disk space and writability of the directories a run writes (a trace, a report): checked
before any rank starts and again while a capture grows, so a full disk or a read-only
directory ends the run with a plain message instead of a failed write after the work is done.

Checked on Linux (ext4, overlayfs, tmpfs) with Python 3.11's ``shutil.disk_usage``."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from .errors import TraceSpaceError, TraceUnwritableError

__all__ = ["MARGIN", "existing_ancestor", "free_bytes", "require_space", "require_writable"]

MARGIN = 1.05
"""Free space asked for beyond the estimate (file headers, parquet pages, the manifest)."""
SLACK_BYTES = 8 << 20


def existing_ancestor(path: Path) -> Path:
    """``path`` itself, or its nearest parent that exists (where a new directory would be made)."""
    path = Path(os.path.abspath(path))
    while not os.path.exists(path) and path != path.parent:  # False, too, where a parent cannot be searched
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes free to this user on the file system that holds (or would hold) ``path``."""
    return shutil.disk_usage(existing_ancestor(Path(path))).free


def needed_bytes(estimate: int) -> int:
    return int(estimate * MARGIN) + SLACK_BYTES


def require_space(path: str | Path, estimate: int, *, during: bool = False) -> None:
    """Raise :class:`TraceSpaceError` when ``estimate`` bytes (plus the margin) will not fit."""
    need, free = needed_bytes(estimate), free_bytes(path)
    if need > free:
        raise TraceSpaceError(path, need, free, during=during)


def require_writable(path: str | Path, *, setting: str = "trace.dir") -> None:
    """Raise :class:`TraceUnwritableError` unless ``path`` can be written as a run writes it:
    staged and locked beside it (in its parent, made if missing) and, when it exists, inside
    it. Probed by creating a file, so what the permission bits, a read-only mount or a file in
    the way say is found before any rank runs."""
    path = Path(os.path.abspath(path))
    for base in dict.fromkeys([existing_ancestor(path.parent), *([path] if os.path.exists(path) else [])]):
        if not base.is_dir():
            raise TraceUnwritableError(path, base, "it is a file, not a directory", setting=setting)
        try:
            fd, probe = tempfile.mkstemp(prefix=".prism-probe-", dir=base)
        except OSError as e:
            raise TraceUnwritableError(path, base, e.strerror or str(e), setting=setting) from None
        os.close(fd)
        os.unlink(probe)


def is_no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
