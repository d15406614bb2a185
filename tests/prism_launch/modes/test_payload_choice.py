"""``capture.payload=auto``: which policies it tries (``exact`` first under ``mode=auto``
without calibration, else ``full`` first), the budget (``capture.payload_budget_gib`` or the
free disk at the trace directory, less 10%, whichever is smaller, named), and a capture past
the budget recording again with the next policy, saying why."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest

from prism_launch.capture.ops_state import PayloadBudgetError
from prism_launch.config import Mode, Payload
from prism_launch.modes import capture as cap

Usage = namedtuple("Usage", "total used free")


def ctx(tmp_path: Path, *, mode=Mode.auto, in_auto=False, payload=Payload.auto, budget_gib=32.0):
    cfg = SimpleNamespace(mode=mode, calibrate=SimpleNamespace(in_auto=in_auto),
                          capture=SimpleNamespace(payload=payload, payload_budget_gib=budget_gib),
                          sandbox=SimpleNamespace(ranks=[5]))
    return SimpleNamespace(cfg=cfg, trace=SimpleNamespace(root=tmp_path / "traces" / "tr"))


def test_auto_mode_without_calibration_tries_exact_first(tmp_path):
    assert cap.auto_policies(ctx(tmp_path, mode=Mode.auto, in_auto=False)) == ["exact", "none"]


@pytest.mark.parametrize(("mode", "in_auto"), [(Mode.auto, True), (Mode.capture, False), (Mode.capture, True)])
def test_otherwise_full_first_then_exact_then_none(tmp_path, mode, in_auto):
    assert cap.auto_policies(ctx(tmp_path, mode=mode, in_auto=in_auto)) == ["full", "exact", "none"]


def test_the_budget_is_the_configured_cap_when_the_disk_has_more(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 50, 0, 1 << 45))
    budget, why = cap.payload_budget(ctx(tmp_path, budget_gib=2))
    assert budget == 2 * 2**30 and why == "capture.payload_budget_gib=2"


def test_the_budget_is_the_free_disk_at_the_trace_folder_when_smaller(tmp_path, monkeypatch):
    asked = []

    def usage(p):
        asked.append(Path(p))
        return Usage(1 << 40, 0, 10 * 2**30)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    budget, why = cap.payload_budget(ctx(tmp_path, budget_gib=32))
    assert budget == int(10 * 2**30 * 0.9)
    # the trace's folder does not exist yet: its nearest existing ancestor is asked, and named
    assert asked == [tmp_path] and why == f"the free space at {tmp_path}"


def _run_auto(tmp_path, monkeypatch, c, over: set[str]):
    tried = []

    def capture_waits(_ctx, _fold, payload, budget):
        tried.append((payload, budget))
        if payload in over:
            raise PayloadBudgetError(f"the {payload} trace's tensors reached 9.00 GiB")
        return tmp_path / "logs"

    monkeypatch.setattr(cap, "fold_plan", lambda _ctx: None)
    monkeypatch.setattr(cap, "_capture_waits", capture_waits)
    return cap.capture(c), tried


def test_past_the_disk_budget_auto_records_again_with_the_next_policy_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, 0, 10 * 2**30))
    logs, tried = _run_auto(tmp_path, monkeypatch, ctx(tmp_path, mode=Mode.auto), over={"exact"})
    budget = int(10 * 2**30 * 0.9)
    assert logs == tmp_path / "logs" and tried == [("exact", budget), ("none", None)]
    err = capsys.readouterr().err
    assert "capture.payload=auto" in err and "the exact trace's tensors reached 9.00 GiB" in err
    assert f"the free space at {tmp_path}" in err and f"({budget / 2**30:.2f} GiB)" in err
    assert "recording again with payload=none" in err


def test_outside_auto_mode_full_then_exact_then_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 50, 0, 1 << 45))
    _logs, tried = _run_auto(tmp_path, monkeypatch, ctx(tmp_path, mode=Mode.capture, budget_gib=1),
                             over={"full", "exact"})
    assert [p for p, _ in tried] == ["full", "exact", "none"]
    err = capsys.readouterr().err
    assert "capture.payload_budget_gib=1" in err
    assert "recording again with payload=exact (only the tensors sandbox ranks [5] consume)" in err
    assert "recording again with payload=none" in err


def test_a_policy_set_by_hand_is_used_as_is_with_no_budget(tmp_path, monkeypatch):
    _logs, tried = _run_auto(tmp_path, monkeypatch, ctx(tmp_path, payload=Payload.full), over=set())
    assert tried == [("full", None)]
