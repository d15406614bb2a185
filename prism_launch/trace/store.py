"""On-disk storage of a PrismTrace (format version 1).

A PrismTrace is a directory::

    <trace>/
        manifest.json                    # written last; lists every other file with its sha256
        events.parquet                   # one row per communication event of every captured rank
        tensors/rank000000.safetensors   # tensors a rank contributed (only ranks that added some)
        <name>.json                      # optional JSON files added by the caller

:class:`TraceWriter` stages everything into a hidden sibling directory
(``.<name>.partial-<pid>-<random>``) and only then moves it to the final path,
so a reader sees either the previous complete trace or the new complete one,
never a half-written directory.  :class:`TraceReader` validates the manifest
and checksums and gives access to events, tensors and JSON files.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import (
    TraceCorruptError,
    TraceError,
    TraceKeyError,
    TraceMissingError,
    TraceVersionError,
)

_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "EVENTS_NAME",
    "TENSORS_DIR",
    "EVENT_SCHEMA",
    "EVENT_KINDS",
    "EVENT_REQUIRED_FIELDS",
    "EVENT_DEFAULTS",
    "Manifest",
    "TraceWriter",
    "TraceReader",
    "tensor_file_name",
    "is_staging_name",
    "cleanup_stale_partials",
]

FORMAT_VERSION = 1

MANIFEST_NAME = "manifest.json"
EVENTS_NAME = "events.parquet"
TENSORS_DIR = "tensors"

#: Fixed schema of ``events.parquet``.
EVENT_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("idx", pa.int64(), nullable=False),
        pa.field("unit", pa.int32(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("op", pa.string(), nullable=False),
        pa.field("group", pa.int32(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("peer", pa.int32(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("shape", pa.list_(pa.int64()), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("t_start", pa.float64(), nullable=False),
        pa.field("t_end", pa.float64(), nullable=False),
        pa.field("compute_wall_s", pa.float64(), nullable=False),
        pa.field("compute_cpu_s", pa.float64(), nullable=False),
        pa.field("tensor_key", pa.string(), nullable=True),
        pa.field("extra", pa.string(), nullable=True),
    ]
)

#: Allowed values of the ``kind`` column.
EVENT_KINDS = ("collective", "p2p", "wait", "marker")

#: Fields every event row must provide.
EVENT_REQUIRED_FIELDS = ("rank", "idx", "kind", "op")

#: Values used for optional fields a row leaves out (or sets to ``None``).
EVENT_DEFAULTS: Mapping[str, Any] = {
    "unit": 0,
    "group": -1,
    "seq": -1,
    "peer": -1,
    "dtype": "",
    "shape": (),
    "nbytes": 0,
    "t_start": 0.0,
    "t_end": 0.0,
    "compute_wall_s": 0.0,
    "compute_cpu_s": 0.0,
    "tensor_key": None,
    "extra": None,
}

_EVENT_FIELDS = tuple(EVENT_SCHEMA.names)
_EVENT_FIELD_SET = frozenset(_EVENT_FIELDS)
assert set(EVENT_REQUIRED_FIELDS) | set(EVENT_DEFAULTS) == _EVENT_FIELD_SET

_STAGING_RE = re.compile(r"^\..+\.(?:partial|old)-\d+-[0-9a-f]+$")
_HASH_CHUNK = 1 << 20


def tensor_file_name(rank: int) -> str:
    """Relative path (POSIX) of the tensor file of ``rank`` inside a trace."""
    return f"{TENSORS_DIR}/rank{int(rank):06d}.safetensors"


def is_staging_name(name: str) -> bool:
    """True for names of a writer's staging or set-aside directories (never a trace)."""
    return bool(_STAGING_RE.match(name))


# --------------------------------------------------------------------------- manifest


def _check_str_dict(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict of str -> str, got {type(value).__name__}")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"{name} must map str -> str; entry {k!r}: {v!r} is not")
        out[k] = v
    return out


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _check_json_dict(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    return dict(value)


def _normalize_group(g: Any, i: int) -> dict[str, Any]:
    if not isinstance(g, Mapping):
        raise TypeError(f"groups[{i}] must be a dict with id, ranks, backend, desc; got {g!r}")
    if "id" not in g or "ranks" not in g:
        raise ValueError(f"groups[{i}] must have 'id' and 'ranks'; got keys {sorted(g)}")
    out = dict(g)
    out["id"] = _check_int(f"groups[{i}].id", g["id"])
    ranks = g["ranks"]
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"groups[{i}].ranks must be a list of ints, got {ranks!r}")
    out["ranks"] = [_check_int(f"groups[{i}].ranks[]", int(r) if _is_intlike(r) else r) for r in ranks]
    backend = g.get("backend", "")
    desc = g.get("desc", "")
    if not isinstance(backend, str) or not isinstance(desc, str):
        raise TypeError(f"groups[{i}].backend and .desc must be strings")
    out["backend"] = backend
    out["desc"] = desc
    return out


def _is_intlike(x: Any) -> bool:
    return not isinstance(x, bool) and hasattr(x, "__index__")


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """Contents of ``manifest.json``."""

    format_version: int
    created_unix: float
    fingerprint: dict[str, str]
    versions: dict[str, str]
    world_size: int
    topology: dict[str, Any]
    groups: list[dict[str, Any]]
    ranks_captured: list[int]
    files: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "created_unix": self.created_unix,
            "fingerprint": dict(self.fingerprint),
            "versions": dict(self.versions),
            "world_size": self.world_size,
            "topology": self.topology,
            "groups": [dict(g) for g in self.groups],
            "ranks_captured": list(self.ranks_captured),
            "files": dict(self.files),
            "extra": self.extra,
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Build a manifest from parsed JSON; raises ``TypeError``/``ValueError`` if malformed."""
        if not isinstance(d, Mapping):
            raise TypeError(f"manifest must be a JSON object, got {type(d).__name__}")
        missing = [
            k
            for k in (
                "format_version",
                "created_unix",
                "fingerprint",
                "versions",
                "world_size",
                "topology",
                "groups",
                "ranks_captured",
                "files",
            )
            if k not in d
        ]
        if missing:
            raise ValueError(f"manifest lacks fields {missing}")
        created = d["created_unix"]
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise TypeError(f"created_unix must be a number, got {created!r}")
        groups = d["groups"]
        if not isinstance(groups, list):
            raise TypeError("groups must be a list")
        ranks = d["ranks_captured"]
        if not isinstance(ranks, list):
            raise TypeError("ranks_captured must be a list of ints")
        extra = d.get("extra", {})
        if extra is None:
            extra = {}
        return cls(
            format_version=_check_int("format_version", d["format_version"]),
            created_unix=float(created),
            fingerprint=_check_str_dict("fingerprint", d["fingerprint"]),
            versions=_check_str_dict("versions", d["versions"]),
            world_size=_check_int("world_size", d["world_size"]),
            topology=_check_json_dict("topology", d["topology"]),
            groups=[_normalize_group(g, i) for i, g in enumerate(groups)],
            ranks_captured=[_check_int("ranks_captured[]", r) for r in ranks],
            files=_check_str_dict("files", d["files"]),
            extra=_check_json_dict("extra", extra),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        return cls.from_dict(json.loads(text))


# --------------------------------------------------------------------------- helpers


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


VERIFIED_NAME = ".verified.json"
"""Beside the manifest, not part of the trace: the files found intact, each with the size,
modification time and inode it had then. A later open hashes only the files changed since
(git's index does the same); a read-only trace is hashed at every open."""


def _verify_files(path: Path, files: Mapping[str, str]) -> None:
    """Check every file's sha256 against the manifest's, skipping those unchanged since they
    were last found intact, hashing the rest in parallel (hashlib releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        known = json.loads((path / VERIFIED_NAME).read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    stamps = {rel: _stamp(path, rel, sha) for rel, sha in files.items()}  # as they were before hashing
    todo = [rel for rel in files if known.get(rel) != stamps[rel]]
    if not todo:
        return
    with ThreadPoolExecutor(min(8, len(todo))) as pool:
        actual = list(pool.map(lambda rel: _sha256_file(path / rel), todo))
    for rel, got in zip(todo, actual):
        if got != files[rel]:
            raise TraceCorruptError(path, rel, files[rel], got)
    _remember_verified(path, stamps)


def _stamp(path: Path, rel: str, sha: str) -> list:
    st = (path / rel).stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, sha]


def _remember_verified(path: Path, stamps: Mapping[str, list]) -> None:
    """Record the stamps of files just found intact (kept only where the trace is writable)."""
    tmp = path / f"{VERIFIED_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(dict(stamps)))
        os.replace(tmp, path / VERIFIED_NAME)
    except OSError:  # a read-only trace: verified, just not remembered
        tmp.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
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


def _write_bytes_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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


def _safe_relpath(name: str) -> str:
    """Normalize a caller-chosen relative file name; reject anything escaping the trace."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"file name must be a non-empty string, got {name!r}")
    if "\\" in name or "\x00" in name:
        raise ValueError(f"file name {name!r} must use '/' separators and no NUL bytes")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"file name {name!r} must be a plain relative path inside the trace")
    return str(p)


def _is_reserved(rel: str) -> bool:
    return rel in (MANIFEST_NAME, EVENTS_NAME) or rel == TENSORS_DIR or rel.startswith(TENSORS_DIR + "/")


# --------------------------------------------------------------------------- events


def _rows_to_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    cols: dict[str, list[Any]] = {name: [] for name in _EVENT_FIELDS}
    n = 0
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"event row {i} must be a dict, got {type(row).__name__}")
        unknown = row.keys() - _EVENT_FIELD_SET
        if unknown:
            raise ValueError(
                f"event row {i} has unknown fields {sorted(unknown)}; allowed: {list(_EVENT_FIELDS)}"
            )
        for name in EVENT_REQUIRED_FIELDS:
            v = row.get(name)
            if v is None:
                raise ValueError(f"event row {i} lacks required field {name!r}: {dict(row)!r}")
            cols[name].append(v)
        for name, default in EVENT_DEFAULTS.items():
            v = row.get(name)
            if v is None:
                v = default
            elif name == "shape":
                v = [int(s) for s in v]
            elif name == "dtype" and not isinstance(v, str):
                v = str(v)
            elif name == "extra" and not isinstance(v, str):
                v = json.dumps(v, sort_keys=True)
            cols[name].append(v)
        n += 1
    try:
        return pa.Table.from_pydict(cols, schema=EVENT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        raise ValueError(f"event rows do not fit the PrismTrace event schema: {e}") from e


def _default_array(name: str, n: int) -> pa.Array:
    typ = EVENT_SCHEMA.field(name).type
    default = EVENT_DEFAULTS[name]
    if default is None:
        return pa.nulls(n, type=typ)
    if name == "shape":
        return pa.array([[] for _ in range(n)], type=typ)
    return pa.repeat(pa.scalar(default, type=typ), n)


def _conform_table(table: pa.Table | pa.RecordBatch) -> pa.Table:
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    unknown = set(table.column_names) - _EVENT_FIELD_SET
    if unknown:
        raise ValueError(f"event table has unknown columns {sorted(unknown)}; allowed: {list(_EVENT_FIELDS)}")
    if len(set(table.column_names)) != len(table.column_names):
        raise ValueError(f"event table has duplicate columns: {table.column_names}")
    n = table.num_rows
    arrays = []
    for f in EVENT_SCHEMA:
        if f.name in table.column_names:
            col = table.column(f.name)
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                raise ValueError(f"event column {f.name!r} of type {col.type} cannot be cast to {f.type}: {e}") from e
            if not f.nullable and col.null_count:
                if f.name in EVENT_REQUIRED_FIELDS:
                    raise ValueError(f"event column {f.name!r} is required but has {col.null_count} nulls")
                col = pc.fill_null(col, pa.scalar(EVENT_DEFAULTS[f.name] if f.name != "shape" else [], type=f.type))
            arrays.append(col)
        else:
            if f.name in EVENT_REQUIRED_FIELDS:
                raise ValueError(f"event table lacks required column {f.name!r}")
            arrays.append(_default_array(f.name, n))
    return pa.Table.from_arrays(arrays, schema=EVENT_SCHEMA)


def _check_kinds(table: pa.Table) -> None:
    if table.num_rows == 0:
        return
    ok = pc.is_in(table.column("kind"), value_set=pa.array(EVENT_KINDS))
    if not pc.all(ok).as_py():
        bad = sorted(set(pc.filter(table.column("kind"), pc.invert(ok)).to_pylist()))
        raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {bad}")


# --------------------------------------------------------------------------- writer


class TraceWriter:
    """Builds a PrismTrace and publishes it atomically at ``final_dir`` on :meth:`commit`.

    Events, tensors and JSON files are held in memory until :meth:`commit`, which
    writes them into a hidden staging directory beside ``final_dir`` and then
    swaps it into place.  Used as a context manager, an exception (or leaving the
    block without committing) discards everything.
    """

    def __init__(self, final_dir: str | Path) -> None:
        self.final_dir = Path(os.path.abspath(os.fspath(final_dir)))
        if not self.final_dir.name:
            raise ValueError(f"cannot write a PrismTrace at {final_dir!r}: it has no directory name")
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        self._check_target()
        self.staging_dir = self.final_dir.parent / (
            f".{self.final_dir.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        )
        self._tables: list[pa.Table] = []
        self._tensors: dict[int, dict[str, torch.Tensor]] = {}
        self._json: dict[str, bytes] = {}
        self._state = "open"  # "open" | "committed" | "aborted"
        self._lock = threading.Lock()

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state == "open":
            warnings.warn(
                f"TraceWriter for {self.final_dir} left without commit(); nothing was written",
                RuntimeWarning,
                stacklevel=2,
            )
            self.abort()

    # -- adding content --------------------------------------------------------------

    def _require_open(self) -> None:
        if self._state != "open":
            raise TraceError(f"TraceWriter for {self.final_dir} is already {self._state}; start a new writer")

    def add_events(self, rows: Iterable[Mapping[str, Any]] | pa.Table | pa.RecordBatch) -> None:
        """Append events; dict rows may leave out optional fields (see ``EVENT_DEFAULTS``)."""
        self._require_open()
        if isinstance(rows, (pa.Table, pa.RecordBatch)):
            table = _conform_table(rows)
        else:
            table = _rows_to_table(rows)
        _check_kinds(table)
        if table.num_rows:
            with self._lock:
                self._require_open()
                self._tables.append(table)

    def add_tensors(self, rank: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store tensors of ``rank`` under caller-chosen string keys.

        Tensors are copied (to CPU, contiguous) so later in-place changes by the
        caller do not affect the trace.  A key already stored for the rank raises
        ``ValueError`` and nothing from this call is kept.
        """
        self._require_open()
        if not _is_intlike(rank) or int(rank) < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        rank = int(rank)
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a mapping of str -> torch.Tensor, got {type(tensors).__name__}")
        staged: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"tensor keys must be non-empty strings, got {key!r} (rank {rank})")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {key!r} of rank {rank} is a {type(t).__name__}, not a torch.Tensor")
            if t.layout != torch.strided:
                raise ValueError(f"tensor {key!r} of rank {rank} has layout {t.layout}; only dense tensors are stored")
            if t.device.type == "meta":
                raise ValueError(f"tensor {key!r} of rank {rank} is on the meta device and has no data")
            t = t.detach()
            if t.device.type == "cpu":
                t = t.clone(memory_format=torch.contiguous_format)
            else:
                t = t.to("cpu").contiguous()
            staged[key] = t
        with self._lock:
            self._require_open()
            existing = self._tensors.setdefault(rank, {})
            dup = sorted(k for k in staged if k in existing)
            if dup:
                raise ValueError(f"rank {rank} already has tensors with keys {dup} in this trace")
            existing.update(staged)

    def write_json(self, name: str, obj: Any) -> None:
        """Add a JSON file ``name`` (relative path) to the trace; it is checksummed like the rest."""
        self._require_open()
        rel = _safe_relpath(name)
        if _is_reserved(rel):
            raise ValueError(f"{rel!r} is reserved for the trace's own files; choose another name")
        data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
        with self._lock:
            self._require_open()
            if rel in self._json:
                raise ValueError(f"JSON file {rel!r} was already added to this trace")
            for other in self._json:
                if other.startswith(rel + "/") or rel.startswith(other + "/"):
                    raise ValueError(f"JSON file {rel!r} clashes with {other!r} (one would be a directory)")
            self._json[rel] = data

    # -- publishing ------------------------------------------------------------------

    def _check_target(self) -> None:
        final = self.final_dir
        if final.is_symlink():
            raise TraceError(
                f"{final} is a symbolic link; pass the real directory path to write the PrismTrace to"
            )
        if not final.exists():
            return
        if not final.is_dir():
            raise TraceError(f"{final} exists and is not a directory; remove it or choose another trace path")
        if (final / MANIFEST_NAME).is_file():
            return
        if any(final.iterdir()):
            raise TraceError(
                f"{final} exists, is not empty and is not a PrismTrace (no {MANIFEST_NAME}); refusing to "
                f"replace it. Remove it or choose another trace path."
            )

    def _events_table(self) -> pa.Table:
        if self._tables:
            table = pa.concat_tables(self._tables)
        else:
            table = EVENT_SCHEMA.empty_table()
        table = table.sort_by([("rank", "ascending"), ("idx", "ascending")]).combine_chunks()
        n = table.num_rows
        if n > 1:
            r, i = table.column("rank"), table.column("idx")
            same = pc.and_(pc.equal(r[1:], r[:-1]), pc.equal(i[1:], i[:-1]))
            if pc.any(same).as_py():
                pos = pc.index(same, True).as_py()
                raise ValueError(
                    f"duplicate event (rank={r[pos].as_py()}, idx={i[pos].as_py()}); "
                    f"each rank's event idx must be unique"
                )
        return table

    def commit(
        self,
        *,
        fingerprint: Mapping[str, str],
        versions: Mapping[str, str],
        world_size: int,
        topology: Mapping[str, Any],
        groups: Iterable[Mapping[str, Any]],
        ranks_captured: Iterable[int],
        extra: Mapping[str, Any] | None = None,
        allow_missing_tensors: bool = False,
    ) -> Manifest:
        """Write the trace and publish it at ``final_dir``; returns the manifest written.

        ``allow_missing_tensors``: events may name tensors this trace does not hold (a
        derived version, e.g. the calibrated graph, whose tensors stay in the bare trace).

        Argument problems raise ``TypeError``/``ValueError`` before anything touches
        the disk and leave the writer open.  Failures while writing abort the writer.
        """
        self._require_open()
        with self._lock:
            self._require_open()
            fingerprint = _check_str_dict("fingerprint", fingerprint)
            versions = _check_str_dict("versions", versions)
            world_size = _check_int("world_size", int(world_size) if _is_intlike(world_size) else world_size)
            if world_size <= 0:
                raise ValueError(f"world_size must be positive, got {world_size}")
            topology = _check_json_dict("topology", topology)
            groups_n = [_normalize_group(g, i) for i, g in enumerate(groups)]
            ranks = sorted({_check_int("ranks_captured[]", int(r) if _is_intlike(r) else r) for r in ranks_captured})
            bad = [r for r in ranks if not 0 <= r < world_size]
            if bad:
                raise ValueError(f"ranks_captured {bad} are outside [0, world_size={world_size})")
            extra_d = _check_json_dict("extra", extra if extra is not None else {})
            for name, obj in (("topology", topology), ("groups", groups_n), ("extra", extra_d)):
                try:
                    json.dumps(obj, allow_nan=False)
                except (TypeError, ValueError) as e:
                    raise TypeError(f"{name} is not JSON-serializable: {e}") from e

            events = self._events_table()
            captured = set(ranks)
            event_ranks = set(pc.unique(events.column("rank")).to_pylist())
            stray = sorted((event_ranks | set(self._tensors)) - captured)
            if stray:
                raise ValueError(
                    f"ranks {stray} have events or tensors but are not in ranks_captured={ranks}"
                )
            if not allow_missing_tensors:
                self._check_tensor_refs(events)
            self._check_target()

            try:
                files = self._write_staging(events)
                manifest = Manifest(
                    format_version=FORMAT_VERSION,
                    created_unix=time.time(),
                    fingerprint=fingerprint,
                    versions=versions,
                    world_size=world_size,
                    topology=topology,
                    groups=groups_n,
                    ranks_captured=ranks,
                    files=files,
                    extra=extra_d,
                )
                _write_bytes_durable(
                    self.staging_dir / MANIFEST_NAME, (manifest.to_json() + "\n").encode("utf-8")
                )
                _fsync_dir(self.staging_dir)
                self._publish()
            except BaseException:
                self._abort_locked()
                raise
            self._state = "committed"
            self._release_memory()
            return manifest

    def _check_tensor_refs(self, events: pa.Table) -> None:
        keyed = events.filter(pc.is_valid(events.column("tensor_key")))
        if keyed.num_rows == 0:
            return
        missing: list[tuple[int, str]] = []
        for rank, key in zip(keyed.column("rank").to_pylist(), keyed.column("tensor_key").to_pylist()):
            if key not in self._tensors.get(rank, ()):
                missing.append((rank, key))
        if missing:
            shown = ", ".join(f"rank {r}: {k!r}" for r, k in missing[:5])
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"events reference tensors that were never added: {shown}{more}")

    def _write_staging(self, events: pa.Table) -> dict[str, str]:
        staging = self.staging_dir
        staging.mkdir(mode=0o755)
        written: list[str] = []

        pq.write_table(events, staging / EVENTS_NAME, compression="zstd")
        written.append(EVENTS_NAME)

        if self._tensors:
            (staging / TENSORS_DIR).mkdir()
            for rank in sorted(self._tensors):
                tensors = self._tensors[rank]
                if not tensors:
                    continue
                rel = tensor_file_name(rank)
                save_file(tensors, str(staging / rel), metadata={"format": "pt", "rank": str(rank)})
                written.append(rel)

        for rel, data in self._json.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append(rel)

        from concurrent.futures import ThreadPoolExecutor

        def seal(rel: str) -> str:
            _fsync_file(staging / rel)
            return _sha256_file(staging / rel)

        with ThreadPoolExecutor(min(8, len(written))) as pool:  # hashlib and fsync release the GIL
            files = dict(zip(written, pool.map(seal, written)))
        # what was just hashed needs no hashing at the first open
        _remember_verified(staging, {rel: _stamp(staging, rel, sha) for rel, sha in files.items()})
        dirs = {(staging / rel).parent for rel in written}
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(d)
        return files

    def _publish(self) -> None:
        final, staging, parent = self.final_dir, self.staging_dir, self.final_dir.parent
        if not final.exists():
            try:
                os.rename(staging, final)
                _fsync_dir(parent)
                return
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                self._check_target()  # appeared meanwhile: replace it like an existing trace

        if _rename_exchange(staging, final):
            # final now holds the new trace; the staging name holds the old one.
            _fsync_dir(parent)
            shutil.rmtree(staging, ignore_errors=True)
            return

        # Fallback without an atomic swap: set the old trace aside, move the new one in.
        aside = parent / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(final, aside)
        try:
            os.rename(staging, final)
        except BaseException:
            os.rename(aside, final)
            raise
        _fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)

    # -- discarding ------------------------------------------------------------------

    def _release_memory(self) -> None:
        self._tables = []
        self._tensors = {}
        self._json = {}

    def _abort_locked(self) -> None:
        if self._state == "committed":
            return
        if self.staging_dir.exists() or self.staging_dir.is_symlink():
            shutil.rmtree(self.staging_dir, ignore_errors=True)
        self._state = "aborted"
        self._release_memory()

    def abort(self) -> None:
        """Discard everything and remove the staging directory.  Idempotent; a no-op after commit."""
        with self._lock:
            self._abort_locked()


# --------------------------------------------------------------------------- reader


class TraceReader:
    """Read-only access to a committed PrismTrace.

    Opening validates the manifest; with ``verify=True`` every listed file is also
    checked against its sha256 (with ``verify=False`` only their presence) — except files
    unchanged since an earlier open found them intact (:data:`VERIFIED_NAME`).
    """

    def __init__(self, path: str | Path, *, verify: bool = True, hint: str | None = None) -> None:
        self.path = Path(path)
        self.hint = hint
        if is_staging_name(self.path.name):
            raise TraceMissingError(
                self.path, hint=hint, reason="this is an unfinished staging directory of a trace writer"
            )
        if not self.path.exists():
            raise TraceMissingError(self.path, hint=hint, reason="directory does not exist")
        if not self.path.is_dir():
            raise TraceMissingError(self.path, hint=hint, reason="not a directory")
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise TraceMissingError(self.path, hint=hint, reason=f"no {MANIFEST_NAME} found")
        try:
            raw = json.loads(manifest_path.read_bytes())
        except (OSError, ValueError) as e:
            raise TraceCorruptError(self.path, MANIFEST_NAME, None, None, reason=f"unreadable manifest: {e}") from e
        if not isinstance(raw, dict):
            raise TraceCorruptError(self.path, MANIFEST_NAME, None, None, reason="manifest is not a JSON object")
        version = raw.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version != FORMAT_VERSION:
            raise TraceVersionError(self.path, version, FORMAT_VERSION)
        try:
            self.manifest = Manifest.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise TraceCorruptError(self.path, MANIFEST_NAME, None, None, reason=f"invalid manifest: {e}") from e
        if EVENTS_NAME not in self.manifest.files:
            raise TraceCorruptError(self.path, EVENTS_NAME, None, None, reason="not listed in the manifest")
        for rel, expected in self.manifest.files.items():
            try:
                if _safe_relpath(rel) != rel or rel == MANIFEST_NAME:
                    raise ValueError(rel)
            except ValueError:
                raise TraceCorruptError(
                    self.path, rel, None, None, reason="manifest lists a file outside the trace"
                ) from None
            file_path = self.path / rel
            if not file_path.is_file():
                raise TraceCorruptError(self.path, rel, expected, None, reason="file listed in the manifest is missing")
        if verify:
            _verify_files(self.path, self.manifest.files)

        self._lock = threading.Lock()
        self._events: pa.Table | None = None
        self._rank_slices: dict[int, tuple[int, int]] | None = None
        self._sorted_events: pa.Table | None = None
        self._handles: dict[int, Any] = {}
        self._keys: dict[int, frozenset[str]] = {}
        self._views: dict[int, tuple[torch.Tensor, dict] | None] = {}

    def __repr__(self) -> str:
        return f"TraceReader({str(self.path)!r}, world_size={self.manifest.world_size})"

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop cached tables and tensor-file handles."""
        with self._lock:
            for h in self._handles.values():
                if h is not None and hasattr(h, "__exit__"):
                    try:
                        h.__exit__(None, None, None)
                    except Exception:
                        pass
            self._handles.clear()
            self._keys.clear()
            self._events = None
            self._sorted_events = None
            self._rank_slices = None

    # -- events ----------------------------------------------------------------------

    def events(self) -> pa.Table:
        """All events of all captured ranks (``EVENT_SCHEMA``)."""
        with self._lock:
            if self._events is None:
                path = self.path / EVENTS_NAME
                try:
                    table = pq.read_table(path)
                except (OSError, pa.ArrowException) as e:
                    raise TraceCorruptError(
                        self.path, EVENTS_NAME, None, None, reason=f"unreadable parquet: {e}"
                    ) from e
                if table.column_names != list(_EVENT_FIELDS):
                    raise TraceCorruptError(
                        self.path,
                        EVENTS_NAME,
                        None,
                        None,
                        reason=f"columns {table.column_names} differ from the event schema {list(_EVENT_FIELDS)}",
                    )
                if not table.schema.equals(EVENT_SCHEMA):
                    try:
                        table = _conform_table(table)
                    except ValueError as e:
                        raise TraceCorruptError(self.path, EVENTS_NAME, None, None, reason=str(e)) from e
                self._events = table
            return self._events

    def _rank_index(self) -> tuple[pa.Table, dict[int, tuple[int, int]]]:
        table = self.events()
        with self._lock:
            if self._rank_slices is None or self._sorted_events is None:
                srt = table.sort_by([("rank", "ascending"), ("idx", "ascending")]).combine_chunks()
                slices: dict[int, tuple[int, int]] = {}
                if srt.num_rows:
                    runs = pc.run_end_encode(srt.column("rank").combine_chunks())
                    start = 0
                    for rank, end in zip(runs.values.to_pylist(), runs.run_ends.to_pylist()):
                        slices[rank] = (start, end)
                        start = end
                self._sorted_events = srt
                self._rank_slices = slices
            return self._sorted_events, self._rank_slices

    def events_for_rank(self, rank: int) -> list[dict[str, Any]]:
        """Events of ``rank`` as dicts, sorted by ``idx`` (empty if the rank has none)."""
        srt, slices = self._rank_index()
        span = slices.get(int(rank))
        if span is None:
            return []
        start, end = span
        return srt.slice(start, end - start).to_pylist()

    # -- tensors ---------------------------------------------------------------------

    def _open_rank(self, rank: int) -> tuple[Any, frozenset[str]]:
        with self._lock:
            if rank in self._keys:
                return self._handles.get(rank), self._keys[rank]
            rel = tensor_file_name(rank)
            if rel not in self.manifest.files:
                handle, keys = None, frozenset()
            else:
                try:
                    handle = safe_open(str(self.path / rel), framework="pt", device="cpu")
                    keys = frozenset(handle.keys())
                except Exception as e:  # safetensors raises its own error types
                    raise TraceCorruptError(
                        self.path, rel, None, None, reason=f"unreadable safetensors file: {e}"
                    ) from e
            self._handles[rank] = handle
            self._keys[rank] = keys
            return handle, keys

    def has_tensor(self, rank: int, key: str) -> bool:
        _, keys = self._open_rank(int(rank))
        return key in keys

    def tensor_keys(self, rank: int) -> frozenset[str]:
        """Keys of all tensors stored for ``rank``."""
        return self._open_rank(int(rank))[1]

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        """Load tensor ``key`` of ``rank``; raises ``TraceKeyError`` (a ``KeyError``) if absent."""
        rank = int(rank)
        handle, keys = self._open_rank(rank)
        if key not in keys:
            if handle is None:
                detail = "that rank stored no tensors"
            else:
                detail = f"that rank stored {len(keys)} other tensors"
            raise TraceKeyError(
                f"no tensor {key!r} for rank {rank} in PrismTrace {self.path} ({detail}); "
                f"re-capture the trace if the job changed since it was recorded"
            )
        try:
            return handle.get_tensor(key)
        except Exception as e:
            raise TraceCorruptError(
                self.path, tensor_file_name(rank), None, None, reason=f"cannot read tensor {key!r}: {e}"
            ) from e

    def tensor_view(self, rank: int, key: str) -> torch.Tensor:
        """Tensor ``key`` of ``rank`` as a view of the file's pages (copy-on-write mapping; no
        read until used), for readers that copy it elsewhere anyway (the device data path's
        prefetcher); a copy when the tensor's bytes are not aligned for its dtype."""
        rank = int(rank)
        layout = self._layout(rank)
        entry = layout[1].get(key) if layout is not None else None
        if entry is None:
            return self.tensor(rank, key)
        buf, _ = layout
        dtype, shape, (begin, end) = entry
        if begin % dtype.itemsize:
            return self.tensor(rank, key)
        flat = buf[begin:end]
        return flat.view(dtype).reshape(shape) if end > begin else torch.empty(shape, dtype=dtype)

    def _layout(self, rank: int) -> tuple[torch.Tensor, dict] | None:
        """The rank's safetensors file mapped into memory and its header: key -> (dtype, shape,
        byte range from the start of the mapping)."""
        import mmap

        with self._lock:
            hit = self._views.get(rank, False)
            if hit is not False:
                return hit
            rel = tensor_file_name(rank)
            layout = None
            if rel in self.manifest.files:
                with open(self.path / rel, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size:
                        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                        (n,) = __import__("struct").unpack("<Q", mm[:8])
                        header = json.loads(mm[8:8 + n])
                        buf = torch.frombuffer(mm, dtype=torch.uint8)
                        base = 8 + n
                        layout = (buf, {k: (_SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"]),
                                            (base + v["data_offsets"][0], base + v["data_offsets"][1]))
                                        for k, v in header.items() if k != "__metadata__"})
            self._views[rank] = layout
            return layout

    def tensor_meta(self, rank: int, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of tensor ``key`` of ``rank``, without reading its data."""
        rank = int(rank)
        handle, keys = self._open_rank(rank)
        if key not in keys:
            raise TraceKeyError(f"no tensor {key!r} for rank {rank} in PrismTrace {self.path}")
        piece = handle.get_slice(key)
        return tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()]

    # -- json ------------------------------------------------------------------------

    def json_files(self) -> list[str]:
        """Names of the caller-added JSON files."""
        return sorted(rel for rel in self.manifest.files if not _is_reserved(rel))

    def read_json(self, name: str) -> Any:
        rel = _safe_relpath(name)
        if _is_reserved(rel) or rel not in self.manifest.files:
            raise TraceKeyError(
                f"no JSON file {name!r} in PrismTrace {self.path}; it has {self.json_files()}"
            )
        try:
            return json.loads((self.path / rel).read_bytes())
        except (OSError, ValueError) as e:
            raise TraceCorruptError(self.path, rel, None, None, reason=f"unreadable JSON: {e}") from e


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
