"""Errors raised by the PrismTrace storage layer.

Every error derives from :class:`TraceError`, names the trace path involved and
says what the user can do about it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DEFAULT_CAPTURE_HINT",
    "TraceError",
    "TraceMissingError",
    "TraceVersionError",
    "TraceCorruptError",
    "TraceKeyError",
]

#: Generic command suggested when no more specific one is known.
DEFAULT_CAPTURE_HINT = "prism-launch ... mode=capture ..."


class TraceError(Exception):
    """Base class of every PrismTrace error."""


class TraceMissingError(TraceError):
    """No complete PrismTrace exists at ``path``."""

    def __init__(self, path: str | Path, *, hint: str | None = None, reason: str | None = None) -> None:
        self.path = Path(path)
        self.hint = hint
        self.reason = reason
        command = hint or DEFAULT_CAPTURE_HINT
        why = reason or "no manifest.json found"
        super().__init__(
            f"No PrismTrace at {self.path} ({why}). "
            f"Record one first by running the job in capture mode: `{command}`, "
            f"then point emulation at the trace directory it writes."
        )

    def __reduce__(self):
        return (_rebuild_missing, (str(self.path), self.hint, self.reason))


class TraceVersionError(TraceError):
    """The trace was written with an unsupported format version."""

    def __init__(self, path: str | Path, found: object, expected: int) -> None:
        self.path = Path(path)
        self.found = found
        self.expected = expected
        super().__init__(
            f"PrismTrace at {self.path} has format_version={found!r}, but this PrismLLM reads "
            f"format_version={expected}. Re-capture the trace with this PrismLLM version "
            f"(run the job with mode=capture), or use the PrismLLM version that wrote it."
        )

    def __reduce__(self):
        return (type(self), (str(self.path), self.found, self.expected))


class TraceCorruptError(TraceError):
    """A file of the trace is missing, unreadable or fails its checksum."""

    def __init__(
        self,
        path: str | Path,
        file: str,
        expected: str | None,
        actual: str | None,
        *,
        reason: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.file = file
        self.expected = expected
        self.actual = actual
        self.reason = reason
        if reason is None:
            if actual is None:
                reason = "file is missing"
            else:
                reason = "checksum (sha256) mismatch"
        detail = f"{reason}"
        if expected is not None or actual is not None:
            detail += f"; expected {expected}, got {actual}"
        super().__init__(
            f"PrismTrace at {self.path} is corrupt: {file!r}: {detail}. "
            f"The trace cannot be trusted; delete {self.path} and re-capture it "
            f"(run the job with mode=capture)."
        )

    def __reduce__(self):
        return (_rebuild_corrupt, (str(self.path), self.file, self.expected, self.actual, self.reason))


class TraceKeyError(TraceError, KeyError):
    """A tensor or JSON file asked for by name is not stored in the trace."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return self.message


def _rebuild_missing(path: str, hint: str | None, reason: str | None) -> TraceMissingError:
    return TraceMissingError(path, hint=hint, reason=reason)


def _rebuild_corrupt(
    path: str, file: str, expected: str | None, actual: str | None, reason: str | None
) -> TraceCorruptError:
    return TraceCorruptError(path, file, expected, actual, reason=reason)
