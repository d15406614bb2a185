"""Every error prism-launch reports to the user (message first, then what to do), in one
module: a caller tells them apart by type and fields, never by their text.

- :class:`PrismError` and its subclasses: a run could not proceed.
- :class:`ConfigError`: a configuration value is invalid.
- :class:`TraceError` and its subclasses: the PrismTrace storage layer; each names the trace
  path involved and says what the user can do about it.
- :class:`CaptureError` and its subclasses: the capture coordinator could not complete an op.
- :class:`FoldError`, :class:`NetbenchError`, :class:`RanksTimeoutError`, :class:`RanksStoppedError`,
  :class:`ParkingError`, :class:`UnsafePathError`.

The communication layer's own errors (a failed op, with its rank, group, op and sequence) are
in :mod:`nccl_ext.core.errors`.
"""

from __future__ import annotations

import signal
from pathlib import Path


class PrismError(RuntimeError):
    """A run could not proceed; the message says why and what to do."""


class TraceMismatchError(PrismError):
    """The trace was recorded for another config, script, arguments or library versions."""


class RunFailedError(PrismError):
    """A rank failed; the message carries its rank and traceback location."""


OUT_OF_MEMORY_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory")
"""How a rank's failure reads when it ran out of memory: torch's exception type (allocator OOM,
the enforced target limit), the caching allocator's message, and a kernel launch's CUDA error."""


def reads_out_of_memory(text: str) -> bool:
    """Whether a rank's failure text (its traceback or error file: another process, so text is
    all there is) says it ran out of memory."""
    return any(m in text for m in OUT_OF_MEMORY_MARKERS)


class GpuWaitsStalledError(RunFailedError):
    """A capture failed after a rank's waits on the GPU stopped (``capture.gpu_waits``)."""


class Interrupted(KeyboardInterrupt):
    """The launcher received SIGINT, SIGTERM or SIGHUP; every rank has been (or is being)
    stopped. ``exit_code`` is what a shell expects of a process ended by that signal."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(f"received {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to do."""


class FoldError(ValueError):
    """The program's group layout does not fold the way it was asked to."""


class NetbenchError(RuntimeError):
    """The benchmark could not complete; the message says why."""


class CaptureError(RuntimeError):
    """The captured program did something the coordinator cannot complete."""


class CaptureDeadlineError(CaptureError):
    """A rank waited on a peer that never arrived."""


class PayloadBudgetError(CaptureError):
    """An exact capture's tensors passed the payload budget (``payload=auto`` records again
    with ``none``)."""


class WriterStalledError(CaptureDeadlineError):
    """The trace writer took nothing for ``comm.timeout_s`` while the coordinator waited for it
    (:mod:`prism_launch.capture.sink`)."""


class RanksTimeoutError(TimeoutError):
    """Raised by :meth:`RankProcesses.wait` when ranks are still running at the deadline."""

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        self.ranks = sorted(ranks)
        self.timeout_s = timeout_s
        super().__init__(f"ranks {self.ranks} still running after {timeout_s:g}s")

    def __reduce__(self):
        return (type(self), (self.ranks, self.timeout_s))


class RanksStoppedError(RuntimeError):
    """Raised by :meth:`RankProcesses.wait`: running ranks whose heartbeat stopped
    (:mod:`prism_launch.launch.heartbeat`; ``stopped``: rank, pid and age of each); the ranks
    are left running (call ``close``)."""

    def __init__(self, message: str, stopped: list, limit_s: float) -> None:
        super().__init__(message)
        self.stopped = stopped
        self.limit_s = limit_s

    def __reduce__(self):
        return (type(self), (str(self), self.stopped, self.limit_s))


class UnsafePathError(PermissionError):
    """A folder or file another user could change (or a symbolic link where none may be)."""


class ParkingError(RuntimeError):
    """The driver refused to checkpoint or restore a rank."""


# --------------------------------------------------------------------------- the trace

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

    def __init__(self, path: str | Path, found: object, expected: int | tuple[int, ...]) -> None:
        self.path = Path(path)
        self.found = found
        self.expected = expected
        readable = ", ".join(map(str, expected)) if isinstance(expected, tuple) else str(expected)
        super().__init__(
            f"PrismTrace at {self.path} has format_version={found!r}, but this PrismLLM reads "
            f"format_version {readable}. Re-capture the trace with this PrismLLM version "
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


class TraceSpaceError(TraceError):
    """Not enough free disk space for a trace (or report) being written; nothing was published."""

    def __init__(self, path: str | Path, needed: int, free: int, *, during: bool = False) -> None:
        self.path, self.needed, self.free, self.during = Path(path), int(needed), int(free), during
        when = "the disk filled up: not enough free space left for" if during else "not enough free disk space for"
        super().__init__(
            f"{when} the PrismTrace at {self.path}: needs about {_size(needed)}, {_size(free)} free there. "
            f"Nothing was written that emulation would accept; free space on that file system or point "
            f"trace.dir= at one with room, then run again.")

    def __reduce__(self):
        return (_rebuild_space, (str(self.path), self.needed, self.free, self.during))


class SpillHashError(TraceError):
    """A spill file's sha256 failed, or did not finish within its bound
    (:mod:`prism_launch.trace.spill`)."""


class TraceUnsafeError(TraceError):
    """A trace (or the signing key) lies where another user could change it."""


class TraceUnwritableError(TraceError):
    """A directory prism-launch must write into cannot be written (checked before any rank starts)."""

    def __init__(self, path: str | Path, blocker: str | Path, reason: str, *, setting: str = "trace.dir") -> None:
        self.path, self.blocker, self.reason, self.setting = Path(path), Path(blocker), reason, setting
        super().__init__(
            f"cannot write {self.path}: {self.blocker} is not writable ({reason}). Make it writable "
            f"(e.g. chmod u+w {self.blocker}) or set {setting}= to a writable directory; no rank was started.")

    def __reduce__(self):
        return (_rebuild_unwritable, (str(self.path), str(self.blocker), self.reason, self.setting))


class TraceBusyError(TraceError):
    """Another prism-launch holds the lock of a trace or report directory."""

    def __init__(self, path: str | Path, holder: str, *, setting: str) -> None:
        self.path, self.holder, self.setting = Path(path), holder, setting
        super().__init__(
            f"{self.path} is in use by another prism-launch ({holder}); wait for it to finish, or set "
            f"{setting}= to another directory to run beside it.")

    def __reduce__(self):
        return (_rebuild_busy, (str(self.path), self.holder, self.setting))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _rebuild_space(path: str, needed: int, free: int, during: bool) -> TraceSpaceError:
    return TraceSpaceError(path, needed, free, during=during)


def _rebuild_unwritable(path: str, blocker: str, reason: str, setting: str) -> TraceUnwritableError:
    return TraceUnwritableError(path, blocker, reason, setting=setting)


def _rebuild_busy(path: str, holder: str, setting: str) -> TraceBusyError:
    return TraceBusyError(path, holder, setting=setting)


def _rebuild_missing(path: str, hint: str | None, reason: str | None) -> TraceMissingError:
    return TraceMissingError(path, hint=hint, reason=reason)


def _rebuild_corrupt(
    path: str, file: str, expected: str | None, actual: str | None, reason: str | None
) -> TraceCorruptError:
    return TraceCorruptError(path, file, expected, actual, reason=reason)
