"""Reading a committed PrismTrace: :class:`TraceReader` validates the manifest and the files it
lists (their sums through :mod:`.checksums`) at open, then serves the events (whole, or per
rank), the tensors (:mod:`.tensors`; in format 2 each (rank, key) resolved through the
index to the spill file and content address it is stored under, :mod:`.spill`, so one stored
tensor serves every rank and key that recorded it) and the caller-added JSON files, each
read lazily and kept until :meth:`~TraceReader.close`. Format 1 traces (a file per rank)
are read too."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from .checksums import verify_files
from .durable import is_staging_name
from .errors import TraceCorruptError, TraceKeyError, TraceMissingError, TraceVersionError
from .layout import (
    EVENTS_NAME,
    MANIFEST_NAME,
    TENSOR_INDEX_NAME,
    TENSORS_DIR,
    TraceLayout,
    is_reserved,
    safe_relpath,
    tensor_file_name,
)
from .manifest import Manifest
from .schema import EVENT_FIELDS, EVENT_SCHEMA, READABLE_VERSIONS, conform_table, footer_size, sorted_by_rank
from .signing import Authorship, TraceUnsafeError, authorship
from .spill import read_index
from .tensors import TensorFile

__all__ = ["TraceReader"]


class TraceReader:
    """Read-only access to a committed PrismTrace.

    Opening validates the manifest; with ``verify=True`` every listed file is also
    checked against its sha256 (with ``verify=False`` only their presence) — except files
    unchanged since an earlier open found them intact (:mod:`.checksums`).
    """

    def __init__(self, path: str | Path, *, verify: bool = True, hint: str | None = None) -> None:
        self.path = Path(path)
        self.hint = hint
        layout = TraceLayout(self.path)
        if is_staging_name(self.path.name):
            raise TraceMissingError(
                self.path, hint=hint, reason="this is an unfinished staging directory of a trace writer"
            )
        if not self.path.exists():
            raise TraceMissingError(self.path, hint=hint, reason="directory does not exist")
        if not self.path.is_dir():
            raise TraceMissingError(self.path, hint=hint, reason="not a directory")
        if not layout.manifest.is_file():
            raise TraceMissingError(self.path, hint=hint, reason=f"no {MANIFEST_NAME} found")
        self._check_private(".", MANIFEST_NAME)
        self.manifest = self._read_manifest(layout.manifest)
        if EVENTS_NAME not in self.manifest.files:
            raise TraceCorruptError(self.path, EVENTS_NAME, None, None, reason="not listed in the manifest")
        for rel, expected in self.manifest.files.items():
            try:
                if safe_relpath(rel) != rel or rel == MANIFEST_NAME:
                    raise ValueError(rel)
            except ValueError:
                raise TraceCorruptError(
                    self.path, rel, None, None, reason="manifest lists a file outside the trace"
                ) from None
            if not (self.path / rel).is_file():
                raise TraceCorruptError(self.path, rel, expected, None, reason="file listed in the manifest is missing")
        self._check_private(*self.manifest.files)
        if verify:
            verify_files(self.path, self.manifest.files)

        self._layout = layout
        self._lock = threading.Lock()
        self._events: pa.Table | None = None
        self._rank_slices: dict[int, tuple[int, int]] | None = None
        self._sorted_events: pa.Table | None = None
        self._files: dict[str, TensorFile] = {}
        self._index: dict[int, dict[str, tuple[str, str]]] | None = None
        """rank -> key -> (tensor file, name in it)."""
        self._authorship: Authorship | None = None

    def _check_private(self, *rels: str) -> None:
        """Refuse a trace another user could change: each of ``rels`` (and each folder from the
        trace's root down to it) must be this user's and writable by no one else, no link
        among them (:mod:`prism_launch.config.private_dirs`)."""
        from prism_launch.config.private_dirs import UnsafePathError, check_private

        hint = (f"Copy the trace to a folder of your own (cp -r {self.path} ...; the copy is then yours), or "
                f"`chmod -R go-w {self.path}` if it is yours.")
        checked: set[str] = set()
        for rel in rels:
            parts = Path(rel).parts
            levels = [Path(*parts[:i]) for i in range(len(parts))] + [Path(rel)]
            for i, level in enumerate(levels):
                key = str(level)
                if key in checked:
                    continue
                checked.add(key)
                try:
                    check_private(self.path / level, directory=i < len(levels) - 1 or rel == ".", hint=hint)
                except UnsafePathError as e:
                    raise TraceUnsafeError(f"PrismTrace {self.path} is refused: {e}") from None

    def authorship(self) -> Authorship:
        """Whether this trace is signed by this user (:mod:`.signing`): ``signed`` traces are
        replayed as they are; ``unsigned`` and ``foreign`` ones unpickle their object payloads
        through an allow-list unless ``trace.trusted=true``."""
        if self._authorship is None:
            self._authorship = authorship(self.path, self.manifest)
        return self._authorship

    def _read_manifest(self, manifest_path: Path) -> Manifest:
        try:
            raw = json.loads(manifest_path.read_bytes())
        except (OSError, ValueError) as e:
            raise TraceCorruptError(self.path, MANIFEST_NAME, None, None, reason=f"unreadable manifest: {e}") from e
        if not isinstance(raw, dict):
            raise TraceCorruptError(self.path, MANIFEST_NAME, None, None, reason="manifest is not a JSON object")
        version = raw.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
            raise TraceVersionError(self.path, version, READABLE_VERSIONS)
        try:
            return Manifest.from_dict(raw)
        except (TypeError, ValueError) as e:
            raise TraceCorruptError(self.path, MANIFEST_NAME, None, None, reason=f"invalid manifest: {e}") from e

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
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._index = None
            self._events = None
            self._sorted_events = None
            self._rank_slices = None

    # -- events ----------------------------------------------------------------------

    def events(self) -> pa.Table:
        """All events of all captured ranks (``EVENT_SCHEMA``)."""
        with self._lock:
            if self._events is None:
                self._check_event_footer()
                try:
                    table = pq.read_table(self._layout.events)
                except (OSError, pa.ArrowException) as e:
                    raise TraceCorruptError(
                        self.path, EVENTS_NAME, None, None, reason=f"unreadable parquet: {e}"
                    ) from e
                if table.column_names != list(EVENT_FIELDS):
                    raise TraceCorruptError(
                        self.path,
                        EVENTS_NAME,
                        None,
                        None,
                        reason=f"columns {table.column_names} differ from the event schema {list(EVENT_FIELDS)}",
                    )
                if not table.schema.equals(EVENT_SCHEMA):
                    try:
                        table = conform_table(table)
                    except ValueError as e:
                        raise TraceCorruptError(self.path, EVENTS_NAME, None, None, reason=str(e)) from e
                self._events = table
            return self._events

    def _check_event_footer(self) -> None:
        """The events file's size from its footer, checked before it is read whole: the rows and
        uncompressed bytes the manifest recorded, the schema's column count, and no more bytes
        than this machine has memory (a file made to inflate beyond it is refused, not read)."""
        try:
            rows, nbytes, columns = footer_size(self._layout.events)
        except (OSError, pa.ArrowException) as e:
            raise TraceCorruptError(self.path, EVENTS_NAME, None, None, reason=f"unreadable parquet footer: {e}") from e
        m = self.manifest
        wrong = []
        if columns != len(EVENT_FIELDS):
            wrong.append(f"{columns} columns, the event schema has {len(EVENT_FIELDS)}")
        if m.event_rows is not None and rows != m.event_rows:
            wrong.append(f"{rows} rows, the manifest recorded {m.event_rows}")
        if m.event_bytes is not None and nbytes != m.event_bytes:
            wrong.append(f"{nbytes} uncompressed bytes, the manifest recorded {m.event_bytes}")
        memory = _physical_memory()
        if memory and nbytes > memory:
            wrong.append(f"{nbytes} uncompressed bytes, more than this machine's {memory} bytes of memory")
        if wrong:
            raise TraceCorruptError(self.path, EVENTS_NAME, None, None,
                                    reason="its footer says " + "; ".join(wrong) + " (not read)")

    def _rank_index(self) -> tuple[pa.Table, dict[int, tuple[int, int]]]:
        table = self.events()
        with self._lock:
            if self._rank_slices is None or self._sorted_events is None:
                srt = sorted_by_rank(table)
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

    def _open(self, rel: str) -> TensorFile:
        """The open tensor file ``rel`` (caller holds the lock)."""
        f = self._files.get(rel)
        if f is None:
            try:
                f = self._files[rel] = TensorFile(self.path / rel)
            except Exception as e:  # safetensors raises its own error types
                raise TraceCorruptError(self.path, rel, None, None, reason=f"unreadable safetensors file: {e}") from e
        return f

    def _keys(self, rank: int) -> dict[str, tuple[str, str]]:
        """Where each tensor of ``rank`` is stored: key -> (tensor file, name in it)."""
        with self._lock:
            if self._index is None:
                if TENSOR_INDEX_NAME in self.manifest.files:
                    try:
                        self._index = read_index(self._layout)
                    except (OSError, pa.ArrowException) as e:
                        raise TraceCorruptError(self.path, TENSOR_INDEX_NAME, None, None,
                                                reason=f"unreadable tensor index: {e}") from e
                else:  # format 1 (a file per rank), or no tensors at all
                    self._index = {}
                    for rel in self.manifest.files:
                        name = rel.removeprefix(TENSORS_DIR + "/rank").removesuffix(".safetensors")
                        if rel.startswith(TENSORS_DIR + "/rank") and name.isdigit() and tensor_file_name(int(name)) == rel:
                            self._index[int(name)] = {k: (rel, k) for k in self._open(rel).keys}
            return self._index.get(rank, {})

    def _locate(self, rank: int, key: str) -> tuple[TensorFile, str, str]:
        where = self._keys(rank).get(key)
        if where is None:
            n = len(self._keys(rank))
            detail = f"that rank stored {n} other tensors" if n else "that rank stored no tensors"
            raise TraceKeyError(
                f"no tensor {key!r} for rank {rank} in PrismTrace {self.path} ({detail}); "
                f"re-capture the trace if the job changed since it was recorded"
            )
        rel, name = where
        with self._lock:
            f = self._open(rel)
        if name not in f.keys:
            raise TraceCorruptError(self.path, rel, None, None,
                                    reason=f"the index places tensor {key!r} of rank {rank} here as {name!r}, "
                                           "which the file does not hold")
        return f, rel, name

    def tensor_keys(self, rank: int) -> frozenset[str]:
        """Keys of all tensors stored for ``rank``."""
        return frozenset(self._keys(int(rank)))

    def has_tensor(self, rank: int, key: str) -> bool:
        return key in self._keys(int(rank))

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        """Load tensor ``key`` of ``rank``; raises ``TraceKeyError`` (a ``KeyError``) if absent.

        The tensor is a view of the file's copy-on-write mapped pages (see :mod:`.tensors`):
        read when used, and changing it never changes the trace. Keys stored under one
        content address return views of the same stored tensor."""
        f, rel, name = self._locate(int(rank), key)
        try:
            return f.get(name)
        except Exception as e:
            raise TraceCorruptError(self.path, rel, None, None, reason=f"cannot read tensor {key!r}: {e}") from e

    def tensor_view(self, rank: int, key: str) -> torch.Tensor:
        """Tensor ``key`` of ``rank`` as a view of the file's pages (copy-on-write mapping; read
        when used), for readers that copy it elsewhere anyway (the device data path's
        prefetcher). Every tensor the reader returns is such a view; this name says that the
        caller relies on it."""
        return self.tensor(rank, key)

    def tensor_meta(self, rank: int, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of tensor ``key`` of ``rank``, without reading its data."""
        f, _rel, name = self._locate(int(rank), key)
        return f.meta(name)

    # -- json ------------------------------------------------------------------------

    def json_files(self) -> list[str]:
        """Names of the caller-added JSON files."""
        return sorted(rel for rel in self.manifest.files if not is_reserved(rel))

    def read_json(self, name: str) -> Any:
        rel = safe_relpath(name)
        if is_reserved(rel) or rel not in self.manifest.files:
            raise TraceKeyError(
                f"no JSON file {name!r} in PrismTrace {self.path}; it has {self.json_files()}"
            )
        try:
            return json.loads((self.path / rel).read_bytes())
        except (OSError, ValueError) as e:
            raise TraceCorruptError(self.path, rel, None, None, reason=f"unreadable JSON: {e}") from e


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
