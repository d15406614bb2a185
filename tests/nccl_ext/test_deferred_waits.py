"""Deferred waits (nccl_ext/deferred_waits.py): the GPU exchange's folds are queued in the order
the program issued the ops, whatever order their peers complete them in; an op completed some
other way, or failed, leaves the order; a failed op's flag is written at once, and a failure
after the program went on past its wait is raised by its next op."""

import threading

import pytest

from nccl_ext.deferred_waits import MAX_DEFERRED, DeferredWaits
from nccl_ext.pending import Pending


class Flags:
    """The driver's flags, as seen by the logic above them: which ops were waited for, released."""

    def __init__(self):
        self.waited, self.released = [], []

    def wait_here(self, op_id):
        self.waited.append(op_id)

    def signal(self, stream, op_id):
        pass

    def release(self, op_id):
        self.released.append(op_id)


class Rank(DeferredWaits):
    def __init__(self, flags=None):
        self.rank = 7
        self._unparked = True
        self._closed = threading.Event()
        self._init_deferred(True)
        self._flags = flags


def _ops(rank, n):
    ps = [Pending(f"op {i}", 30.0, i) for i in range(n)]
    for i, p in enumerate(ps):
        rank._gpu_op(i, p)
    return ps


def test_folds_are_queued_in_issue_order_whatever_order_completions_arrive():
    rank, queued = Rank(), []
    ps = _ops(rank, 4)
    for i in (2, 3, 1):
        rank._in_order(i, lambda i=i: (queued.append(i), ps[i].complete([])))
    assert queued == []  # op 0 has not been completed: nothing after it is queued
    rank._in_order(0, lambda: (queued.append(0), ps[0].complete([])))
    assert queued == [0, 1, 2, 3] and rank._order == [] and rank._ready == {}


def test_an_op_completed_another_way_or_failed_leaves_the_order():
    flags = Flags()
    rank, queued = Rank(flags), []
    ps = _ops(rank, 3)
    rank._in_order(2, lambda: queued.append(2))
    ps[0].complete(["from the coordinator"])  # a receive answered through the host, not the GPU
    assert queued == []
    ps[1].fail(RuntimeError("deadline"))  # never deferred: its flag is written, nothing is raised later
    assert queued == [2] and flags.released == [1]
    rank._check_deferred()


def test_a_deferred_ops_failure_is_raised_by_the_next_op_and_its_flag_released():
    flags = Flags()
    rank = Rank(flags)
    (p,) = _ops(rank, 1)
    assert p.defer() and flags.waited == [0] and rank.deferred_waits == 1
    p.fail(RuntimeError("the peer's process ended"))
    assert flags.released == [0]
    with pytest.raises(RuntimeError, match="went on past its wait.*the peer's process ended"):
        rank._check_deferred()


def test_no_deferral_while_parking_can_stop_the_rank_past_the_cap_or_once_done():
    flags = Flags()
    rank = Rank(flags)
    rank._unparked = False
    ps = _ops(rank, 2)
    assert not ps[0].defer()
    rank._unparked = True
    ps[1].complete([])
    assert not ps[1].defer() and flags.waited == []
    rank._deferred = set(range(100, 100 + MAX_DEFERRED))
    more = Pending("op 9", 30.0, 9)
    rank._gpu_op(9, more)
    assert not more.defer()


def test_without_flags_ops_are_ordered_but_never_deferred():
    rank = Rank(None)
    (p,) = _ops(rank, 1)
    assert p.defer is None
