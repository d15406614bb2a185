"""The live line says which phase runs and how many of the program's steps are done (of how
many, where known) — not only an elapsed time."""

import io
import re
import time

from rich.console import Console

from prism_launch.launch import progress

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _last_line(raw: str, phase: str) -> str:
    lines = [ln.strip() for ln in re.split(r"[\r\n]", _ANSI.sub("", raw)) if phase in ln]
    assert lines, raw
    return lines[-1]


def test_steps_text_with_and_without_a_total():
    assert progress.steps_text(2, 3) == "step 2/3"
    assert progress.steps_text(5, 3) == "step 3/3"
    assert progress.steps_text(1) == "1 step done"
    assert progress.steps_text(0, None) == "0 steps done"


def test_live_line_shows_steps_done_of_total_after_the_phase():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140)
    with progress.phase("emulating", console=console, steps=(0, 3)) as p:
        p._progress.refresh()
        assert "emulating step 0/3" in _last_line(out.getvalue(), "emulating")
        p.update(steps=(2, 3), info="12 ops")
        p._progress.refresh()
    assert re.search(r"emulating step 2/3 12 ops \d+:\d\d:\d\d", _last_line(out.getvalue(), "emulating"))


class _Coordinator:
    def __init__(self):
        self.t0 = time.monotonic()
        self.finished, self.ops_completed, self.bytes_recorded, self.events = set(), 0, 0, []

    def step(self, rank):
        self.events.append({"rank": rank, "kind": "marker", "op": "step"})
        self.events.append({"rank": rank, "kind": "collective", "op": "all_reduce"})


def test_capture_line_counts_the_slowest_ranks_steps(tmp_path, monkeypatch):
    from prism_launch.capture import monitor as monitor_mod

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    real_phase = monitor_mod.phase
    monkeypatch.setattr(monitor_mod, "phase", lambda *a, **kw: real_phase(*a, console=console, **kw))
    coord = _Coordinator()
    mon = monitor_mod.CaptureMonitor(coord, tmp_path / "trace", ranks=2, still_to_write=lambda: 0)
    try:
        mon.phase._progress.refresh()
        assert "capturing 2 ranks 0 steps done" in _last_line(out.getvalue(), "capturing")
        coord.step(0), coord.step(0), coord.step(1)  # rank 0 is at step 2, rank 1 at step 1
        mon.tick()
        mon.phase._progress.refresh()
        assert "capturing 2 ranks 1 step done" in _last_line(out.getvalue(), "capturing")
        coord.step(1)
        mon._next_draw = 0.0
        mon.tick()
        mon.phase._progress.refresh()
        assert "capturing 2 ranks 2 steps done" in _last_line(out.getvalue(), "capturing")
    finally:
        mon.close()
