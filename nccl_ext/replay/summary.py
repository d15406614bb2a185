"""What a sandbox rank's replay counts (:class:`ReplayStats`; :func:`own_time` for the time its
program's thread spends in the transport) and the summary it leaves for the launcher's report
(:func:`write_summary`: one JSON file per rank)."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from nccl_ext.core.atomic import atomic_write_text


@dataclass(slots=True)
class ReplayStats:
    ops: int = 0
    folded_ops: int = 0
    """Collectives answered from the recorded result of a folded capture."""
    p2p: int = 0
    physical_exchanges: int = 0
    waited_s: float = 0.0
    own_s: float = 0.0
    """Wall time the program's thread spent in this transport issuing ops (serving virtual
    members, staging waits and checks included): the virtual side's cost on the sandbox's CPU."""
    divergences: list[dict] = field(default_factory=list)
    """The first few divergences of each kind in full (``nccl_ext/replay/divergence.py``)."""
    divergence_counts: dict[str, int] = field(default_factory=dict)
    """Divergences by kind (value, tolerance, host_scalar); a deterministic run has none."""
    steps: list[dict] = field(default_factory=list)
    synthesized: int = 0
    """Ops whose results were synthesized from this rank's own contributions (``payload=none``)."""
    carried: int = 0
    """Of those, broadcasts answered with the payload the capture carried."""
    helper_threads: int = 0
    """Threads started to complete ops (exchanges, timed finishes, ring workers)."""
    in_flight_at_close: list[str] = field(default_factory=list)
    """Ops whose thread was still running when the rank closed (the program never waited for
    them, or they failed); empty for a program that completes all its communication."""


def own_time(method):
    """Count the wall time the calling thread spends in ``method`` into ``stats.own_s``."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.stats.own_s += time.perf_counter() - t0

    return timed


def write_summary(path: Path, rank: int, stats: ReplayStats, *, ring_groups: int,
                  spans: list[tuple[str, float, float]], memory: dict | None, prefetch: dict | None) -> None:
    """The rank's summary at ``path``: ``stats``, the pruned ring groups it created, its compute
    spans, its memory figures and its device path's prefetch figures (None: no device path)."""
    atomic_write_text(path, json.dumps({
        "rank": rank, "ops": stats.ops, "p2p": stats.p2p,
        "physical_exchanges": stats.physical_exchanges, "folded_ops": stats.folded_ops, "waited_s": stats.waited_s,
        "own_s": stats.own_s, "synthesized": stats.synthesized, "carried": stats.carried,
        "helper_threads": stats.helper_threads, "in_flight_at_close": stats.in_flight_at_close,
        "ring_groups": ring_groups,
        "divergences": stats.divergences,
        "divergence_counts": {k: stats.divergence_counts.get(k, 0) for k in ("value", "tolerance", "host_scalar")},
        "steps": stats.steps,
        "spans": spans, "memory": memory,
        "prefetch": prefetch,
    }, indent=1))
