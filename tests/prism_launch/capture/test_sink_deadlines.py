"""The coordinator's waits for the trace writer (prism_launch/capture/sink.py) end when the
writer has taken nothing for ``stall_s``: a writer stuck for good (storage that stopped
answering) fails the wait naming the tensor it is on, instead of holding the coordinator's
thread — the one that answers every rank and watches their exits — for good."""

import threading
import time

import pytest
import torch

from prism_launch.capture.ops_state import CaptureDeadlineError
from prism_launch.capture.sink import BackgroundSink, WriterStalledError


class StuckWriter:
    """Takes ``free`` tensors, then blocks on the next until ``release`` is set."""

    def __init__(self, free=0, delay=0.0):
        self.free, self.delay, self.got = free, delay, []
        self.release = threading.Event()

    def record_tensor(self, rank, key, tensor, addr=None):
        if len(self.got) >= self.free:
            self.release.wait(30)
        time.sleep(self.delay)
        self.got.append(key)


def test_room_is_waited_for_only_while_the_writer_takes_something():
    w = StuckWriter()
    sink = BackgroundSink(w, pending_bytes=4000, stall_s=0.3)
    sink.record_tensor(3, "k0", torch.zeros(1000))  # 4000 bytes: the writer takes it and sticks
    t0 = time.monotonic()
    with pytest.raises(WriterStalledError, match=r"deadline exceeded: .* room for rank 5's 1 tensor\(s\) \(k1 .*"
                       r"it is on rank 3's tensor 'k0'.*comm.timeout_s= \(now 0.3\)") as e:
        sink.record_tensor(5, "k1", torch.zeros(1000))
    assert 0.25 < time.monotonic() - t0 < 3.0 and isinstance(e.value, CaptureDeadlineError)
    w.release.set()
    sink.close(discard=True)


@pytest.mark.parametrize("discard", [False, True])
def test_close_ends_within_the_bound_when_the_writer_is_stuck(discard):
    w = StuckWriter()
    sink = BackgroundSink(w, stall_s=0.3)
    sink.record_tensors(2, ["a", "b"], [torch.zeros(10), torch.ones(10)])
    time.sleep(0.05)
    t0 = time.monotonic()
    with pytest.raises(WriterStalledError, match="it is on rank 2's tensor 'a' and 1 more"):
        sink.close(discard=discard)
    assert time.monotonic() - t0 < 3.0
    w.release.set()


def test_a_slow_writer_that_keeps_taking_is_waited_for():
    w = StuckWriter(free=100, delay=0.1)  # each tensor 0.1 s: slower than nothing, never stalled 0.3 s
    sink = BackgroundSink(w, pending_bytes=400, stall_s=0.3)
    for i in range(6):
        sink.record_tensor(0, f"k{i}", torch.zeros(100))
    sink.close()
    assert w.got == [f"k{i}" for i in range(6)]
