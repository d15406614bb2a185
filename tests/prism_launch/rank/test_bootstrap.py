"""What a sandbox process reads from the trace before the program runs."""

from __future__ import annotations

from prism_launch.config.plan import RankPlan
from prism_launch.rank.transports import captured_peak, gpu_sharers
from prism_launch.trace import TraceReader, TraceWriter


def _trace(tmp_path, memory: dict | None) -> TraceReader:
    with TraceWriter(tmp_path / "t") as w:
        if memory is not None:
            w.write_json("memory.json", memory)
        w.commit(fingerprint={}, versions={}, world_size=8, topology={}, groups=[], ranks_captured=[0, 4])
    return TraceReader(tmp_path / "t")


def _plan(ranks: int) -> RankPlan:
    """A plan whose launcher starts logical ranks 10, 11, ... in device-slot order."""
    return RankPlan(mode="emulate", device="cuda", timeout_s=30, local_ranks=tuple(range(10, 10 + ranks)))


def test_captured_peak_of_the_rank_or_of_the_largest_captured_rank(tmp_path):
    reader = _trace(tmp_path, {"0": {"peak_bytes": 1000}, "4": {"peak_bytes": 3000}, "5": {"peak_bytes": None}})
    assert captured_peak(reader, 0) == 1000
    assert captured_peak(reader, 4) == 3000
    assert captured_peak(reader, 6) == 3000  # folded into a captured rank: the largest is the safe bound


def test_no_memory_record_nocaptured_peak(tmp_path):
    assert captured_peak(_trace(tmp_path, None), 0) is None


def test_gpu_sharers_without_cuda_is_one():
    assert gpu_sharers(_plan(4), 1) == 1  # this machine has no GPU


def test_gpu_sharers_counts_the_slots_dealt_to_the_same_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_sharers(_plan(4), 11) == 2  # slots 1 and 3 on GPU 1
    assert gpu_sharers(_plan(3), 10) == 2  # slots 0 and 2 on GPU 0
    assert gpu_sharers(_plan(2), 11) == 1
