"""Whether a trace's recorded script arguments match today's, and if not, what differs.

The recorded arguments are compared with today's under today's list of output-only flags
(every integration's, plus ``trace.ignore_args``), not under the list the capture had: a
flag first declared output-only at emulation (``trace.ignore_args=[--out]``) may take a new
value then. A refusal names each flag whose value differs, says the order changed only when
nothing else did, and its advice names the flags to declare.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prism_launch.launch.args import _flag, args_by_flag, differing_args, mask_output_args

POSITIONAL = "<positional>"
""":func:`~prism_launch.launch.args.args_by_flag`'s key for bare arguments."""


@dataclass(frozen=True, slots=True)
class ArgsMismatch:
    """Recorded and today's arguments differ, with today's output-only flags masked."""

    recorded: tuple[str, ...]
    now: tuple[str, ...]
    flags: tuple[str, ...]
    """The flags (or :data:`POSITIONAL`) whose values differ; empty: only the order did."""
    ignored: tuple[str, ...]
    """``trace.ignore_args`` as given today (the advice adds to it)."""

    @property
    def reordered(self) -> bool:
        """The same flags with the same values, in another order."""
        return not self.flags

    def describe(self) -> str:
        """One clause for the refusal: what differs, then what to do."""
        if self.reordered:
            return (f"script args differ in order only: recorded {list(self.recorded)} vs now {list(self.now)} "
                    "(give them in the recorded order, or capture again)")
        was, now = args_by_flag(list(self.recorded)), args_by_flag(list(self.now))

        def shown(values: list[str] | None) -> str:
            return "absent" if values is None else " ".join(values) or "(present)"

        changes = "; ".join(f"{'arguments without a flag' if f == POSITIONAL else f}: recorded {shown(was.get(f))}, "
                            f"now {shown(now.get(f))}" for f in self.flags)
        named = [f for f in self.flags if f != POSITIONAL]
        if not named:
            return f"script args differ: {changes} (arguments without a flag always key the trace: capture again)"
        declare = list(dict.fromkeys([*self.ignored, *named]))
        return (f"script args differ: {changes} (if {', '.join(named)} only say{'s' if len(named) == 1 else ''} "
                f"where outputs go, declare {'it' if len(named) == 1 else 'them'} output-only: "
                f"trace.ignore_args=[{','.join(declare)}]; else capture again)")


def _spelled_out(args: list[str]) -> list[str]:
    """``--flag=value`` as ``--flag value``: the two spellings say the same to argparse."""
    out: list[str] = []
    for arg in args:
        name = _flag(arg)
        out.extend((name, arg.split("=", 1)[1]) if name is not None and "=" in arg else (arg,))
    return out


def compare_args(recorded: Iterable[str], now: Iterable[str], output_only: frozenset[str],
                 ignored: Iterable[str] = ()) -> ArgsMismatch | None:
    """None where ``recorded`` and ``now`` key the same trace with the flags in
    ``output_only`` masked (their presence counts, their values do not); else what differs.
    ``ignored``: today's ``trace.ignore_args``, for the advice."""
    recorded, now = list(recorded), list(now)
    a, b = _spelled_out(mask_output_args(recorded, output_only)), _spelled_out(mask_output_args(now, output_only))
    if a == b:
        return None
    return ArgsMismatch(recorded=tuple(recorded), now=tuple(now), flags=tuple(differing_args(a, b)),
                        ignored=tuple(ignored))


__all__ = ["POSITIONAL", "ArgsMismatch", "compare_args"]
