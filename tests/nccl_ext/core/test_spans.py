"""Compute spans on the device's own timeline (``DeviceClock``), with a scripted stand-in for
CUDA events: each event is stamped with the time the GPU reaches it."""

from types import SimpleNamespace

import pytest

from nccl_ext.core.spans import DeviceClock
from prism_launch.config import Measure
from prism_launch.predict.calibrate import apply_spans


class _Gpu:
    """A GPU timeline: ``at`` is when the GPU reaches the next recorded event (ms)."""

    def __init__(self) -> None:
        self.at = 0.0
        self.reached = 1e9  # events stamped later than this are not reached yet

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t = None

            def record(self) -> None:
                self.t = gpu.at

            def query(self) -> bool:
                return self.t <= gpu.reached

            def synchronize(self) -> None:
                gpu.reached = max(gpu.reached, self.t)

            def elapsed_time(self, end) -> float:
                return end.t - self.t

        return Event


def _clock(gpu: _Gpu, initialized: bool = True) -> DeviceClock:
    c = DeviceClock()
    c._torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: initialized, Event=gpu.event_class()))
    return c


def test_spans_follow_the_gpu_timeline_and_leave_waits_out():
    gpu = _Gpu()
    c = _clock(gpu)
    c.lap()            # op 1 issued; the GPU reaches it at 0 ms (the first span has no start: None)
    gpu.at = 30.0      # 30 ms of kernels before op 2, though the CPU issued them in far less
    c.lap()
    gpu.at = 50.0      # the program blocks on op 2: the span before the wait ends where the GPU
    c.wait_starts()    # reaches the wait (ReplayTransport.park)
    gpu.at = 65.0      # op 2 itself (15 ms) is the op's, not compute
    c.lap(waited=True)  # ReplayTransport.waited: the wait's span, ended at the wait's start
    c.resume()          # then the program resumes: the next span starts here
    gpu.at = 72.0
    c.lap()
    assert c.resolve() == [None, pytest.approx(0.030), pytest.approx(0.020), pytest.approx(0.007)]


def test_a_step_boundary_resolves_only_what_the_gpu_reached():
    gpu = _Gpu()
    c = _clock(gpu)
    c.lap()
    gpu.at = 10.0
    c.lap()
    gpu.reached = 5.0  # the GPU is behind the CPU: the second event is not reached yet
    gpu.at = 25.0
    c.lap()
    assert c.resolve(block=False) == [None]
    assert c.resolve() == [None, pytest.approx(0.010), pytest.approx(0.015)]


def test_no_device_timeline_before_cuda_is_used():
    c = _clock(_Gpu(), initialized=False)
    c.lap()
    c.lap()
    assert c.resolve() == [None, None]


class _Reader:
    def __init__(self, rows):
        self._rows = rows

    def events(self):
        return SimpleNamespace(to_pylist=lambda: [dict(r) for r in self._rows])


def test_calibration_takes_the_device_span_and_wall_time_where_there_is_none():
    rows = [{"rank": 0, "idx": i, "kind": "collective", "op": "all_reduce", "extra": None,
             "compute_cpu_s": 1.0, "compute_wall_s": 1.0} for i in range(2)]
    spans = [["c", 0.001, 0.002, None], ["c", 0.001, 0.002, 0.009]]
    out = apply_spans(_Reader(rows), {0: [spans]}, Measure.device)
    assert [r["compute_wall_s"] for r in out.rows] == [0.002, 0.009]
    out = apply_spans(_Reader(rows), {0: [spans]}, Measure.wall)
    assert [r["compute_wall_s"] for r in out.rows] == [0.002, 0.002]
    out = apply_spans(_Reader(rows), {0: [[s[:3] for s in spans]]}, Measure.device)  # an older summary
    assert [r["compute_wall_s"] for r in out.rows] == [0.002, 0.002]


def test_an_ops_own_handling_leaves_the_span_on_cuda_only(monkeypatch):
    from nccl_ext.core import spans as mod

    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(mod.time, "thread_time", lambda: now[0])
    for cuda, want in ((False, 0.007), (True, 0.002)):
        rec = mod.SpanRecorder()
        gpu = _Gpu()
        rec.device._torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda c=cuda: c,
                                                                 Event=gpu.event_class()))
        rec.lap("c")          # an op's entry
        now[0] += 0.005       # this layer's handling of it
        rec.returned()        # back to the program
        now[0] += 0.002       # the program computes
        rec.lap("c")
        assert rec.host[-1][2] == pytest.approx(want)


def test_on_cpu_an_op_calls_wait_for_peers_leaves_the_wall_span_its_host_work_stays(monkeypatch):
    """A call that blocks 5 ms for its peers (no CPU) while doing 1 ms of host work: on CPU the
    wall span keeps the 1 ms and the program's own 2 ms, not the 4 ms spent waiting (the replay
    prices that as communication); the CPU span keeps the host work too."""
    from nccl_ext.core import spans as mod

    wall, cpu = [100.0], [10.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: wall[0])
    monkeypatch.setattr(mod.time, "thread_time", lambda: cpu[0])
    rec = mod.SpanRecorder()
    rec.device._torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: False))
    rec.lap("c")
    wall[0] += 0.005
    cpu[0] += 0.001       # the call's host work inside those 5 ms
    rec.returned()
    wall[0] += 0.002
    cpu[0] += 0.002       # the program computes
    rec.lap("c")
    code, cpu_s, wall_s = rec.host[-1]
    assert wall_s == pytest.approx(0.003) and cpu_s == pytest.approx(0.003)


def test_a_capture_ranks_clock_times_every_span_on_the_gpu_too(monkeypatch):
    """The capture's clock (DeviceTimedClock, as CaptureTransport drives it: lap at each op,
    wait_starts at park, lap(until=t0) and resume(t1) around a wait, returned at each op's
    return): the host spans as before, and at close one GPU-timeline span per host span, the
    wait's interval left out, the op's own handling too (CUDA: returned skips)."""
    from nccl_ext.core import spans as mod

    now = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(mod.time, "thread_time", lambda: now[0])
    gpu = _Gpu()
    c = mod.DeviceTimedClock()
    c.device._torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True, Event=gpu.event_class()))
    c.lap()                       # op 1 issued (GPU at 0 ms)
    c.returned(True)
    gpu.at, now[0] = 40.0, 100.004  # 40 ms of kernels, issued by the CPU in 4 ms
    c.lap()                       # op 2 issued
    c.returned(True)
    gpu.at = 45.0
    c.wait_starts()               # park: the program blocks on op 2
    t0 = now[0]
    gpu.at, now[0] = 90.0, 100.2  # the capture's round trip, other ranks holding the slots
    c.lap(until=t0)               # waited(ref, t0, t1)
    c.resume(now[0])
    gpu.at = 97.0
    c.lap()
    assert [h for h in c.device_seconds()] == [None, pytest.approx(0.040), pytest.approx(0.005),
                                               pytest.approx(0.007)]
    cpu_only = mod.DeviceTimedClock()
    cpu_only.device._torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: False))
    cpu_only.lap()
    assert cpu_only.device_seconds() is None  # a CPU capture sends none
