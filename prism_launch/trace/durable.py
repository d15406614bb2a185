"""Durable, atomic publishing of a directory: fsync of files and directories, the names of a
writer's hidden sibling directories (``.<name>.partial-<pid>-<random>`` while staging,
``.<name>.old-<pid>-<random>`` for a replaced directory set aside), the swap of a staged
directory into place, and the removal of stale leftovers.

The swap uses Linux ``renameat2(RENAME_EXCHANGE)`` where the file system can do it, so the
final path holds the old directory or the new one at every moment; elsewhere it falls back
to renaming the old one aside and the new one in, putting the old one back if that fails.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "fsync_file",
    "fsync_dir",
    "write_bytes_durable",
    "staging_path",
    "is_staging_name",
    "swap_into_place",
    "cleanup_stale_partials",
]

_STAGING_RE = re.compile(r"^\..+\.(?:partial|old)-\d+-[0-9a-f]+$")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory's entries; a no-op where directories cannot be opened or synced."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms that cannot open directories
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- names


def _sibling(final: Path, tag: str) -> Path:
    return final.parent / f".{final.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def staging_path(final: Path) -> Path:
    """A fresh hidden sibling of ``final`` to stage its new contents in."""
    return _sibling(final, "partial")


def is_staging_name(name: str) -> bool:
    """True for names of a writer's staging or set-aside directories (never a trace)."""
    return bool(_STAGING_RE.match(name))


# --------------------------------------------------------------------------- swap


_renameat2 = None
_renameat2_loaded = False


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False when the platform or file system cannot do it.
    """
    global _renameat2, _renameat2_loaded
    if not sys.platform.startswith("linux"):
        return False
    if not _renameat2_loaded:
        _renameat2_loaded = True
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = None
    if _renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_into_place(staging: Path, final: Path, recheck: Callable[[], None]) -> None:
    """Move the complete directory ``staging`` to ``final``, replacing what is there, and
    remove the replaced directory. ``recheck`` is called (and may raise) when ``final``
    appeared after the caller last checked that it may be replaced."""
    parent = final.parent
    if not final.exists():
        try:
            os.rename(staging, final)
            fsync_dir(parent)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            recheck()  # appeared meanwhile: replace it like an existing one

    if _rename_exchange(staging, final):
        # final now holds the new directory; the staging name holds the old one.
        fsync_dir(parent)
        shutil.rmtree(staging, ignore_errors=True)
        return

    # Fallback without an atomic swap: set the old directory aside, move the new one in.
    aside = _sibling(final, "old")
    os.rename(final, aside)
    try:
        os.rename(staging, final)
    except BaseException:
        os.rename(aside, final)
        raise
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


# --------------------------------------------------------------------------- maintenance


def cleanup_stale_partials(parent: str | Path, older_than_s: float = 3600) -> list[Path]:
    """Remove writer leftovers (``.<name>.partial-*`` / ``.<name>.old-*``) in ``parent``.

    Only directories last modified more than ``older_than_s`` seconds ago are
    removed, so a writer committing right now is left alone.  Returns the paths
    removed.
    """
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    now = time.time()
    for entry in entries:
        if not is_staging_name(entry.name):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if math.isnan(age) or age < older_than_s:
            continue
        path = Path(entry.path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed
