"""Folders and files only the current user can change: the build cache of the CPU allocator
hook, ``memory.cache_dir``, the trace signing key's folder, a trace read back.

What is loaded or executed from such a folder (a compiled ``.so``, a key that decides whether
a trace's pickles are trusted) is only as trustworthy as whoever can write there. So every
level from the given root down is checked with ``lstat`` (a symbolic link is refused, not
followed): it must be a real directory owned by this process's user and writable by no one
else (no group or world write bit). Folders this module creates are made ``0700``. The
levels above the root (``/tmp``, ``~``) are not checked: they are the user's choice, and
``/tmp`` is world-writable by design; a predictable name under it (``/tmp/x-<uid>``) that
another user created first is refused here, because the folder's owner is then not us.

A refusal raises :class:`UnsafePathError` naming the path, what is wrong and what to do.
Files are opened with :func:`open_private_file` (``O_NOFOLLOW``, created ``0600``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from prism_launch.errors import UnsafePathError

__all__ = ["UnsafePathError", "check_private", "ensure_private_dir", "open_private_file"]

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _refuse(path: Path, what: str, hint: str) -> UnsafePathError:
    return UnsafePathError(f"{path}: {what}; refusing to use it, since another user could change what is read "
                           f"from it. {hint}".rstrip())


def check_private(path: str | os.PathLike, *, directory: bool = True, hint: str = "") -> os.stat_result:
    """``lstat`` of ``path``, which must be a directory (else a regular file) owned by this
    user and not writable by group or others; raises :class:`UnsafePathError` otherwise
    (``FileNotFoundError`` when it does not exist)."""
    p = Path(path)
    st = os.lstat(p)
    fix = hint or f"Remove it if it is yours (rm -r {p}) or choose another location."
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(p, "is a symbolic link", fix)
    if directory and not stat.S_ISDIR(st.st_mode):
        raise _refuse(p, "is not a directory", fix)
    if not directory and not stat.S_ISREG(st.st_mode):
        raise _refuse(p, "is not a regular file", fix)
    uid = os.getuid()
    if st.st_uid != uid:
        raise _refuse(p, f"is owned by uid {st.st_uid}, not by you (uid {uid})", hint or "Choose another location.")
    if st.st_mode & _OTHERS_WRITE:
        mode = stat.S_IMODE(st.st_mode)
        raise _refuse(p, f"is writable by group or others (mode {mode:04o})",
                      hint or f"If its contents are yours, `chmod go-w {p}`; else remove it.")
    return st


def ensure_private_dir(root: str | os.PathLike, *parts: str, hint: str = "") -> Path:
    """``root/parts...``, every level from ``root`` down created ``0700`` where missing and
    checked with :func:`check_private` (the folders above ``root`` are created if missing,
    not checked). Returns the deepest folder."""
    d = Path(os.path.abspath(os.fspath(root)))
    d.parent.mkdir(parents=True, exist_ok=True)
    for level in (None, *parts):
        if level is not None:
            if level in ("", ".", "..") or "/" in level:
                raise ValueError(f"{level!r} is not a single folder name")
            d = d / level
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        check_private(d, hint=hint)
    return d


def open_private_file(path: str | os.PathLike, flags: int = os.O_RDWR, *, hint: str = "") -> int:
    """A file descriptor of ``path`` (created ``0600`` if missing, never truncated, a symbolic
    link refused), checked like :func:`check_private` on the open file itself."""
    p = Path(path)
    try:
        fd = os.open(p, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if os.path.islink(p):
            raise _refuse(p, "is a symbolic link", hint or f"Remove it (rm {p}).") from e
        raise
    try:
        st = os.fstat(fd)
        uid = os.getuid()
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(p, "is not a regular file", hint)
        if st.st_uid != uid:
            raise _refuse(p, f"is owned by uid {st.st_uid}, not by you (uid {uid})", hint)
        if st.st_mode & _OTHERS_WRITE:
            raise _refuse(p, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})", hint)
    except BaseException:
        os.close(fd)
        raise
    return fd
