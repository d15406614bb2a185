"""Where a prediction's compute comes from: never host CPU time for a trace captured on CUDA
without saying so, and the report's statement of the source on CPU."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from prism_launch.config import ComputeSource
from prism_launch.predict.compute_source import UncalibratedCudaTraceError, select
from prism_launch.predict.prediction import graph_source
from prism_launch.report.build import prediction_lines


def _bare(device: str):
    return SimpleNamespace(manifest=SimpleNamespace(extra={"program_config": {"device": device}}))


def _trace(calibrated: bool = False):
    return SimpleNamespace(root=Path("/t"), calibrated=SimpleNamespace(exists=lambda: calibrated, root=Path("/t/c")))


def _cfg(compute: ComputeSource):
    return SimpleNamespace(replay=SimpleNamespace(compute=compute))


@pytest.mark.parametrize("compute", [ComputeSource.calibrated, ComputeSource.auto])
def test_a_cuda_trace_without_calibration_is_refused_not_replayed_from_host_time(compute):
    """Its spans lack device times (no calibrated version): the prediction refuses, naming the fix."""
    with pytest.raises(UncalibratedCudaTraceError, match="captured on CUDA.*mode=calibrate"):
        graph_source(_cfg(compute), _bare("cuda"), _trace())


@pytest.mark.parametrize("compute,clock", [(ComputeSource.cpu, "cpu"), (ComputeSource.wall, "wall")])
def test_host_time_of_a_cuda_trace_asked_for_explicitly_is_labelled_loudly(compute, clock):
    reader, origin, used = graph_source(_cfg(compute), _bare("cuda"), _trace())
    assert used == clock and origin.loud and origin.source == "host time of a CUDA capture"
    assert "UNCALIBRATED" in origin.statement and "mode=calibrate" in origin.statement
    pred = {"compute_statement": origin.statement, "compute_warning": origin.loud}
    lines = prediction_lines({**_pred(), **pred})
    assert any("warning: compute spans: UNCALIBRATED" in ln for ln in lines)


@pytest.mark.parametrize("compute,source,words", [
    (ComputeSource.cpu, "cpu thread", "CPU thread time of the capture"),
    (ComputeSource.wall, "cpu wall", "CPU wall time of the capture, execution slots held"),
])
def test_the_report_states_where_compute_came_from_on_cpu(compute, source, words):
    _reader, origin = select(_cfg(compute), _bare("cpu"), _trace())
    assert origin.source == source and not origin.loud
    lines = prediction_lines({**_pred(), "compute_statement": origin.statement, "compute_warning": origin.loud})
    stated = [ln for ln in lines if ln.startswith("  compute spans: ")]
    assert stated and words in stated[0] and "warning" not in stated[0]


def test_asking_for_calibrated_spans_on_cpu_without_a_calibrated_trace_says_so():
    _reader, origin = select(_cfg(ComputeSource.calibrated), _bare("cpu"), _trace())
    assert origin.source == "cpu thread" and origin.loud and "no calibrated trace exists" in origin.statement


def test_a_calibrated_trace_is_stated_with_its_classes_slices_and_repeats(monkeypatch):
    extra = {"by_class": True, "shard_classes": [{}, {}, {}, {}], "repeats": 3, "slices": [[0], [8], [16], [24]] * 3,
             "method": "one rank per GPU", "device": "cuda"}
    import prism_launch.trace as trace_mod

    monkeypatch.setattr(trace_mod, "TraceReader", lambda root: SimpleNamespace(manifest=SimpleNamespace(extra=extra)))
    _reader, origin = select(_cfg(ComputeSource.auto), _bare("cuda"), _trace(calibrated=True))
    assert origin.source == "calibrated" and origin.clock == "wall" and not origin.loud
    assert "4 shard class(es), each measured 3 time(s)" in origin.statement and "12 slice(s)" in origin.statement
    assert "GPU's own timeline" in origin.statement


def _pred() -> dict:
    return {"cluster": "cpu_local", "compute_source": "x", "calibration": None, "iteration_time_s": 0.5,
            "iteration_times_s": [0.5, 0.5, 0.5], "critical_path": {"ranks": [0, 1], "compute_s": 1.0, "comm_s": 0.1}}
