"""Errors prism-launch reports to the user (message first, then what to do)."""

from __future__ import annotations


class PrismError(RuntimeError):
    """A run could not proceed; the message says why and what to do."""


class TraceMismatchError(PrismError):
    """The trace was recorded for another config, script, arguments or library versions."""


class RunFailedError(PrismError):
    """A rank failed; the message carries its rank and traceback location."""
