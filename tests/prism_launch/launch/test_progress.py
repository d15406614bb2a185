"""Progress lines: shown on a terminal (or when asked), nothing in a batch log."""

import io
import re

from rich.console import Console

from prism_launch.launch import progress

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _lines(raw: str) -> list[str]:
    """What a terminal showed, one line per redraw: escape codes and carriage returns dropped."""
    return [ln.strip() for ln in re.split(r"[\r\n]", _ANSI.sub("", raw)) if ln.strip()]


def test_quiet_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert not progress.enabled(None) and progress.enabled(True) and not progress.enabled(False)
    with progress.phase("capturing 2 ranks") as p:
        assert not p.live
        p.update(completed=1, info="5 ops")
    assert out.getvalue() == "" and capsys.readouterr().err == ""  # a batch log gets nothing


def test_live_line_shows_the_phase_and_its_counters():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress.phase("calibrating", total=3, console=console) as p:
        assert p.live
        p.update(completed=2, info="slice 2/3")
        p._progress.refresh()
    shown = [ln for ln in _lines(out.getvalue()) if "calibrating" in ln]
    assert shown, out.getvalue()
    last = shown[-1]
    # the phase, then its count of the total, then its counter text and elapsed time, in that order
    assert re.search(r"calibrating.*\b2/3\b.*slice 2/3.*\d+:\d\d:\d\d", last), last


def test_a_phase_without_a_total_shows_its_counter_and_no_count():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress.phase("capturing 8 ranks", console=console) as p:
        p.update(info="120 ops, 3 groups")
        p._progress.refresh()
    [*_, last] = [ln for ln in _lines(out.getvalue()) if "capturing 8 ranks" in ln]
    assert "120 ops, 3 groups" in last and not re.search(r"\b\d+/\d+\b", last), last


def test_the_live_line_is_gone_once_the_phase_ends():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with progress.phase("emulating", console=console) as p:
        p.update(info="step 1")
        p._progress.refresh()
    console.print("after")
    tail = _ANSI.sub("", out.getvalue()).rsplit("step 1", 1)[1]
    assert "after" in tail and "emulating" not in tail  # transient: erased, not left in the scrollback
