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
    """A trace whose manifest says where it was captured and whose capture sent no GPU spans."""
    return SimpleNamespace(manifest=SimpleNamespace(extra={"program_config": {"device": device}}, ranks_captured=[0]),
                           json_files=lambda: [])


def _trace(calibrated: bool = False):
    return SimpleNamespace(root=Path("/t"), calibrated=SimpleNamespace(exists=lambda: calibrated, root=Path("/t/c")))


def _cfg(compute: ComputeSource):
    return SimpleNamespace(replay=SimpleNamespace(compute=compute))


@pytest.mark.parametrize("compute", [ComputeSource.calibrated, ComputeSource.auto])
def test_a_cuda_trace_without_calibration_is_refused_not_replayed_from_host_time(compute):
    """Its spans lack device times (no calibrated version, no GPU spans from the capture): the
    prediction refuses, naming the fix."""
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


def _cuda_bare(device_spans: dict):
    import pyarrow as pa

    rows = {"rank": [0, 0, 1, 1], "idx": [0, 1, 0, 1], "compute_wall_s": [0.5, 0.5, 0.5, 0.5],
            "compute_cpu_s": [0.4, 0.4, 0.4, 0.4]}
    capture = {"ranks": 2, "slots": 16, "rank_busy_s": {str(r): {"device_spans_s": s} for r, s in device_spans.items()}}
    return SimpleNamespace(
        manifest=SimpleNamespace(extra={"program_config": {"device": "cuda"}}, ranks_captured=[0, 1]),
        json_files=lambda: ["capture.json"], read_json=lambda name: capture, events=lambda: pa.table(rows))


def test_a_cuda_capture_with_gpu_timeline_spans_is_replayed_from_them_and_says_how_they_were_taken():
    bare = _cuda_bare({0: [None, 0.030], 1: [0.002, 0.031]})
    reader, origin, clock = graph_source(_cfg(ComputeSource.auto), bare, _trace())
    assert origin.source == "capture device" and clock == "wall" and not origin.loud
    assert "2 ranks over 16 execution slots" in origin.statement and "mode=calibrate" in origin.statement
    # the GPU's spans; one the GPU had none for (before CUDA was used) keeps the host's wall time
    assert reader.events().column("compute_wall_s").to_pylist() == [0.5, 0.030, 0.002, 0.031]
    assert reader.manifest is bare.manifest


def test_gpu_spans_missing_for_a_rank_or_not_matching_its_events_are_refused():
    with pytest.raises(UncalibratedCudaTraceError, match="rank 1's capture recorded no device-timeline spans"):
        select(_cfg(ComputeSource.auto), _cuda_bare({0: [0.1, 0.1], 1: None}), _trace())
    reader, _origin = select(_cfg(ComputeSource.auto), _cuda_bare({0: [0.1, 0.1], 1: [0.1]}), _trace())
    with pytest.raises(UncalibratedCudaTraceError, match=r"ranks \[1\].*different count"):
        reader.events()


def test_compute_speedup_divides_every_span_and_must_be_positive():
    from prism_launch.config import ConfigError, compose, resolve
    from prism_launch.predict.prediction import speed_up

    rows = [{"compute_cpu_s": 0.4, "compute_wall_s": 0.5}, {"compute_cpu_s": None, "compute_wall_s": 0.25}]
    assert speed_up(rows, 2.0) == 2.0
    assert rows == [{"compute_cpu_s": 0.2, "compute_wall_s": 0.25}, {"compute_cpu_s": 0.0, "compute_wall_s": 0.125}]
    assert resolve(compose(["replay.compute_speedup=1.5"])).replay.compute_speedup == 1.5
    with pytest.raises(ConfigError, match="compute_speedup must be > 0"):
        resolve(compose(["replay.compute_speedup=0"])).validate()
