"""bench/replay_scale.py builds a 1F1B pipeline and its replay meets 1F1B's closed form."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import replay_scale  # noqa: E402


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (2, 3), (4, 2)])
def test_one_f_one_b_order_keeps_at_most_pp_minus_stage_in_flight(pp, m):
    for stage in range(pp):
        order = replay_scale.one_f_one_b(pp, stage, m)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        in_flight, most = 0, 0
        for phase, _ in order:
            in_flight += 1 if phase == "F" else -1
            most = max(most, in_flight)
        assert most == min(pp - stage, m)


def test_bench_meets_the_closed_form(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["replay_scale", "--world", "32", "--tp", "2", "--pp", "4", "--steps", "2"])
    assert replay_scale.main() == 0
    assert "1F1B closed form" in capsys.readouterr().out
