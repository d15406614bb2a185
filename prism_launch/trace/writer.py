"""Writing a PrismTrace: :class:`TraceWriter` takes events, tensors and JSON files; tensors go
to disk as they come (:mod:`.spill`: content-addressed spill files in a hidden staging
directory beside the trace, :mod:`.durable`), the rest waits in memory. On
:meth:`~TraceWriter.commit` the writer adds the events, the JSON files and the tensor index,
seals every file with its sha256 (:mod:`.checksums`), writes the manifest last and swaps the
directory into place, so a reader sees either the previous complete trace or the new
complete one, never a half-written directory (a staging directory left by a killed writer
has no manifest and a name readers refuse). Free space for what is still to write is
checked first, and a full disk while writing (``ENOSPC``) discards the staging directory and
raises :class:`~.errors.TraceSpaceError` (needed vs free, where)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from .checksums import seal_files
from .durable import fsync_dir, staging_path, swap_into_place, write_bytes_durable
from .errors import TraceError, TraceSpaceError
from .space import free_bytes, is_no_space, needed_bytes, require_space
from .layout import EVENTS_NAME, MANIFEST_NAME, TraceLayout, is_reserved, safe_relpath
from .manifest import Manifest, manifest_fields
from .schema import EVENT_SCHEMA, FORMAT_VERSION, check_kinds, conform_table, footer_size, rows_to_table, sorted_by_rank
from .signing import sign
from .spill import SPILL_BYTES, TensorSpill
from .tensors import snapshot_tensors

__all__ = ["TraceWriter"]


class TraceWriter:
    """Builds a PrismTrace and publishes it atomically at ``final_dir`` on :meth:`commit`.

    Tensors are written into a hidden staging directory beside ``final_dir`` as soon as
    ``spill_bytes`` of distinct ones wait; events and JSON files are held in memory until
    :meth:`commit`, which writes them there too and then swaps the directory into place.
    Used as a context manager, an exception (or leaving the block without committing)
    discards everything.
    """

    def __init__(self, final_dir: str | Path, *, spill_bytes: int = SPILL_BYTES) -> None:
        self.final_dir = Path(os.path.abspath(os.fspath(final_dir)))
        if not self.final_dir.name:
            raise ValueError(f"cannot write a PrismTrace at {final_dir!r}: it has no directory name")
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        self._check_target()
        self.staging_dir = staging_path(self.final_dir)
        self._tables: list[pa.Table] = []
        self._spill_bytes = spill_bytes
        self._spill: TensorSpill | None = None
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
            table = conform_table(rows)
        else:
            table = rows_to_table(rows)
        check_kinds(table)
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
        rank, staged = snapshot_tensors(rank, tensors)
        with self._lock:
            self._require_open()
            spill = self._spill_locked()
            dup = sorted(k for k in staged if spill.has(rank, k))
            if dup:
                raise ValueError(f"rank {rank} already has tensors with keys {dup} in this trace")
            for key, t in staged.items():
                spill.put(rank, key, t)

    def record_tensor(self, rank: int, key: str, tensor: torch.Tensor, addr: str | None = None) -> None:
        """Store one tensor of ``rank`` without copying it: it must be a CPU tensor the caller
        never changes (the capture coordinator's received and computed tensors); ``addr``: its
        content address, taken by the caller (of a tensor :func:`~.spill.storable` returned)."""
        with self._lock:
            self._require_open()
            self._spill_locked().put(int(rank), key, tensor, addr)

    def tensor_stats(self) -> dict[str, int]:
        """Bytes put (``logical_bytes``), bytes of the distinct tensors (``stored_bytes``), the
        most waiting in memory at once (``peak_pending_bytes``) and now (``pending_bytes``)."""
        s = self._spill
        if s is None:
            return {"logical_bytes": 0, "stored_bytes": 0, "peak_pending_bytes": 0, "pending_bytes": 0}
        return {"logical_bytes": s.logical_bytes, "stored_bytes": s.stored_bytes,
                "peak_pending_bytes": s.peak_pending_bytes, "pending_bytes": s.pending_bytes}

    def _spill_locked(self) -> TensorSpill:
        if self._spill is None:
            self.staging_dir.mkdir(mode=0o755)
            self._spill = TensorSpill(self.staging_dir, spill_bytes=self._spill_bytes, space_path=self.final_dir.parent)
        return self._spill

    def write_json(self, name: str, obj: Any) -> None:
        """Add a JSON file ``name`` (relative path) to the trace; it is checksummed like the rest."""
        self._require_open()
        rel = safe_relpath(name)
        if is_reserved(rel):
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
        if TraceLayout(final).manifest.is_file():
            return
        if any(final.iterdir()):
            raise TraceError(
                f"{final} exists, is not empty and is not a PrismTrace (no {MANIFEST_NAME}); refusing to "
                f"replace it. Remove it or choose another trace path."
            )

    def _events_table(self) -> pa.Table:
        table = pa.concat_tables(self._tables) if self._tables else EVENT_SCHEMA.empty_table()
        table = sorted_by_rank(table)
        if table.num_rows > 1:
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

        Argument problems raise ``TypeError``/``ValueError`` before anything more touches
        the disk and leave the writer open.  Too little free space and failures while
        writing abort the writer.
        """
        self._require_open()
        with self._lock:
            self._require_open()
            fields = manifest_fields(fingerprint, versions, world_size, topology, groups, ranks_captured, extra)
            ranks = fields["ranks_captured"]
            events = self._events_table()
            event_ranks = set(pc.unique(events.column("rank")).to_pylist())
            tensor_ranks = set(self._spill.ranks()) if self._spill is not None else set()
            stray = sorted((event_ranks | tensor_ranks) - set(ranks))
            if stray:
                raise ValueError(
                    f"ranks {stray} have events or tensors but are not in ranks_captured={ranks}"
                )
            if not allow_missing_tensors:
                self._check_tensor_refs(events)
            self._check_target()
            estimate = self.estimated_bytes(events)
            try:
                require_space(self.final_dir.parent, estimate)
            except TraceSpaceError:  # tensors may be spilled already: nothing of them is kept
                self._abort_locked()
                raise

            try:
                files = self._write_staging(events)
                staged = TraceLayout(self.staging_dir)
                rows, nbytes, _ = footer_size(staged.events)
                manifest = Manifest(format_version=FORMAT_VERSION, created_unix=time.time(), files=files,
                                    event_rows=rows, event_bytes=nbytes, **fields)
                write_bytes_durable(staged.manifest, (manifest.to_json() + "\n").encode("utf-8"))
                self._sign(manifest)
                _private_to_writer(self.staging_dir)
                fsync_dir(self.staging_dir)
                swap_into_place(self.staging_dir, self.final_dir, self._check_target)
            except BaseException as e:
                self._abort_locked()
                if is_no_space(e):  # the disk filled up beside the estimate: same message, nothing published
                    raise TraceSpaceError(self.final_dir, needed_bytes(estimate), free_bytes(self.final_dir.parent),
                                          during=True) from None
                raise
            self._state = "committed"
            self._release_memory()
            return manifest

    def _sign(self, manifest: Manifest) -> None:
        """Sign the manifest with this user's key (:mod:`.signing`); where no key can be kept,
        the trace stays unsigned (emulating it then restricts its object payloads) and says so."""
        try:
            sign(self.staging_dir, manifest)
        except (OSError, TraceError) as e:
            warnings.warn(f"PrismTrace {self.final_dir} is written unsigned ({e}); emulating it will unpickle its "
                          "object-collective payloads through an allow-list only (trace.trusted=true lifts it)",
                          RuntimeWarning, stacklevel=3)

    def estimated_bytes(self, events: pa.Table | None = None) -> int:
        """What the files still to write will take on disk, at most: tensors waiting as stored,
        events uncompressed (the tensors already spilled are on the disk)."""
        events = self._events_table() if events is None else events
        tensors = self._spill.pending_bytes if self._spill is not None else 0
        return tensors + events.nbytes + sum(len(b) for b in self._json.values())

    def _check_tensor_refs(self, events: pa.Table) -> None:
        keyed = events.filter(pc.is_valid(events.column("tensor_key")))
        if keyed.num_rows == 0:
            return
        missing: list[tuple[int, str]] = []
        for rank, key in zip(keyed.column("rank").to_pylist(), keyed.column("tensor_key").to_pylist()):
            if self._spill is None or not self._spill.has(rank, key):
                missing.append((rank, key))
        if missing:
            shown = ", ".join(f"rank {r}: {k!r}" for r, k in missing[:5])
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"events reference tensors that were never added: {shown}{more}")

    def _write_staging(self, events: pa.Table) -> dict[str, str]:
        """Write every file but the manifest into the staging directory; returns their sums."""
        staging = self.staging_dir
        staged = TraceLayout(staging)
        staging.mkdir(mode=0o755, exist_ok=self._spill is not None)
        written: list[str] = []

        pq.write_table(events, staged.events, compression="zstd")
        written.append(EVENTS_NAME)

        sums: dict[str, str] = {}
        if self._spill is not None:
            written += self._spill.close()
            sums = self._spill.sums

        for rel, data in self._json.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append(rel)

        files = seal_files(staging, written, sums=sums)
        dirs = {(staging / rel).parent for rel in written}
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        return files

    # -- discarding ------------------------------------------------------------------

    def _release_memory(self) -> None:
        self._tables = []
        if self._spill is not None:
            self._spill.discard()
        self._spill = None
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


def _private_to_writer(root: Path) -> None:
    """Take the group and world write bits off every folder and file of the trace: a reader
    refuses a trace that someone else could change (:class:`~.reader.TraceReader`), whatever
    the writer's umask was."""
    for dirpath, _dirs, names in os.walk(root):
        for p in (dirpath, *(os.path.join(dirpath, n) for n in names)):
            mode = os.lstat(p).st_mode
            if mode & 0o022:
                os.chmod(p, mode & 0o7755)
