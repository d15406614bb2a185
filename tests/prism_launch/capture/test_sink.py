"""The coordinator's tensors reach the trace writer on a thread of their own: all of them, in
order, with the bytes waiting bounded; a writer failure is raised on the coordinator's side;
a failed capture drops what still waits."""

import threading
import time

import pytest
import torch

from prism_launch.capture.sink import BackgroundSink
from prism_launch.trace import TraceReader, TraceWriter
from prism_launch.trace.errors import TraceSpaceError


class SlowWriter:
    def __init__(self, delay=0.0, fail_at=None):
        self.got, self.delay, self.fail_at = [], delay, fail_at
        self.gate = threading.Event()
        self.gate.set()

    def record_tensor(self, rank, key, tensor, addr=None):
        self.gate.wait()
        time.sleep(self.delay)
        if self.fail_at is not None and len(self.got) == self.fail_at:
            raise TraceSpaceError("/x", 1 << 20, 0, during=True)
        self.got.append((rank, key, tensor))


def test_every_tensor_arrives_in_order_into_a_real_trace(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        sink = BackgroundSink(w)
        want = {f"k{i}": torch.full((1000,), float(i)) for i in range(50)}
        for k, t in want.items():
            sink.record_tensor(3, k, t)
        sink.close()
        w.add_events([{"rank": 3, "idx": 0, "unit": 0, "kind": "marker", "op": "step", "group": -1, "seq": -1,
                       "peer": -1, "t_start": 0.0, "t_end": 0.0}])
        w.commit(fingerprint={"f": "1"}, versions={}, world_size=4, topology={}, groups=[], ranks_captured=[3])
    r = TraceReader(tmp_path / "t")
    assert all(torch.equal(r.tensor(3, k), t) for k, t in want.items())


def test_addresses_taken_ahead_of_the_writer_still_store_equal_tensors_once(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        sink = BackgroundSink(w)
        base = torch.arange(4000.0)
        for i in range(20):  # equal contents under distinct keys, and views of a larger tensor
            sink.record_tensor(i % 3, f"same{i}", torch.ones(1000))
            sink.record_tensor(0, f"view{i}", base[i * 100:i * 100 + 1000])
        sink.close()
        stats = w.tensor_stats()
        assert stats["stored_bytes"] == 4000 * (1 + 20) and stats["logical_bytes"] == 4000 * 40
        w.add_events([{"rank": 0, "idx": 0, "unit": 0, "kind": "marker", "op": "step", "group": -1, "seq": -1,
                       "peer": -1, "t_start": 0.0, "t_end": 0.0}])
        w.commit(fingerprint={"f": "1"}, versions={}, world_size=4, topology={}, groups=[], ranks_captured=[0, 1, 2])
    r = TraceReader(tmp_path / "t")
    assert all(torch.equal(r.tensor(0, f"view{i}"), base[i * 100:i * 100 + 1000]) for i in range(20))
    assert torch.equal(r.tensor(2, "same2"), torch.ones(1000))


def test_waiting_bytes_are_bounded_and_the_coordinator_waits_for_room():
    w = SlowWriter()
    w.gate.clear()  # the writer is stuck: the sink fills up to its bound, then record waits
    sink = BackgroundSink(w, pending_bytes=4000)
    sink.record_tensor(0, "a", torch.zeros(500))  # 2000 B
    sink.record_tensor(0, "b", torch.zeros(500))  # 4000 B: at the bound
    done = threading.Event()
    threading.Thread(target=lambda: (sink.record_tensor(0, "c", torch.zeros(500)), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # no room: waits for the writer
    w.gate.set()
    assert done.wait(5)
    sink.close()
    assert [k for _, k, _ in w.got] == ["a", "b", "c"] and sink.waited_s > 0.2


def test_a_writer_failure_is_raised_on_the_coordinators_side():
    sink = BackgroundSink(SlowWriter(fail_at=1))
    sink.record_tensor(0, "a", torch.zeros(4))
    sink.record_tensor(0, "b", torch.zeros(4))
    deadline = time.monotonic() + 5
    with pytest.raises(TraceSpaceError, match="disk filled up"):
        while time.monotonic() < deadline:
            sink.record_tensor(0, "c", torch.zeros(4))
            time.sleep(0.01)
    with pytest.raises(TraceSpaceError):
        sink.close()


def test_a_failed_capture_drops_what_waits():
    w = SlowWriter(delay=0.05)
    sink = BackgroundSink(w)
    for i in range(40):
        sink.record_tensor(0, f"k{i}", torch.zeros(4))
    t0 = time.monotonic()
    sink.close(discard=True)
    assert time.monotonic() - t0 < 1.0 and len(w.got) < 40


def test_a_batch_is_one_hand_over_its_repeated_pieces_addressed_once_and_kept_in_order(tmp_path):
    with TraceWriter(tmp_path / "t") as w:
        sink = BackgroundSink(w)
        stand_ins = [torch.full((12,), float(i)) for i in range(4)]
        big = torch.arange(float(1 << 19))  # 2 MiB: addressed on its own, between the runs of small pieces
        pieces = [stand_ins[i % 4] for i in range(512)] + [big] + [stand_ins[i % 4] for i in range(512)]
        keys = [f"r/1/50/{i}" for i in range(len(pieces))]
        sink.record_tensors(1023, keys, pieces)
        with pytest.raises(ValueError, match="2 keys for 1 tensors"):
            sink.record_tensors(1023, ["a", "b"], [big])
        sink.close()
        stats = w.tensor_stats()
        assert stats["logical_bytes"] == 1024 * 48 + big.numel() * 4
        assert stats["stored_bytes"] == 4 * 48 + big.numel() * 4
        w.add_events([{"rank": 1023, "idx": 0, "unit": 0, "kind": "marker", "op": "step", "group": -1, "seq": -1,
                       "peer": -1, "t_start": 0.0, "t_end": 0.0}])
        w.commit(fingerprint={"f": "1"}, versions={}, world_size=1024, topology={}, groups=[], ranks_captured=[1023])
    r = TraceReader(tmp_path / "t")
    assert all(torch.equal(r.tensor(1023, k), t) for k, t in zip(keys, pieces))
