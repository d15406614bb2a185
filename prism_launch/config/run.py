"""The run itself: mode, rank processes, physical machines, communication deadlines, the report."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from prism_launch.config.errors import ConfigError

class Mode(StrEnum):
    real = "real"
    """Every rank physical, like torchrun (the baseline runner)."""
    capture = "capture"
    """Every logical rank runs; the coordinator computes collectives and writes a PrismTrace."""
    emulate = "emulate"
    """Only sandbox ranks run; virtual ranks are replayed from the trace."""
    calibrate = "calibrate"
    """Run slices of ranks for real against the bare trace; write the calibrated trace."""
    auto = "auto"
    """Capture when no matching trace exists, then emulate."""


class StartMethod(StrEnum):
    fork = "fork"
    """Ranks forked from the warmed launcher (fast, light: shared pages)."""
    spawn = "spawn"
    """Each rank a fresh ``python -m prism_launch.rank.bootstrap`` (always used with --no-python)."""


@dataclass(kw_only=True, slots=True)
class PhysicalConfig:
    """The machines the sandbox ranks run on (emulation)."""

    nodes: int = 1
    """Physical machines sharing the sandbox ranks; start one prism-launch per machine with the
    same command and its ``physical.node_rank``."""
    node_rank: int = 0
    """This machine's index; node 0 hosts the rendezvous store, the assistant and the report."""
    endpoint: str | None = None
    """``host:port`` of node 0's c10d TCPStore (required when ``nodes > 1``; node 0 listens on
    the port, like torchrun's ``--rdzv-endpoint``)."""

    def validate(self, sandbox_ranks: int) -> None:
        if self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"physical.node_rank must be in [0, physical.nodes={self.nodes}) (got {self.node_rank})")
        if self.nodes > 1:
            ep = self.endpoint
            if not ep or ":" not in ep or not ep.rsplit(":", 1)[1].isdigit():
                raise ConfigError(f"physical.nodes={self.nodes} needs physical.endpoint=HOST:PORT of node 0's store "
                                  f"(got {ep!r})")
            if sandbox_ranks < self.nodes:
                raise ConfigError(f"physical.nodes={self.nodes} but only {sandbox_ranks} sandbox rank(s): "
                                  "every node needs at least one sandbox rank")


@dataclass(kw_only=True, slots=True)
class CommConfig:
    timeout_s: float = 300.0
    """Deadline of every communication wait; a wait past it fails naming rank, group, op and sequence number."""
    subgroups: str = "auto"
    """How the script's sub-group creation reaches the prism process group: ``delegate`` (torch
    >= 2.13 hands ``new_group`` to the default group), ``intercept`` (below the public API, the
    path older torch needs), ``auto`` (delegate where this torch does)."""

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"comm.timeout_s must be > 0 (got {self.timeout_s})")
        if self.subgroups not in ("auto", "delegate", "intercept"):
            raise ConfigError(f"comm.subgroups must be auto, delegate or intercept (got {self.subgroups!r})")


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    start_method: StartMethod | None = None
    """How rank processes start. Default: fork on CPU; spawn on CUDA (a forked child cannot use
    a CUDA driver its parent touched)."""
    teardown_timeout_s: float = 10.0
    """Grace between SIGTERM and SIGKILL when tearing ranks down."""
    run_timeout_s: float | None = None
    """Wall-clock limit of the whole run. None (the default): no limit of its own, for a long
    run is legitimate; the launcher still never waits for good on a rank that cannot finish:
    in capture and emulation every communication wait of a rank ends by ``comm.timeout_s``
    (the rank then fails and exits), the launcher sees every rank's exit at once and tears the
    others down at the first failure, and a rank that is stopped or stuck holding the
    interpreter (no heartbeat for ``comm.timeout_s``, :mod:`prism_launch.launch.heartbeat`)
    ends the run naming it. What none of these bounds is a program that computes for good
    without communicating (as with torchrun): set a limit here for that."""
    progress: bool | None = None
    """Live progress on the terminal (capture, group discovery, calibration slices, emulation,
    sweeps). None: only when stdout is a terminal (batch logs stay quiet, as with torchrun)."""
    debug: bool = False
    """Print the launcher's own Python traceback with an error (also ``PRISM_DEBUG=1``). By
    default an error is one plain message: the failing rank's error first, then what to do."""

    def validate(self) -> None:
        if self.teardown_timeout_s <= 0:
            raise ConfigError(f"launch.teardown_timeout_s must be > 0 (got {self.teardown_timeout_s})")
        if self.run_timeout_s is not None and self.run_timeout_s <= 0:
            raise ConfigError(f"launch.run_timeout_s must be > 0 or null (got {self.run_timeout_s})")


@dataclass(kw_only=True, slots=True)
class ReportConfig:
    dir: str | None = None
    """Where emulation writes its report. Default: ``<trace.dir>/report``."""
    loss_pattern: str = r"\bloss[\s=:|]+([-+0-9.eEinfa]+)"
    """Regex whose first group is the loss in a rank's log line (for the step table)."""
    step_pattern: str = r"\bstep[\s=:]+(\d+)"
    """Regex whose first group is the step number in the same line."""

    def validate(self) -> None:
        import re

        for name in ("loss_pattern", "step_pattern"):
            try:
                groups = re.compile(getattr(self, name)).groups
            except re.error as e:
                raise ConfigError(f"report.{name} is not a regular expression: {e}") from None
            if groups < 1:
                raise ConfigError(f"report.{name} needs a group around the value, e.g. 'loss: ([0-9.]+)'")
