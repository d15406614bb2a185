"""The communication layer's errors, in one place, and how an exception is named in a message.

A caller decides what to do with an error by its type and its fields (``isinstance(e,
CommDeadlineError)``, ``e.rank``), never by its text: the text is for the person reading it
and may be reworded at any time. :class:`CommError` and its subclasses describe a failed
communication op and carry the logical rank, the group, the op and its sequence number
wherever the raiser knows them (None where it does not).
"""

from __future__ import annotations

import pickle


class CommError(RuntimeError):
    """A communication op failed; the message names the rank, the op, its group and sequence
    number (the op's ``what``) and what to do. Raised by this layer only: an error that is not
    a :class:`CommError` came from below it (the physical backend, the driver)."""

    def __init__(self, message: str, *, rank: int | None = None, group: str | None = None,
                 op: str | None = None, seq: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        """The logical rank that issued the op."""
        self.group = group
        """The group's description (or key) the op ran on."""
        self.op = op
        """The torch API of the op (``allreduce``, ``send`` ...)."""
        self.seq = seq
        """The op's sequence number on its group."""

    def __reduce__(self):  # keyword fields survive pickling (errors cross process boundaries)
        return (_rebuild, (type(self), str(self), self.rank, self.group, self.op, self.seq))


def _rebuild(cls, message, rank, group, op, seq):
    return cls(message, rank=rank, group=group, op=op, seq=seq)


class CommDeadlineError(CommError):
    """A communication op did not complete before its deadline, or within the caller's own
    timeout (``Work.wait(timeout)``, ``monitored_barrier(timeout=)``). The message names the
    logical rank, the group, the op and its sequence number (the op's ``what``), what it was
    still waiting for, the limit and how to raise it."""


class PeerClosedError(CommError):
    """The physical backend below failed an op: a peer's process ended or closed its
    connection (its own log says why). The original error is the ``__cause__``."""


class DivergenceError(CommError):
    """The live program no longer matches the recorded one."""


class UncapturedRootError(CommError):
    """An object collective rooted at a logical rank that the folded capture does not run."""


class DeviceFlagsUnavailable(RuntimeError):
    """The driver cannot wait on flags here (no ``libcuda``, no stream memory operations)."""


class WireDeadlineError(CommDeadlineError, TimeoutError):
    """The rest of a message did not arrive by its deadline. Also an ``OSError``: the connection
    is unusable past a partial message, and readers treat it as a connection that broke."""


class ProtocolError(RuntimeError):
    """A message that is not part of this protocol, or a peer of another protocol version."""


class HandshakeTimeout(TimeoutError):
    """The peer did not finish the handshake by its deadline."""


class RestrictedPayloadError(pickle.UnpicklingError):
    """A restricted payload names a global outside the allow-list."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message for a one-line report, or its type's name where
    the message is empty (formatting only: nothing is decided by the text)."""
    return next(iter(str(error).strip().splitlines()), type(error).__name__)


__all__ = ["CommDeadlineError", "CommError", "DeviceFlagsUnavailable", "DivergenceError", "HandshakeTimeout",
           "PeerClosedError", "ProtocolError", "RestrictedPayloadError", "UncapturedRootError", "WireDeadlineError",
           "first_line"]
