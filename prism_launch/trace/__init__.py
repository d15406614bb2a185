"""PrismTrace: the on-disk record of a capture run that emulation replays.

A PrismTrace is a directory::

    <trace>/
        manifest.json                    # written last; lists every other file with its sha256
        events.parquet                   # one row per communication event of every captured rank
        tensors/index.parquet            # (rank, key) -> spill file and content address
        tensors/blob000000.safetensors   # distinct tensors, written as the capture records them
        <name>.json                      # optional JSON files added by the caller

Its modules, one job each: :mod:`.layout` (every path of a trace and of a report),
:mod:`.schema` (the event table), :mod:`.manifest` (``manifest.json``), :mod:`.spill`
(content-addressed spill files while recording), :mod:`.tensors` (reading tensor files), :mod:`.checksums` (sha256 sums and the cache of files found intact),
:mod:`.durable` (fsync, staging names, the atomic swap), :mod:`.writer` (:class:`TraceWriter`),
:mod:`.reader` (:class:`TraceReader`) and :mod:`.errors`.
"""

from .durable import cleanup_stale_partials, is_staging_name
from .errors import (
    DEFAULT_CAPTURE_HINT,
    TraceCorruptError,
    TraceError,
    TraceKeyError,
    TraceBusyError,
    TraceMissingError,
    TraceSpaceError,
    TraceUnwritableError,
    TraceVersionError,
)
from .layout import (
    RankLogs,
    EVENTS_NAME,
    MANIFEST_NAME,
    TENSOR_INDEX_NAME,
    TENSORS_DIR,
    VERIFIED_NAME,
    ReportLayout,
    TraceLayout,
    tensor_blob_name,
    tensor_file_name,
)
from .manifest import Manifest
from .reader import TraceReader
from .schema import (
    EVENT_DEFAULTS,
    EVENT_KINDS,
    EVENT_REQUIRED_FIELDS,
    EVENT_SCHEMA,
    FORMAT_VERSION,
)
from .writer import TraceWriter

__all__ = [
    "DEFAULT_CAPTURE_HINT",
    "EVENT_DEFAULTS",
    "EVENT_KINDS",
    "EVENT_REQUIRED_FIELDS",
    "EVENT_SCHEMA",
    "EVENTS_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TENSOR_INDEX_NAME",
    "TENSORS_DIR",
    "VERIFIED_NAME",
    "Manifest",
    "RankLogs",
    "ReportLayout",
    "TraceCorruptError",
    "TraceError",
    "TraceKeyError",
    "TraceLayout",
    "TraceMissingError",
    "TraceReader",
    "TraceVersionError",
    "TraceWriter",
    "TraceBusyError",
    "TraceSpaceError",
    "TraceUnwritableError",
    "cleanup_stale_partials",
    "is_staging_name",
    "tensor_blob_name",
    "tensor_file_name",
]
