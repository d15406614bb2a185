"""Durable, atomic publishing of a directory: fsync of files and directories, the names of a
writer's hidden sibling directories (``.<name>.partial-<pid>-<host><random>`` while staging,
``.<name>.old-<pid>-<host><random>`` for a replaced directory set aside; ``<host>`` is 8 hex
digits of the writer's host name, so a later run can tell whether the writer is gone), the
swap of a staged directory into place, and the recovery of what a killed writer left.

The swap uses Linux ``renameat2(RENAME_EXCHANGE)`` where the file system can do it, so the
final path holds the old directory or the new one at every moment; elsewhere it falls back
to renaming the old one aside and the new one in, putting the old one back if that fails. A
writer killed between those two renames leaves no directory at the final path and the old
one set aside: :func:`recover_interrupted_swap` puts it back.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import math
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "fsync_file",
    "fsync_dir",
    "write_bytes_durable",
    "staging_path",
    "is_staging_name",
    "swap_into_place",
    "cleanup_stale_partials",
    "recover_interrupted_swap",
    "StagingOwner",
]

_STAGING_RE = re.compile(r"^\.(?P<name>.+)\.(?P<tag>partial|old)-(?P<pid>\d+)-(?P<tail>[0-9a-f]+)$")
_HOST_TAG_LEN = 8


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


def host_tag(host: str | None = None) -> str:
    """8 hex digits naming a host in a staging directory's name."""
    return hashlib.sha256((host or socket.gethostname()).encode()).hexdigest()[:_HOST_TAG_LEN]


def _sibling(final: Path, tag: str) -> Path:
    return final.parent / f".{final.name}.{tag}-{os.getpid()}-{host_tag()}{secrets.token_hex(4)}"


@dataclass(frozen=True, slots=True)
class StagingOwner:
    """Who made a staging or set-aside directory, read from its name."""

    name: str
    """The final directory's name it belongs to."""
    tag: str
    """``partial`` or ``old``."""
    pid: int
    host: str | None
    """The writer's host tag (None: a name from before host tags, host unknown)."""

    @classmethod
    def parse(cls, name: str) -> StagingOwner | None:
        m = _STAGING_RE.match(name)
        if m is None:
            return None
        tail = m["tail"]
        host = tail[:_HOST_TAG_LEN] if len(tail) == _HOST_TAG_LEN + 8 else None
        return cls(name=m["name"], tag=m["tag"], pid=int(m["pid"]), host=host)

    def dead(self) -> bool | None:
        """True when the writer was on this host and is gone, False when it still runs here,
        None when it wrote from another host (or one unknown) and this host cannot tell."""
        if self.host is None or self.host != host_tag():
            return None
        if self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


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


def _leftovers(parent: Path, name: str | None, tag: str | None = None) -> list[tuple[os.DirEntry, StagingOwner]]:
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        owner = StagingOwner.parse(entry.name)
        if owner is None or (name is not None and owner.name != name) or (tag is not None and owner.tag != tag):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                out.append((entry, owner))
        except FileNotFoundError:
            continue
    return out


def _gone(entry: os.DirEntry, owner: StagingOwner, now: float, older_than_s: float) -> bool:
    """Whether ``entry``'s writer is gone: dead on this host, or (another host's, which this
    host cannot ask) untouched for ``older_than_s``."""
    dead = owner.dead()
    if dead is not None:
        return dead
    try:
        age = now - entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return False
    return not math.isnan(age) and age >= older_than_s


def recover_interrupted_swap(final: str | Path) -> Path | None:
    """Put back the directory a writer set aside when it was killed between the two renames of
    :func:`swap_into_place`'s fallback (``final`` missing, ``.<name>.old-*`` beside it, its
    writer gone). Call it holding the directory's lock (:class:`~prism_launch.trace.lock.DirLock`),
    so no live writer is mid-swap. Returns the directory put back, or None."""
    final = Path(os.path.abspath(final))
    if os.path.lexists(final):
        return None
    aside = [(e, o) for e, o in _leftovers(final.parent, final.name, "old") if o.dead() is not False]
    if not aside:
        return None
    newest = max(aside, key=lambda eo: eo[0].stat(follow_symlinks=False).st_mtime)[0]
    try:
        os.rename(newest.path, final)
    except FileNotFoundError:  # another run put it back first
        return None
    fsync_dir(final.parent)
    return Path(newest.path)


def cleanup_stale_partials(parent: str | Path, older_than_s: float = 3600, *, name: str | None = None) -> list[Path]:
    """Remove writer leftovers (``.<name>.partial-*`` / ``.<name>.old-*``) in ``parent`` (only
    those of the directory ``name`` when given) whose writer is gone: a writer on this host
    that no longer runs, or one on another host (or of a name without a host) last modified
    more than ``older_than_s`` seconds ago. A set-aside ``.old-*`` whose final directory is
    missing is kept for :func:`recover_interrupted_swap`. Returns the paths removed."""
    parent = Path(parent)
    removed: list[Path] = []
    now = time.time()
    for entry, owner in _leftovers(parent, name):
        if owner.tag == "old" and not os.path.lexists(parent / owner.name):
            continue  # the only copy of that directory: recovered, not removed
        if not _gone(entry, owner, now, older_than_s):
            continue
        path = Path(entry.path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed
