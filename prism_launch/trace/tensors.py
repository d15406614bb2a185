"""The tensor files of a trace (``tensors/rankNNNNNN.safetensors``, one per rank that added
tensors): taking a rank's tensors in (a private CPU copy of each), writing them, and reading
them back lazily, through the ``safetensors`` library alone.

Reading goes through :func:`safetensors.safe_open`: on the CPU it maps the whole file
copy-on-write once per open (``torch.UntypedStorage.from_file(shared=False)``, a private
mapping like ``mmap.ACCESS_COPY``), and ``get_tensor`` returns a zero-copy view of the mapped
pages. Building a view faults in only the page its data starts on (``torch.asarray``, through
which the library builds it, touches it); the rest is read when used, and writes to the
tensor never reach the file. Shapes and dtypes come from the header alone (``get_slice``).
The library's writer places every tensor at an offset aligned for its dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .manifest import is_intlike

__all__ = ["snapshot_tensors", "write_tensor_file", "TensorFile", "DTYPE_NAMES", "check_header"]

#: torch dtype of each safetensors dtype name a trace may hold.
_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: safetensors dtype name of each torch dtype a trace may hold.
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def snapshot_tensors(rank: int, tensors: Mapping[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
    """Check a rank's tensors and copy each (to CPU, contiguous) so later in-place changes by
    the caller do not reach the trace; returns the rank as an int and the copies."""
    if not is_intlike(rank) or int(rank) < 0:
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
    return rank, staged


def write_tensor_file(path: Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write one rank's tensors (as :func:`snapshot_tensors` returned them) to ``path``."""
    save_file(tensors, str(path), metadata={"format": "pt", "rank": str(rank)})


_HEADER_LIMIT = 100 << 20  # safetensors' own cap on a header (100 MB)


def check_header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Read and check a tensor file's header before anything of its data is mapped or
    allocated: each tensor's dtype is one a trace may hold, its shape non-negative integers,
    its data inside the file, and its stored bytes exactly numel × itemsize. Returns
    name -> (dtype name, shape, stored bytes); raises ``ValueError`` naming the tensor."""
    import json
    import math
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_HEADER_LIMIT, size - 8):
            raise ValueError(f"header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} is not one a trace holds")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} lie outside the file's {data} data bytes")
        stored = offsets[1] - offsets[0]
        expected = math.prod(shape) * _DTYPES[dtype].itemsize
        if stored != expected:
            raise ValueError(f"tensor {name!r}: shape {shape} of {dtype} is {expected} bytes, but {stored} are stored")
        out[name] = (dtype, tuple(shape), stored)
    return out


class TensorFile:
    """One open tensor file, its header checked first (:func:`check_header`); raises
    ``ValueError`` for a header that does not add up and whatever ``safetensors`` raises for a
    file it cannot read."""

    def __init__(self, path: Path) -> None:
        check_header(path)
        self._handle = safe_open(str(path), framework="pt", device="cpu")
        self.keys: frozenset[str] = frozenset(self._handle.keys())

    def get(self, key: str) -> torch.Tensor:
        """Tensor ``key``: a view of the file's copy-on-write mapped pages, read when used."""
        return self._handle.get_tensor(key)

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of tensor ``key``, from the header (no data is touched)."""
        piece = self._handle.get_slice(key)
        return tuple(piece.get_shape()), _DTYPES[piece.get_dtype()]

    def close(self) -> None:
        """Drop the handle; tensors already handed out keep the mapping alive."""
        try:
            self._handle.__exit__(None, None, None)
        except Exception:
            pass
