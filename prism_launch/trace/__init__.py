"""PrismTrace: the on-disk record of a capture run that emulation replays."""

from .errors import (
    DEFAULT_CAPTURE_HINT,
    TraceCorruptError,
    TraceError,
    TraceKeyError,
    TraceMissingError,
    TraceVersionError,
)
from .store import (
    EVENT_DEFAULTS,
    EVENT_KINDS,
    EVENT_REQUIRED_FIELDS,
    EVENT_SCHEMA,
    EVENTS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TENSORS_DIR,
    Manifest,
    TraceReader,
    TraceWriter,
    cleanup_stale_partials,
    is_staging_name,
    tensor_file_name,
)

__all__ = [
    "DEFAULT_CAPTURE_HINT",
    "EVENT_DEFAULTS",
    "EVENT_KINDS",
    "EVENT_REQUIRED_FIELDS",
    "EVENT_SCHEMA",
    "EVENTS_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TENSORS_DIR",
    "Manifest",
    "TraceCorruptError",
    "TraceError",
    "TraceKeyError",
    "TraceMissingError",
    "TraceReader",
    "TraceVersionError",
    "TraceWriter",
    "cleanup_stale_partials",
    "is_staging_name",
    "tensor_file_name",
]

from .layout import ReportLayout, TraceLayout  # noqa: E402

__all__ += ["ReportLayout", "TraceLayout"]
