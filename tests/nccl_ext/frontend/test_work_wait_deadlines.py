"""``PrismWork.wait(timeout)`` returns or raises within the caller's timeout, counted over the
op — its completion and the writing of its result into the caller's tensors — and not over
the time a parked capture rank then waits for its compute slot (nccl_ext/frontend/process_group.py)."""

import threading
import time

import pytest

from nccl_ext.core.errors import CommDeadlineError
from nccl_ext.core.pending import Pending
from nccl_ext.frontend.process_group import PrismWork


class Transport:
    """What a work asks of its transport; ``slot_s``: how long a parked rank waits for its slot."""

    def __init__(self, slot_s: float | None = None):
        self.slot_s, self.waits, self.resumed = slot_s, [], 0

    def park(self, pending):
        if self.slot_s is None:
            return None

        def resume():
            time.sleep(self.slot_s)
            self.resumed += 1
        return resume

    def waited(self, ref, t0, t1):
        self.waits.append((t0, t1))

    def deferred_failed(self, p, e):
        raise AssertionError("no wait is deferred here")


def _work(apply_s: float, transport: Transport, deadline_s: float = 30.0, complete_after_s: float = 0.05):
    p = Pending("rank 2: allreduce seq 4 on group tp", deadline_s, op_id=1)
    work = PrismWork(p, lambda value: time.sleep(apply_s), transport, ("tp", 4))
    threading.Timer(complete_after_s, p.complete, args=([1],)).start()
    return work


def test_a_result_applied_slowly_raises_within_the_callers_timeout_naming_the_op():
    work = _work(apply_s=3.0, transport=Transport())
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"timed out: rank 2: allreduce seq 4 on group tp: its result arrived, "
                       r"but writing it .* within the caller's timeout of 0.4 s"):
        work.wait(0.4)
    assert time.monotonic() - t0 < 1.0  # before: the op's deadline (30 s) bounded this wait


def test_without_a_timeout_a_slow_application_ends_by_the_op_deadline():
    work = _work(apply_s=5.0, transport=Transport(), deadline_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"deadline exceeded: rank 2: allreduce seq 4 on group tp: its result "
                       r"arrived, but writing it .* \(comm.timeout_s=0.3"):
        work.wait()
    assert time.monotonic() - t0 < 2.5  # the deadline, at least a second after the result came


def test_time_parked_for_the_compute_slot_does_not_count_against_the_callers_timeout():
    transport = Transport(slot_s=0.6)
    work = _work(apply_s=0.0, transport=transport)
    t0 = time.monotonic()
    assert work.wait(0.4) is True  # the op took 0.05 s; the slot came back 0.6 s later
    assert 0.6 <= time.monotonic() - t0 < 2.0 and transport.resumed == 1 and work.is_completed()
