"""The GPU exchange's gate (nccl_ext/exchange/ipc.py, EventGate) waits for a peer's staging only
until the op's deadline: past it the item is dropped, the gate stops polling its events, and
the op hears a deadline error naming it and the peers it waited for."""

import threading
import time

from nccl_ext.core.errors import CommDeadlineError
from nccl_ext.exchange.ipc import EventGate


class NeverRuns:
    """A peer's staging event that never completes (its stream waits for good)."""

    def __init__(self):
        self.queries = 0

    def query(self):
        self.queries += 1
        return False


def test_an_op_whose_peer_never_stages_is_dropped_at_its_deadline_naming_it():
    never, heard, ran = NeverRuns(), [], []
    told = threading.Event()
    gate = EventGate(None, "test-gate", timeout_s=0.3)
    t0 = time.monotonic()
    gate.put([never], lambda: ran.append("fold"), "rank 2: allreduce seq 7 on group tp (waiting for ranks [3])",
             late=lambda e: (heard.append((e, time.monotonic() - t0)), told.set()))
    assert told.wait(5.0), "the gate waited past the op's deadline"
    error, after = heard[0]
    assert isinstance(error, CommDeadlineError) and 0.25 < after < 3.0 and not ran
    assert "deadline exceeded: rank 2: allreduce seq 7 on group tp (waiting for ranks [3])" in str(error)
    assert "comm.timeout_s=0.3" in str(error)
    polled = never.queries
    time.sleep(0.2)
    assert never.queries == polled  # dropped: no longer polled
    gate.close(1.0)
    assert not gate._thread.is_alive()


def test_a_late_peer_is_polled_less_often_once_it_is_not_a_matter_of_microseconds():
    never = NeverRuns()
    gate = EventGate(None, "test-gate", timeout_s=0.5)
    gate.put([never], lambda: None, "op", late=lambda e: None)
    time.sleep(0.45)
    # 50 us polls for 10 ms, then 1 ms ones: a few hundred queries at most, not thousands
    assert never.queries < 0.45 / EventGate.IDLE_POLL_S + EventGate.BACK_OFF_S / EventGate.POLL_S + 50
    gate.close(1.0)


def test_without_a_listener_the_deadline_is_said_and_kept_as_the_gates_error(capsys):
    gate = EventGate(None, "test-gate", timeout_s=0.1)
    gate.put([NeverRuns()], lambda: None, "rank 0: send seq 1")
    end = time.monotonic() + 5
    while gate.error is None and time.monotonic() < end:
        time.sleep(0.02)
    assert isinstance(gate.error, CommDeadlineError) and "rank 0: send seq 1" in str(gate.error)
    gate.close(1.0)
    assert "deadline exceeded: rank 0: send seq 1" in capsys.readouterr().err
