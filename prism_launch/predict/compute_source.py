"""Where a prediction's compute spans come from, and what that means for its accuracy.

Every prediction names its source (:class:`ComputeOrigin`), and the report prints it:

* ``calibrated``: slices re-ran class representatives for real, one per device, repeated
  (:mod:`prism_launch.predict.calibrate`); spans on the device's own clock (CUDA events on
  the program's stream) or, on CPU, host wall time (:class:`nccl_ext.core.spans.ComputeClock`).
* ``capture device``: a capture on CUDA's own GPU timeline (CUDA events on the program's
  stream per span, :class:`nccl_ext.core.spans.DeviceTimedClock`), taken while ranks shared
  the GPUs: other ranks' kernels interleave, so spans can come out long.
* ``cpu thread``: the capture's per-rank thread CPU time on CPU: free of time-slicing, but
  without what a real rank loses waiting for a core, to other threads of its process (gloo's)
  and to a loaded machine.
* ``cpu wall``: the capture's host wall time on CPU, slots held (a rank parked waiting for
  its slot does not count): includes the machine's load as it was during the capture.
* ``host time of a CUDA capture``: a trace captured on CUDA replayed from host spans —
  never chosen by default; only when ``replay.compute=cpu|wall`` asks, and labelled loudly.

A trace captured on CUDA is never replayed from host time silently: without a calibrated
version or the capture's device spans, :func:`select` refuses, naming ``mode=calibrate``
(``mode=auto`` calibrates by itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prism_launch.errors import PrismError

if TYPE_CHECKING:
    from prism_launch.config import PrismConfig
    from prism_launch.trace import TraceLayout, TraceReader


class UncalibratedCudaTraceError(PrismError):
    """A trace captured on CUDA, asked to be replayed from compute spans it does not have."""


@dataclass(frozen=True, slots=True)
class ComputeOrigin:
    source: str
    """``calibrated`` | ``capture device`` | ``cpu thread`` | ``cpu wall`` | ``host time of a CUDA capture``."""
    clock: str
    """The event column the replay reads: ``cpu`` (``compute_cpu_s``) or ``wall`` (``compute_wall_s``;
    a calibrated trace writes its measured span to both)."""
    statement: str
    """Where the compute came from and what that means for accuracy, in words (the report prints it)."""
    loud: bool = False
    """The source is not what the trace's device calls for: the report warns."""


def captured_on(reader: TraceReader) -> str:
    """``cuda`` or ``cpu``: the device the trace's program ran on (its manifest's program config)."""
    pc = (reader.manifest.extra or {}).get("program_config") or {}
    return str(pc.get("device") or "cpu")


def _calibrated_statement(extra: dict) -> str:
    classes = extra.get("shard_classes") or []
    slices = len(extra.get("slices") or [])
    method = extra.get("method") or "shared devices"
    if extra.get("by_class"):
        how = (f"{len(classes)} shard class(es), each measured {extra.get('repeats')} time(s) and given the "
               f"per-event median, in {slices} slice(s), {method}")
    else:
        how = f"{slices} slice(s), {method}, every calibrated rank measured itself"
    if extra.get("device") == "cuda":
        return (f"calibrated ({how}; the GPU's own timeline): spans of one rank per GPU, uncontended; accuracy is "
                "that of the slices' GPU, not scaled unless the report says so")
    return (f"calibrated ({how}; host wall time of the program's compute plus its op calls' host work, not their "
            "waits for peers): one rank per core, so it includes what a real rank loses to its process's other "
            "threads and to the machine's load during calibration; a different load at run time moves the real "
            "step, not the prediction")


