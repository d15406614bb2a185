"""What a sandbox process reads from the trace before the program runs."""

from __future__ import annotations

from prism_launch.rank.bootstrap import _captured_peak
from prism_launch.trace.store import TraceReader, TraceWriter


def _trace(tmp_path, memory: dict | None) -> TraceReader:
    with TraceWriter(tmp_path / "t") as w:
        if memory is not None:
            w.write_json("memory.json", memory)
        w.commit(fingerprint={}, versions={}, world_size=8, topology={}, groups=[], ranks_captured=[0, 4])
    return TraceReader(tmp_path / "t")


def test_captured_peak_of_the_rank_or_of_the_largest_captured_rank(tmp_path):
    reader = _trace(tmp_path, {"0": {"peak_bytes": 1000}, "4": {"peak_bytes": 3000}, "5": {"peak_bytes": None}})
    assert _captured_peak(reader, 0) == 1000
    assert _captured_peak(reader, 4) == 3000
    assert _captured_peak(reader, 6) == 3000  # folded into a captured rank: the largest is the safe bound


def test_no_memory_record_no_captured_peak(tmp_path):
    assert _captured_peak(_trace(tmp_path, None), 0) is None


def test_gpu_sharers_without_cuda_is_one():
    from prism_launch.rank.bootstrap import _gpu_sharers

    assert _gpu_sharers({"PRISM_DEVICE_SLOT": "1", "PRISM_DEVICE_SLOTS": "4"}) == 1  # this machine has no GPU


def test_gpu_sharers_counts_the_slots_dealt_to_the_same_gpu(monkeypatch):
    import torch

    from prism_launch.rank.bootstrap import _gpu_sharers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _gpu_sharers({"PRISM_DEVICE_SLOT": "1", "PRISM_DEVICE_SLOTS": "4"}) == 2  # slots 1 and 3 on GPU 1
    assert _gpu_sharers({"PRISM_DEVICE_SLOT": "0", "PRISM_DEVICE_SLOTS": "3"}) == 2  # slots 0 and 2 on GPU 0
    assert _gpu_sharers({"PRISM_DEVICE_SLOT": "1", "PRISM_DEVICE_SLOTS": "2"}) == 1
