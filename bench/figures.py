"""The benches' figure check: every figure a bench prints is a :class:`Figure` (its name, its
measured value, and the goal it must meet, if any); :func:`table` prints them ("MISSING" where a
value was not measured, "MISSED" beside a goal not met) and :func:`exit_code` is non-zero when
any figure is missing or misses its goal — so a bench can never print a default (0, "none",
nan) in place of a value it did not get and still exit 0.

    figures = [Figure("capture s", 12.3), Figure("bit-identical", same, IS_TRUE)]
    print(table(figures))
    sys.exit(exit_code(figures))
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Goal:
    """What a figure must be to pass, in words (printed) and as a test of its value."""

    text: str
    met: Callable[[Any], bool]


def at_most(limit: float, unit: str = "") -> Goal:
    return Goal(f"<= {limit:g}{unit}", lambda v: v <= limit)


def at_least(limit: float, unit: str = "") -> Goal:
    return Goal(f">= {limit:g}{unit}", lambda v: v >= limit)


def equals(expected: Any) -> Goal:
    return Goal(f"== {expected!r}", lambda v: v == expected)


IS_TRUE = Goal("true", lambda v: v is True)
NONE_LISTED = Goal("none", lambda v: len(v) == 0)
"""For a list figure whose goal is emptiness (OOM ranks, value divergences): an empty list is
a measured value that meets the goal, not a missing one."""


@dataclass(frozen=True, slots=True)
class Figure:
    """One printed figure: ``value`` None, a non-finite float or an empty list means it was not
    measured (a list whose goal is :data:`NONE_LISTED` may be empty)."""

    name: str
    value: Any
    goal: Goal | None = None
    fmt: str = ""
    """``format`` spec for the value (e.g. ".1f"); empty: ``str(value)``."""

    @property
    def missing(self) -> bool:
        v = self.value
        return v is None or (isinstance(v, float) and not math.isfinite(v)) or (
            self.goal is not NONE_LISTED and isinstance(v, (list, tuple, dict)) and len(v) == 0)

    @property
    def missed(self) -> bool:
        """Measured, with a goal it does not meet (a goal that cannot be tested counts as missed)."""
        if self.missing or self.goal is None:
            return False
        try:
            return not self.goal.met(self.value)
        except (TypeError, ValueError):
            return True

    def shown(self) -> str:
        if self.missing:
            return "MISSING"
        return format(self.value, self.fmt) if self.fmt else str(self.value)


def problems(figures: Iterable[Figure]) -> list[str]:
    """What fails: one line per missing figure and per missed goal."""
    out = []
    for f in figures:
        if f.missing:
            out.append(f"{f.name}: MISSING (not measured)")
        elif f.missed:
            out.append(f"{f.name}: {f.shown()} misses its goal {f.goal.text}")
    return out


def exit_code(figures: Iterable[Figure]) -> int:
    """1 when any figure is missing or misses its goal, else 0."""
    return 1 if problems(figures) else 0


def table(figures: Iterable[Figure], title: str = "figures") -> str:
    """The figures one a line: name, value (or MISSING), goal and, when missed, MISSED."""
    figures = list(figures)
    width = max([len(f.name) for f in figures] + [len(title)])
    lines = [title]
    for f in figures:
        mark = "  MISSED" if f.missed else ""
        goal = f"  (goal {f.goal.text})" if f.goal is not None else ""
        lines.append(f"  {f.name:<{width}}  {f.shown()}{goal}{mark}")
    return "\n".join(lines)


def report(figures: Iterable[Figure], title: str = "figures") -> int:
    """Print the table (stdout) and each problem (stderr, "FAIL: ..."); return the exit code."""
    figures = list(figures)
    print(table(figures, title), flush=True)
    for p in problems(figures):
        print(f"FAIL: {p}", file=sys.stderr, flush=True)
    return exit_code(figures)
