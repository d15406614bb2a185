"""The launcher's side of waits on the GPU: chosen once per capture and said; where they were
chosen for the user and a rank's stopped, the capture runs once more without them, saying so;
set by the user, the failure stands."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prism_launch.errors import GpuWaitsStalledError, RunFailedError
from prism_launch.modes import capture as cap

DENSE = ("--num-layers", "4", "--tensor-model-parallel-size", "2")


def _ctx(setting, args=DENSE, on_cuda=True):
    return SimpleNamespace(cfg=SimpleNamespace(on_cuda=on_cuda, capture=SimpleNamespace(gpu_waits=setting,
                                                                                        gpu_exchange_mib=512)),
                           program=SimpleNamespace(args=args))


def _fake_capture(monkeypatch, stall_when_on=True):
    calls = []

    def fake(ctx, fold, payload, budget, waits=False):
        calls.append(waits)
        if waits and stall_when_on:
            raise GpuWaitsStalledError("capture failed: rank 3 exited 1 (rank 3's waits on the GPU stopped: op 9)")
        return "logs"

    monkeypatch.setattr(cap, "_capture", fake)
    return calls


def test_chosen_for_the_user_and_stopped_captures_again_without(monkeypatch, capsys):
    calls = _fake_capture(monkeypatch)
    assert cap._capture_waits(_ctx(None), None, "exact", None) == "logs"
    assert calls == [True, False]
    err = capsys.readouterr().err
    assert "waits on the GPU on (megatron:" in err and "rank 3's waits on the GPU stopped" in err
    assert "capturing again without waits on the GPU" in err


def test_set_by_the_user_the_stop_is_the_failure(monkeypatch):
    calls = _fake_capture(monkeypatch)
    with pytest.raises(RunFailedError, match="waits on the GPU stopped"):
        cap._capture_waits(_ctx(True), None, "exact", None)
    assert calls == [True]


def test_off_where_they_do_not_apply(monkeypatch, capsys):
    calls = _fake_capture(monkeypatch)
    cap._capture_waits(_ctx(None, on_cuda=False), None, "exact", None)
    cap._capture_waits(_ctx(None), None, "none", None)  # nothing is exchanged
    cap._capture_waits(_ctx(None, args=(*DENSE, "--num-experts", "4")), None, "exact", None)
    assert calls == [False, False, False]
    assert "waits on the GPU off (megatron: --num-experts" in capsys.readouterr().err


def test_a_failure_names_a_stop_a_rank_reported_and_only_then():
    class Coord:
        def __init__(self, said):
            self.gpu_waits_stalled, self.pumps = [], 0
            self._said = said

        def pump(self, t):
            self.pumps += 1
            if self._said and self.pumps == 3:  # the rank's word arrives after its exit was seen
                self.gpu_waits_stalled.append((5, "deadline exceeded: op 2"))

    e = cap._failure(Coord(True), RunFailedError("capture failed: rank 5 exited 1"))
    assert isinstance(e, GpuWaitsStalledError) and "rank 5's waits on the GPU stopped: deadline exceeded: op 2" in str(e)
    plain = RunFailedError("capture failed: rank 5 exited 1")
    assert cap._failure(Coord(False), plain) is plain
