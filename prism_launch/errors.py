"""Errors prism-launch reports to the user (message first, then what to do)."""

from __future__ import annotations

import signal


class PrismError(RuntimeError):
    """A run could not proceed; the message says why and what to do."""


class TraceMismatchError(PrismError):
    """The trace was recorded for another config, script, arguments or library versions."""


class RunFailedError(PrismError):
    """A rank failed; the message carries its rank and traceback location."""


class GpuWaitsStalledError(RunFailedError):
    """A capture failed after a rank's waits on the GPU stopped (``capture.gpu_waits``)."""


class Interrupted(KeyboardInterrupt):
    """The launcher received SIGINT, SIGTERM or SIGHUP; every rank has been (or is being)
    stopped. ``exit_code`` is what a shell expects of a process ended by that signal."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(f"received {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
