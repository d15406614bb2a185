"""The tensors of a trace as they are recorded: :class:`TensorSpill` takes each (rank, key,
tensor) while the capture runs, stores every distinct tensor once (content address: sha256
of dtype, shape and bytes — data-parallel replicas' equal results, repeated broadcasts, a
folded group's result kept for each captured member) and writes them out in spill files
(``tensors/blobNNNNNN.safetensors``, tensors named by their address) into the writer's
staging directory whenever the bytes waiting reach ``spill_bytes``. The launcher thus holds
at most ``spill_bytes`` plus one op's tensors, however many steps the capture runs.
:meth:`~TensorSpill.close` writes the last spill file and the index
(``tensors/index.parquet``: rank, key, spill file, address) that the reader resolves keys
through.

Each spill file's sha256 is taken from the bytes written, so sealing the trace only fsyncs it.
Compression was measured and left out (the floating-point payloads of the bundled recipes
shrink by under 10% at zlib level 1, and a compressed file could not be mapped zero-copy
by the reader and the device data path's host tier). A spill file is written straight from
the tensors' memory (:func:`safetensors_parts`), so writing it needs no second copy."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from prism_launch.errors import SpillHashError

from .errors import TraceSpaceError
from .layout import TENSOR_INDEX_NAME, TraceLayout, tensor_blob_name
from .space import free_bytes, is_no_space, needed_bytes
from .tensors import DTYPE_NAMES

__all__ = ["TensorSpill", "INDEX_SCHEMA", "content_address", "storable"]

SPILL_BYTES = 64 << 20
"""Default bytes of distinct tensors held before they are written out."""

INDEX_SCHEMA = pa.schema([
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("key", pa.string(), nullable=False),
    pa.field("file", pa.int32(), nullable=False),
    pa.field("name", pa.string(), nullable=False),
])
"""``tensors/index.parquet``: tensor ``key`` of ``rank`` is tensor ``name`` of spill file ``file``."""


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def storable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a spill file stores it: a view is copied (to keep neither its base alive nor
    storage shared within a spill file)."""
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def content_address(t: torch.Tensor) -> str:
    """128 bits of the sha256 of a (CPU, contiguous) tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(_bytes(t))
    return h.hexdigest()[:32]


class TensorSpill:
    """Content-addressed, streaming store of one trace's tensors under ``root`` (the staging
    directory). Not thread-safe: the writer's lock (or the coordinator's single thread)
    serializes calls."""

    def __init__(self, root: Path, *, spill_bytes: int = SPILL_BYTES, space_path: Path | None = None) -> None:
        self.root = Path(root)
        self.spill_bytes = int(spill_bytes)
        self.space_path = Path(space_path) if space_path is not None else self.root.parent
        self._where: dict[str, tuple[int, str]] = {}
        """Content address -> (spill file, name) of every distinct tensor stored so far."""
        self._pending: dict[str, torch.Tensor] = {}
        self._keys: dict[int, dict[str, str]] = {}
        """rank -> key -> content address."""
        self.pending_bytes = 0
        self.peak_pending_bytes = 0
        self.logical_bytes = 0
        """Bytes of every tensor put (what a store without deduplication holds)."""
        self.stored_bytes = 0
        """Bytes of the distinct tensors (what is written)."""
        self.sums: dict[str, str] = {}
        """sha256 of every file written (relative path -> hex)."""
        self._files = 0
        self._closed = False

    def ranks(self) -> list[int]:
        return [r for r, k in self._keys.items() if k]

    def has(self, rank: int, key: str) -> bool:
        return key in self._keys.get(rank, ())

    def put(self, rank: int, key: str, tensor: torch.Tensor, addr: str | None = None) -> None:
        """Record ``tensor`` (on the CPU, not changed afterwards: it is written later without a
        copy, unless it is a view) as ``key`` of ``rank``; a key already recorded raises ``ValueError``.
        ``addr``: its :func:`content_address`, where the caller took it already (of a tensor
        :func:`storable` returned)."""
        keys = self._keys.setdefault(rank, {})
        if key in keys:
            raise ValueError(f"rank {rank} already has a tensor with key {key!r} in this trace")
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor {key!r} of rank {rank} must be a CPU tensor")
        if addr is None:
            tensor = storable(tensor)
            addr = content_address(tensor)
        keys[key] = addr
        nbytes = tensor.numel() * tensor.element_size()
        self.logical_bytes += nbytes
        if addr in self._where or addr in self._pending:
            return
        self._pending[addr] = tensor
        self.stored_bytes += nbytes
        self.pending_bytes += nbytes
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
        if self.pending_bytes >= self.spill_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the tensors waiting into the next spill file."""
        if not self._pending:
            return
        n = self._files
        rel = tensor_blob_name(n)
        self._write(rel, safetensors_parts(self._pending))
        for addr in self._pending:
            self._where[addr] = (n, addr)
        self._files += 1
        self._pending = {}
        self.pending_bytes = 0

    def _write(self, rel: str, parts: list) -> None:
        """Write ``parts`` (bytes-like, in order) to ``rel``, hashing them as they go: no copy
        of the tensors is made, so a flush needs no memory beyond what waits."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        # the file's hash on a thread of its own, beside the writes (both release the interpreter)
        hashing = _Hashing(rel, parts)
        try:
            with open(path, "wb") as f:
                for part in parts:
                    f.write(part)
        except BaseException as e:
            hashing.join(raise_late=False)
            if isinstance(e, OSError) and is_no_space(e):
                raise TraceSpaceError(self.space_path, needed_bytes(hashing.nbytes + self.pending_bytes),
                                      free_bytes(self.space_path), during=True) from None
            raise
        self.sums[rel] = hashing.join()

    def close(self) -> list[str]:
        """Write what is waiting and the index; returns the files written (relative paths)."""
        if not self._closed:
            self.flush()
            ranks, keys, files, names = [], [], [], []
            for rank in sorted(self._keys):
                for key, addr in self._keys[rank].items():
                    f, name = self._where[addr]
                    ranks.append(rank), keys.append(key), files.append(f), names.append(name)
            if ranks:
                table = pa.table([ranks, keys, files, names], schema=INDEX_SCHEMA)
                sink = pa.BufferOutputStream()
                pq.write_table(table, sink, compression="zstd")
                self._write(TENSOR_INDEX_NAME, [sink.getvalue().to_pybytes()])
            self._closed = True
            self._pending = {}
        return list(self.sums)

    def discard(self) -> None:
        """Forget what is waiting (the writer removes the staging directory)."""
        self._pending = {}
        self.pending_bytes = 0
        self._closed = True


HASH_BYTES_PER_S = 20 << 20
"""The slowest a spill file's sha256 is allowed to run (it runs at several hundred MiB/s on one
core): with :data:`HASH_FLOOR_S`, what bounds the wait for it."""

HASH_FLOOR_S = 60.0


class _Hashing:
    """The sha256 of a spill file's parts, taken on a thread of its own while they are written;
    :meth:`join` waits for it at most ``HASH_FLOOR_S`` plus a second per ``HASH_BYTES_PER_S``.
    It reads memory only, so a longer wait is a launcher starved of CPU (or stopped), which is
    said rather than waited out."""

    def __init__(self, rel: str, parts: list):
        self.rel, self.parts = rel, parts
        self.nbytes = sum(memoryview(p).nbytes for p in parts)
        self.error: BaseException | None = None
        self._h = hashlib.sha256()
        self._thread = threading.Thread(target=self._run, name="prism-spill-sum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for part in self.parts:
                self._h.update(part)
        except BaseException as e:  # noqa: BLE001 - raised by join()
            self.error = e

    def bound_s(self) -> float:
        return HASH_FLOOR_S + self.nbytes / HASH_BYTES_PER_S

    def join(self, raise_late: bool = True) -> str:
        """The hex digest, once the thread ended (``raise_late=False``: wait as long, return
        whatever there is; the caller is raising its own error)."""
        bound = self.bound_s()
        self._thread.join(bound)
        if raise_late and self._thread.is_alive():
            raise SpillHashError(
                f"the sha256 of spill file {self.rel} ({self.nbytes / 2**20:.1f} MiB, read from memory) did not "
                f"finish within {bound:.1f} s: the launcher is starved of CPU or stopped; give it a core of its own")
        if raise_late and self.error is not None:
            raise SpillHashError(f"taking the sha256 of spill file {self.rel} failed: {self.error}") from self.error
        return self._h.hexdigest()


def safetensors_parts(tensors: dict[str, torch.Tensor]) -> list:
    """A safetensors file of ``tensors`` (contiguous CPU) as its pieces: the length, the JSON
    header (padded to 8 bytes) and each tensor's own bytes, largest elements first so every
    tensor starts at an offset aligned for its dtype, as the library's own writer places them
    (format as of safetensors 0.4-0.6: little-endian u64 header size, then the header)."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)), text, *(_bytes(tensors[name]) for name in order)]


def read_index(layout: TraceLayout) -> dict[int, dict[str, tuple[str, str]]]:
    """rank -> key -> (spill file relative path, name in it), from a trace's index."""
    table = pq.read_table(layout.root / TENSOR_INDEX_NAME)
    out: dict[int, dict[str, tuple[str, str]]] = {}
    for rank, key, f, name in zip(*(table.column(c).to_pylist() for c in ("rank", "key", "file", "name"))):
        out.setdefault(rank, {})[key] = (tensor_blob_name(f), name)
    return out

