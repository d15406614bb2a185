"""wait_works tells a backend's timeout from a closed connection by the clock, never by the
backend's words; both come back as the layer's typed errors, naming the op."""

from __future__ import annotations

import time

import pytest

from nccl_ext.core.errors import CommDeadlineError, PeerClosedError
from nccl_ext.core.pending import Pending
from nccl_ext.core.threads import wait_works


class _Work:
    def __init__(self, message: str, after_s: float = 0.0):
        self.message, self.after_s = message, after_s

    def wait(self, timeout):
        time.sleep(min(self.after_s, timeout.total_seconds()))
        raise RuntimeError(self.message)


def test_an_early_failure_is_a_closed_peer_even_if_its_text_says_timed_out():
    pending = Pending("rank 0: recv seq 1 from rank 1", 30.0)
    with pytest.raises(PeerClosedError, match=r"^rank 0: recv seq 1 from rank 1: waiting for .* Timed out"):
        wait_works([_Work("Timed out waiting 30000ms for recv operation to complete")], pending)


def test_a_failure_at_the_deadline_is_the_deadline_whatever_its_text():
    pending = Pending("rank 0: recv seq 2 from rank 1", 0.3)
    with pytest.raises(CommDeadlineError, match=r"^deadline exceeded: rank 0: recv seq 2 from rank 1: .*gloo said"):
        wait_works([_Work("gloo said something", after_s=5.0)], pending)


def test_an_empty_message_is_named_by_its_type():
    pending = Pending("rank 0: send seq 0 to rank 1", 30.0)
    with pytest.raises(PeerClosedError, match=r"failed after .* s: RuntimeError \(the peer's process ended"):
        wait_works([_Work("")], pending)
