"""The sha256 checksums of a trace's files: hashing them in parallel (hashlib and fsync release
the GIL), sealing freshly written files, and checking files against the manifest's sums.

Beside the manifest, not part of the trace, lies the cache ``.verified.json``
(:data:`~prism_launch.trace.layout.VERIFIED_NAME`): the files found intact, each with the
size, modification time and inode it had then and the sum it was checked against. A later
check hashes only the files changed since (git's index does the same). The cache is kept
only where the trace is writable; a read-only trace is hashed at every check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from .durable import fsync_file
from .errors import TraceCorruptError
from .layout import TraceLayout

__all__ = ["sha256_file", "seal_files", "verify_files"]

_HASH_CHUNK = 1 << 20
_MAX_THREADS = 8

_T = TypeVar("_T")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def _in_parallel(fn: Callable[[str], _T], rels: Iterable[str]) -> list[_T]:
    rels = list(rels)
    with ThreadPoolExecutor(max(1, min(_MAX_THREADS, len(rels)))) as pool:
        return list(pool.map(fn, rels))


def _stamp(root: Path, rel: str, sha: str) -> list:
    st = (root / rel).stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, sha]


def _remember_verified(root: Path, stamps: Mapping[str, list]) -> None:
    """Record the stamps of files just found intact (kept only where the trace is writable)."""
    from nccl_ext.core.atomic import atomic_write

    try:
        atomic_write(TraceLayout(root).verified, json.dumps(dict(stamps)), mode=0o644)
    except OSError:  # a read-only trace: verified, just not remembered
        pass


def seal_files(root: Path, rels: Iterable[str], sums: Mapping[str, str] | None = None) -> dict[str, str]:
    """fsync and hash the files ``rels`` (relative to ``root``) just written; returns their
    sums. ``sums``: files whose sums the writer took from the bytes it wrote (fsynced, not
    read again). They are remembered as intact: what was just hashed needs no hashing at the
    first check."""
    rels = list(rels)
    sums = dict(sums or {})

    def seal(rel: str) -> str:
        fsync_file(root / rel)
        return sums[rel] if rel in sums else sha256_file(root / rel)

    files = dict(zip(rels, _in_parallel(seal, rels)))
    _remember_verified(root, {rel: _stamp(root, rel, sha) for rel, sha in files.items()})
    return files


def verify_files(root: Path, files: Mapping[str, str]) -> None:
    """Check every file's sha256 against ``files`` (relative path -> sum), skipping those
    unchanged since they were last found intact; raises ``TraceCorruptError`` for the first
    one that differs."""
    try:
        known = json.loads(TraceLayout(root).verified.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    stamps = {rel: _stamp(root, rel, sha) for rel, sha in files.items()}  # as they were before hashing
    todo = [rel for rel in files if known.get(rel) != stamps[rel]]
    if not todo:
        return
    actual = _in_parallel(lambda rel: sha256_file(root / rel), todo)
    for rel, got in zip(todo, actual):
        if got != files[rel]:
            raise TraceCorruptError(root, rel, files[rel], got)
    _remember_verified(root, stamps)
