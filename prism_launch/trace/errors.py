"""Errors raised by the PrismTrace storage layer: defined in :mod:`prism_launch.errors` with
every other error of the launcher, named here too for the trace's modules and callers."""

from __future__ import annotations

from prism_launch.errors import (
    DEFAULT_CAPTURE_HINT,
    TraceBusyError,
    TraceCorruptError,
    TraceError,
    TraceKeyError,
    TraceMissingError,
    TraceSpaceError,
    TraceUnsafeError,
    TraceUnwritableError,
    TraceVersionError,
)

__all__ = [
    "DEFAULT_CAPTURE_HINT",
    "TraceError",
    "TraceMissingError",
    "TraceVersionError",
    "TraceCorruptError",
    "TraceKeyError",
    "TraceSpaceError",
    "TraceUnsafeError",
    "TraceUnwritableError",
    "TraceBusyError",
]
