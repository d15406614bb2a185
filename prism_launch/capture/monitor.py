"""What the launcher watches while a capture runs: the coordinator's counters on the live
progress line (ranks, ops, ops/s, bytes recorded, and an ETA when an earlier capture of the
same run said how many ops to expect), and the free disk space at the trace's place against
what the trace still has to write — the next spill file of tensors (they go to disk as they
are recorded) — so a disk that cannot hold it ends the capture at once with a plain message
(needed vs free, where) instead of a failed write after it."""

from __future__ import annotations

import time
from contextlib import ExitStack
from collections.abc import Callable
from pathlib import Path

from prism_launch.launch.progress import phase
from prism_launch.trace.space import require_space

SPACE_CHECK_S = 2.0


class CaptureMonitor:
    """Called on every tick of the capture's wait (``tick``); ``close`` ends its progress line."""

    def __init__(self, coord, trace_root: Path, *, ranks: int, setting: bool | None = None,
                 expected_ops: int | None = None, still_to_write: Callable[[], int] | None = None):
        self.coord, self.trace_root = coord, Path(trace_root)
        self.still_to_write = still_to_write or (lambda: coord.bytes_recorded)
        """Bytes the trace has yet to write (default: every tensor recorded, none written yet)."""
        self.ranks, self.expected_ops = ranks, expected_ops
        self._stack = ExitStack()
        self.phase = self._stack.enter_context(phase(f"capturing {ranks} ranks", setting=setting, total=expected_ops,
                                                     steps=(0, None)))
        self._steps: dict[int, int] = {}  # step markers seen per rank (the slowest rank's count is shown)
        self._events_seen = 0
        self._next_space = 0.0
        self._next_draw = 0.0

    def close(self) -> None:
        self._stack.close()

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_space:
            self._next_space = now + SPACE_CHECK_S
            require_space(self.trace_root.parent, self.still_to_write(), during=True)
        if self.phase.live and now >= self._next_draw:
            self._next_draw = now + 0.25
            c = self.coord
            wall = max(now - c.t0, 1e-9)
            info = (f"{len(c.finished)}/{self.ranks} ranks done · {c.ops_completed} ops · "
                    f"{c.ops_completed / wall:.0f} ops/s · {c.bytes_recorded / 2**20:.1f} MiB")
            for row in c.events[self._events_seen:]:
                if row["kind"] == "marker" and row["op"] == "step":
                    self._steps[row["rank"]] = self._steps.get(row["rank"], 0) + 1
            self._events_seen = len(c.events)
            slowest = min(self._steps.values()) if len(self._steps) == self.ranks else 0
            self.phase.update(completed=c.ops_completed if self.expected_ops else None, info=info,
                              steps=(slowest, None))