def select(cfg: PrismConfig, bare: TraceReader, trace: TraceLayout) -> tuple[TraceReader, ComputeOrigin]:
    """The trace whose compute spans the replay uses and its :class:`ComputeOrigin`."""
    from prism_launch.config import ComputeSource
    from prism_launch.trace import TraceReader

    want = cfg.replay.compute
    cuda = captured_on(bare) == "cuda"
    if want in (ComputeSource.calibrated, ComputeSource.auto) and trace.calibrated.exists():
        cal = TraceReader(trace.calibrated.root)
        return cal, ComputeOrigin("calibrated", "wall", _calibrated_statement(cal.manifest.extra or {}))
    if cuda:
        if want in (ComputeSource.calibrated, ComputeSource.auto):
            spans, why = device_spans(bare)
            if spans is not None:
                stats = _capture_stats(bare)
                return DeviceSpanReader(bare, spans), ComputeOrigin(
                    "capture device", "wall",
                    f"capture device time (the GPU's timeline of each span, CUDA events on the program's stream; "
                    f"{stats.get('ranks', '?')} ranks over {stats.get('slots', '?')} execution slots sharing this "
                    "machine's GPUs): while ranks shared a GPU, other ranks' kernels interleave with a span's, so "
                    "spans can come out long; mode=calibrate measures one rank per GPU")
            raise UncalibratedCudaTraceError(
                f"the trace {trace.root} was captured on CUDA and has no calibrated version, and {why}: its compute "
                "spans are host time of ranks sharing GPUs, not the GPU's. Calibrate it first (mode=calibrate with the "
                "same job; mode=auto calibrates by itself), or set replay.compute=cpu or replay.compute=wall to "
                "accept host-time spans (the report then says so)")
        clock = "wall" if want is ComputeSource.wall else "cpu"
        return bare, ComputeOrigin(
            "host time of a CUDA capture", clock,
            f"UNCALIBRATED: host {'wall' if clock == 'wall' else 'thread CPU'} time of a capture on CUDA "
            f"(replay.compute={want}): not the GPU's timeline — kernels the CPU ran ahead of are missing and ranks "
            "shared GPUs; expect large errors; run mode=calibrate", loud=True)
    if want is ComputeSource.wall:
        return bare, ComputeOrigin(
            "cpu wall", "wall",
            "CPU wall time of the capture, execution slots held: it includes the machine's load during the capture "
            "and the capture's own work on the same cores")
    note = (" (replay.compute=calibrated, but no calibrated trace exists: run mode=calibrate)"
            if want is ComputeSource.calibrated else "")
    return bare, ComputeOrigin(
        "cpu thread", "cpu",
        "CPU thread time of the capture" + note + ": free of time-slicing, but without a real rank's waits for a "
        "core, its other threads and the machine's load: under load the prediction comes out fast (calibrated "
        "wall-time spans track them: mode=calibrate, or calibrate.in_auto=true with replay.compute=calibrated)",
        loud=bool(note))


def _capture_stats(bare: TraceReader) -> dict:
    from prism_launch.trace import TraceLayout

    return bare.read_json(TraceLayout.CAPTURE) if TraceLayout.CAPTURE in bare.json_files() else {}


def device_spans(bare: TraceReader) -> tuple[dict[int, list] | None, str]:
    """Every captured rank's spans on the GPU's timeline as its capture sent them at close
    (``capture.json``'s ``rank_busy_s[rank].device_spans_s``), or None and why not."""
    busy = _capture_stats(bare).get("rank_busy_s") or {}
    out: dict[int, list] = {}
    for r in bare.manifest.ranks_captured:
        spans = (busy.get(str(r)) or {}).get("device_spans_s")
        if not spans:
            return None, f"rank {r}'s capture recorded no device-timeline spans"
        out[int(r)] = spans
    return out, ""


class DeviceSpanReader:
    """The bare trace, its events' ``compute_wall_s`` the capture's GPU-timeline spans (a span
    the GPU had none for — before the process used CUDA — keeps the host's wall time: no GPU
    work was in it). A rank whose count of spans is not its count of events is refused."""

    def __init__(self, bare: TraceReader, spans: dict[int, list]) -> None:
        self._bare = bare
        self._spans = spans
        self._events = None

    def __getattr__(self, name: str):
        return getattr(self._bare, name)

    def events(self):
        if self._events is not None:
            return self._events
        import pyarrow as pa

        table = self._bare.events()
        ranks, idx = table.column("rank").to_pylist(), table.column("idx").to_pylist()
        wall = table.column("compute_wall_s").to_pylist()
        counts: dict[int, int] = {}
        for r in ranks:
            counts[r] = counts.get(r, 0) + 1
        bad = sorted(r for r, n in counts.items() if len(self._spans.get(r, ())) != n)
        if bad:
            raise UncalibratedCudaTraceError(
                f"ranks {bad[:8]} of the trace have a different count of device-timeline spans than of events: "
                "their GPU spans cannot be matched to events; run mode=calibrate")
        new = [w if self._spans[r][i] is None else float(self._spans[r][i]) for r, i, w in zip(ranks, idx, wall)]
        col = table.schema.get_field_index("compute_wall_s")
        self._events = table.set_column(col, "compute_wall_s", pa.array(new, pa.float64()))
        return self._events
