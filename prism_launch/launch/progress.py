"""Live progress of the launcher's long phases (capture, group discovery, calibration
slices, emulation) with ``rich``: one line per phase — what runs, a bar when the total is
known, the program's steps done (of how many, where known), counters, elapsed time and ETA. Shown only when stdout is a terminal (or
``launch.progress=true``); in batch logs nothing is printed, as with torchrun. Rank output
that the tee prints while a phase runs scrolls above the live line."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Phase", "enabled", "phase", "steps_text"]


def steps_text(done: int, total: int | None = None) -> str:
    """The live line's step counter: ``step 2/3`` where the total is known, else ``2 steps done``
    (training steps of the program, counted at its optimizer's steps)."""
    if total:
        return f"step {min(done, total)}/{total}"
    return f"{done} step{'' if done == 1 else 's'} done"


def enabled(setting: bool | None) -> bool:
    """``launch.progress``: None follows whether stdout is a terminal."""
    if setting is not None:
        return bool(setting)
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class Phase:
    """Handle of one running phase; ``update`` is cheap (rich redraws at most 4 times a second)."""

    def __init__(self, progress=None, task=None) -> None:
        self._progress, self._task = progress, task
        self.t0 = time.monotonic()

    @property
    def live(self) -> bool:
        return self._progress is not None

    def update(self, *, completed: float | None = None, total: float | None = None, info: str | None = None,
               steps: tuple[int, int | None] | None = None) -> None:
        """``steps``: (steps done, total or None), shown right after the phase's name."""
        if self._progress is None:
            return
        kw = {}
        if steps is not None:
            kw["steps"] = steps_text(*steps)
        if completed is not None:
            kw["completed"] = completed
        if total is not None:
            kw["total"] = total
        if info is not None:
            kw["info"] = info
        self._progress.update(self._task, **kw)


@contextmanager
def phase(description: str, *, setting: bool | None = None, total: float | None = None,
          console=None, steps: tuple[int, int | None] | None = None) -> Iterator[Phase]:
    """``with phase("capture", total=None) as p: ... p.update(info="...")`` — a live line for
    the block when progress is on (``setting``: ``launch.progress``), else a no-op handle.
    ``steps``: the step counter to show from the start (see :meth:`Phase.update`)."""
    if console is None and not enabled(setting):
        yield Phase()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = [SpinnerColumn(), TextColumn("[bold]{task.description}"), TextColumn("{task.fields[steps]}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    columns += [TextColumn("{task.fields[info]}"), TimeElapsedColumn()]
    progress = Progress(*columns, console=console or Console(), transient=True, redirect_stdout=True,
                        redirect_stderr=True, refresh_per_second=4)
    with progress:
        task = progress.add_task(description, total=total, info="", steps="" if steps is None else steps_text(*steps))
        yield Phase(progress, task)
