"""What a device path's prefetch can do and what it counts: the prefetch modes
(``emulate.prefetch.mode``) and :class:`PrefetchStats`, the figures a rank's summary reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class PrefetchMode:
    STREAM = "stream"
    OFF = "off"
    PRELOAD = "preload"
    INLINE = "inline"
    ALL = (STREAM, OFF, PRELOAD, INLINE)
    STREAMING = (STREAM, INLINE)


@dataclass(slots=True)
class PrefetchStats:
    mode: str = PrefetchMode.STREAM
    pool_bytes: int = 0
    pool_grown: bool = False
    """A streaming mode took a pool holding the whole run's staged data and filled it before
    the first op (``prefetch.grow``: the device had it to spare)."""
    preload_s: float = 0.0
    """How long the first op waited while the whole run was staged (preload, or a grown pool)."""
    staged_ops: int = 0
    staged_bytes: int = 0
    hits: int = 0
    """Ops whose data was on the device before they were entered."""
    in_flight: int = 0
    """Ops whose copy was still running when entered: the op's stream waited, the host did not."""
    stalls: int = 0
    """Ops the stager had not reached when entered: the host waited."""
    stall_s: float = 0.0
    high_water_bytes: int = 0
    host_tier_bytes: int = 0
    """Pinned host memory holding the run's staged data, filled ahead by the loader."""
    host_tier_pinned: bool = False
    host_tier_load_s: float = 0.0
    """How long the loader took to fill the host tier (from the trace's mapped files)."""
    host_tier_lead_s: float | None = None
    """How long before the first op the host tier was full (negative: after it)."""
    stager_batches: int = 0
    copies: int = 0
    """Host-to-pool copies issued (a batch of ops back to back in the pool takes one)."""
    stager_cpu_s: float = 0.0
    """CPU time of the stager thread (it shares the interpreter with the program)."""
    checks: int = 0
    check_flushes: int = 0
    delayed_s: float = 0.0
    """Virtual members' lateness enqueued on the device (``emulate.timing``)."""

    def as_dict(self) -> dict:
        return asdict(self)

