"""Progress lines: shown on a terminal (or when asked), nothing in a batch log."""

import io

from rich.console import Console

from prism_launch.launch import progress


def test_quiet_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert not progress.enabled(None) and progress.enabled(True) and not progress.enabled(False)
    with progress.phase("capturing 2 ranks") as p:
        assert not p.live
        p.update(info="5 ops")


def test_live_line_shows_the_phase_and_its_counters():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress.phase("calibrating", total=3, console=console) as p:
        assert p.live
        p.update(completed=2, info="slice 2/3")
        p._progress.refresh()
    text = out.getvalue()
    assert "calibrating" in text and "2/3" in text and "slice 2/3" in text
