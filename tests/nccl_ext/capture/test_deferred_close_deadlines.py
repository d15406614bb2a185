"""A rank that closes with waits still deferred on the GPU (nccl_ext/capture/deferred_waits.py):
the watchdog does not stop at close while flags are unwritten; it waits for them a bounded time,
then fails each op by name and writes its flag from the CPU, so nothing on the program's stream
waits for good."""

import time

from nccl_ext.core.errors import CommDeadlineError
from tests.nccl_ext.capture.test_deferred_waits import Flags, Rank, _issue


def _closing_rank(close_s):
    flags = Flags()
    flags.by_fold = set()
    rank = Rank(flags)
    rank.deferred_close_s = close_s
    return flags, rank


def test_flags_still_deferred_at_close_fail_by_name_and_are_written_within_the_bound():
    flags, rank = _closing_rank(0.3)
    p0, p1 = _issue(rank, 0), _issue(rank, 1)
    assert p0.defer() and p1.defer()
    flags.by_fold.add(1)  # op 1's fold wrote its flag; op 0's never will
    t0 = time.monotonic()
    rank._closed.set()
    rank._watchdog.join(5.0)
    assert not rank._watchdog.is_alive(), "the watchdog waited for the deferred flag past its bound"
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert flags.released == [0] and p1.error is None
    assert isinstance(p0.error, CommDeadlineError)
    assert "deadline exceeded: op 0: the rank closed while its wait was passed on the GPU" in str(p0.error)


def test_close_waits_for_flags_written_meanwhile_and_fails_none():
    flags, rank = _closing_rank(5.0)
    p0 = _issue(rank, 0)
    assert p0.defer()
    rank._closed.set()
    time.sleep(0.1)
    assert rank._watchdog.is_alive()  # it still watches op 0 after close
    flags.by_fold.add(0)
    assert rank.close_deferred(5.0) == []
    assert not rank._watchdog.is_alive() and p0.error is None and flags.released == []


def test_close_deferred_returns_within_its_timeout_naming_the_ops_it_failed():
    flags, rank = _closing_rank(60.0)
    p0 = _issue(rank, 0)
    assert p0.defer()
    rank._closed.set()
    t0 = time.monotonic()
    assert rank.close_deferred(0.2) == ["op 0"]
    assert time.monotonic() - t0 < 2.0
    assert flags.released == [0] and isinstance(p0.error, CommDeadlineError)
    rank._watchdog.join(2.0)
    assert not rank._watchdog.is_alive()


def test_an_answered_op_whose_fold_never_wrote_its_flag_has_it_written_at_close():
    flags, rank = _closing_rank(0.2)
    p0 = _issue(rank, 0)
    assert p0.defer()
    rank.in_order(0, lambda: p0.complete([]))  # answered: its fold is queued and never runs
    rank._closed.set()
    rank._watchdog.join(5.0)
    assert not rank._watchdog.is_alive() and flags.released == [0]
    assert "the rank closed while its wait was passed on the GPU" in str(rank._deferred_error)
