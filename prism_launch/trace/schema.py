"""The event table of a PrismTrace (``events.parquet``): its format version, fixed schema,
allowed kinds, required fields and defaults, and the turning of caller rows or tables into
a table of exactly that schema. Nothing here touches the disk."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "EVENT_SCHEMA",
    "EVENT_KINDS",
    "EVENT_REQUIRED_FIELDS",
    "EVENT_DEFAULTS",
    "EVENT_FIELDS",
    "rows_to_table",
    "conform_table",
    "check_kinds",
    "sorted_by_rank",
]

FORMAT_VERSION = 2
"""2: tensors in content-addressed spill files resolved through ``tensors/index.parquet``;
1: one ``tensors/rankNNNNNN.safetensors`` per rank (still read)."""
READABLE_VERSIONS = (1, 2)

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

#: Column names of ``EVENT_SCHEMA``, in order.
EVENT_FIELDS = tuple(EVENT_SCHEMA.names)
_EVENT_FIELD_SET = frozenset(EVENT_FIELDS)
assert set(EVENT_REQUIRED_FIELDS) | set(EVENT_DEFAULTS) == _EVENT_FIELD_SET


def rows_to_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Dict rows (optional fields may be left out) as a table of ``EVENT_SCHEMA``."""
    cols: dict[str, list[Any]] = {name: [] for name in EVENT_FIELDS}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"event row {i} must be a dict, got {type(row).__name__}")
        unknown = row.keys() - _EVENT_FIELD_SET
        if unknown:
            raise ValueError(
                f"event row {i} has unknown fields {sorted(unknown)}; allowed: {list(EVENT_FIELDS)}"
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


def conform_table(table: pa.Table | pa.RecordBatch) -> pa.Table:
    """A table (or batch) with a subset of the event columns, cast to ``EVENT_SCHEMA``;
    missing optional columns and nulls in non-nullable ones take their defaults."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    unknown = set(table.column_names) - _EVENT_FIELD_SET
    if unknown:
        raise ValueError(f"event table has unknown columns {sorted(unknown)}; allowed: {list(EVENT_FIELDS)}")
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


def check_kinds(table: pa.Table) -> None:
    """Raise ``ValueError`` if a row's ``kind`` is not one of ``EVENT_KINDS``."""
    if table.num_rows == 0:
        return
    ok = pc.is_in(table.column("kind"), value_set=pa.array(EVENT_KINDS))
    if not pc.all(ok).as_py():
        bad = sorted(set(pc.filter(table.column("kind"), pc.invert(ok)).to_pylist()))
        raise ValueError(f"event kind must be one of {EVENT_KINDS}, got {bad}")


def sorted_by_rank(table: pa.Table) -> pa.Table:
    """The events ordered by (rank, idx), in one chunk."""
    return table.sort_by([("rank", "ascending"), ("idx", "ascending")]).combine_chunks()


def footer_size(path) -> tuple[int, int, int]:
    """Rows, uncompressed bytes (the row groups' sum) and columns of a Parquet file, from its
    footer alone: what a reader checks before it reads the table whole."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return meta.num_rows, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)), meta.num_columns
