"""Where everything of a run lives on disk: one object for a PrismTrace directory, one for
its report directory. No other module spells a file name of either.

A trace directory holds the bare trace (``manifest.json`` written last, ``events.parquet``,
``tensors/index.parquet`` and ``tensors/blobNNNNNN.safetensors`` — format 2; format 1 had
``tensors/rankNNNNNN.safetensors`` — the JSON side files below), a calibrated version under
``calibrated/`` (events and manifest only) and, by default, the report directory
``report/``. The report directory holds ``report.json``, ``timeline.json``, the PNG plots,
``sandbox/`` (one summary per sandbox rank, the assistant's, the predicted schedule) and
``calibration/sliceN/`` (each calibration slice's own emulation report).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MANIFEST_NAME = "manifest.json"
EVENTS_NAME = "events.parquet"
TENSORS_DIR = "tensors"
VERIFIED_NAME = ".verified.json"


TENSOR_INDEX_NAME = f"{TENSORS_DIR}/index.parquet"
"""Format 2: where every (rank, key) of the trace's tensors is stored (:mod:`.spill`)."""


def tensor_blob_name(n: int) -> str:
    """Format 2: relative path (POSIX) of spill file ``n``, distinct tensors named by content."""
    return f"{TENSORS_DIR}/blob{int(n):06d}.safetensors"


def tensor_file_name(rank: int) -> str:
    """Format 1: relative path (POSIX) of the tensor file of ``rank`` inside a trace."""
    return f"{TENSORS_DIR}/rank{int(rank):06d}.safetensors"


def safe_relpath(name: str) -> str:
    """Normalize a caller-chosen relative file name; reject anything escaping the trace."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"file name must be a non-empty string, got {name!r}")
    if "\\" in name or "\x00" in name:
        raise ValueError(f"file name {name!r} must use '/' separators and no NUL bytes")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"file name {name!r} must be a plain relative path inside the trace")
    return str(p)


def is_reserved(rel: str) -> bool:
    """Whether ``rel`` (relative, POSIX) names one of the trace's own files rather than a
    caller-added JSON file."""
    return rel in (MANIFEST_NAME, EVENTS_NAME) or rel == TENSORS_DIR or rel.startswith(TENSORS_DIR + "/")


@dataclass(frozen=True, slots=True)
class TraceLayout:
    """The paths of one trace directory (bare or calibrated)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # JSON side files of a trace (names as ``TraceReader.read_json`` takes them)
    STEPS = "steps.json"
    """Per-rank losses parsed from the capture's logs."""
    MEMORY = "memory.json"
    """Per-rank allocator summaries of the capture (peaks)."""
    CAPTURE = "capture.json"
    """The capture's own statistics (wall time, slots, resumes, parking)."""
    FOLD = "fold.json"
    """The fold plan of a folded capture."""

    @classmethod
    def at(cls, path: str | Path) -> TraceLayout:
        return cls(Path(path))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def events(self) -> Path:
        return self.root / EVENTS_NAME

    @property
    def tensors_dir(self) -> Path:
        return self.root / TENSORS_DIR

    def tensor_file(self, rank: int) -> Path:
        return self.root / tensor_file_name(rank)

    @property
    def verified(self) -> Path:
        return self.root / VERIFIED_NAME

    def exists(self) -> bool:
        """A committed trace is here (its manifest is written last)."""
        return self.manifest.exists()

    @property
    def calibrated(self) -> TraceLayout:
        """The calibrated version beside this bare trace."""
        return TraceLayout(self.root / "calibrated")

    @property
    def default_report(self) -> ReportLayout:
        return ReportLayout(self.root / "report")


@dataclass(frozen=True, slots=True)
class RankLogs:
    """One run's per-rank log directory, laid out as torchrun's agent does
    (``<log-dir>/<rank>/stdout.log``, ``stderr.log``, ``error.json``), plus the allocator
    summary a ``mode=real`` rank writes there."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def rank_dir(self, rank: int) -> Path:
        return self.root / str(rank)

    def stdout(self, rank: int) -> Path:
        return self.rank_dir(rank) / "stdout.log"

    def stderr(self, rank: int) -> Path:
        return self.rank_dir(rank) / "stderr.log"

    def error_file(self, rank: int) -> Path:
        return self.rank_dir(rank) / "error.json"

    def memory(self, rank: int) -> Path:
        return self.rank_dir(rank) / "memory.json"


@dataclass(frozen=True, slots=True)
class ReportLayout:
    """The paths of one report directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def timeline(self) -> Path:
        return self.root / "timeline.json"

    @property
    def step_time_png(self) -> Path:
        return self.root / "step_time_per_rank.png"

    @property
    def pipeline_png(self) -> Path:
        return self.root / "pipeline_timeline.png"

    def summaries(self, node_rank: int = 0) -> Path:
        """Where this node's sandbox ranks write their summaries (node 0: the report's own)."""
        return self.root / "sandbox" if node_rank == 0 else self.root / f"node{node_rank}" / "sandbox"

    def summary(self, rank: int, node_rank: int = 0) -> Path:
        return self.summaries(node_rank) / f"rank{rank}.json"

    def assistant_summary(self, node_rank: int = 0) -> Path:
        return self.summaries(node_rank) / "assistant.json"

    def schedule(self, node_rank: int = 0) -> Path:
        """The predicted issue times given to the sandbox ranks (``emulate.timing=predicted``)."""
        return self.summaries(node_rank) / "schedule.json"

    def calibration_slice(self, index: int) -> ReportLayout:
        return ReportLayout(self.root / "calibration" / f"slice{index}")
