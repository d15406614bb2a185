"""Deferred waits (nccl_ext/capture/deferred_waits.py): an op issued after a deferred wait has its fold
queued only after that deferred op's fold (which writes the flag the program's stream waits
for), whatever order the answers come in; ops issued while nothing is deferred are queued as
their answers come; a failed op's flag is written at once and, if its wait was deferred, its
error is raised by the next op; an op answered through the host writes its flag after the copy."""

import threading

import pytest

from nccl_ext.capture.deferred_waits import DEFER_FROM_STEP, MAX_DEFERRED, DeferredWaits
from nccl_ext.capture.progress import RankProgress
from nccl_ext.core.pending import Pending
from nccl_ext.core.protocol import Stalled


class Flags:
    """The driver's flags as the logic above them sees them: which ops were waited for on the
    GPU, released at once, or signalled after a copy."""

    def __init__(self):
        self.waited, self.released, self.signalled = [], [], []

    def waiting_stream(self, writer):
        return "program"

    def wait(self, stream, op_id):
        assert stream == "program"
        self.waited.append(op_id)

    def signal_here(self, op_id):
        self.signalled.append(op_id)

    def release(self, op_id):
        self.released.append(op_id)

    def written(self, op_id):
        return op_id in self.signalled or op_id in self.released or op_id in self.by_fold

    by_fold = set()
    """Ops whose folds wrote their flags on the GPU."""


def Rank(flags):
    """A rank past its first steps that keeps its slot, its waits on the GPU over ``flags``."""
    w = DeferredWaits(RankProgress(7, unit=DEFER_FROM_STEP, unparked=True), True)
    w._flags = flags
    return w


def _issue(rank, op_id, timeout_s=30.0):
    p = Pending(f"op {op_id}", timeout_s, op_id)
    rank.gpu_op(op_id, p)
    return p


def _answer(rank, p, queued):
    rank.in_order(p.op_id, lambda: (queued.append(p.op_id), p.complete([])))


def test_ops_issued_after_a_deferred_wait_are_queued_after_its_fold():
    flags, queued = Flags(), []
    rank = Rank(flags)
    p0 = _issue(rank, 0)
    assert p0.defer() and flags.waited == [0] and rank.deferred_waits == 1
    p1, p2 = _issue(rank, 1), _issue(rank, 2)
    _answer(rank, p2, queued)
    _answer(rank, p1, queued)
    assert queued == []  # both wait for op 0's fold and flag
    _answer(rank, p0, queued)
    assert queued == [0, 1, 2] and not rank._ready and not rank._open


def test_ops_issued_before_a_deferral_or_with_none_are_queued_as_answered():
    flags, queued = Flags(), []
    rank = Rank(flags)
    p0, p1 = _issue(rank, 0), _issue(rank, 1)
    assert p0.defer()
    _answer(rank, p1, queued)  # issued before op 0's wait was deferred: its fold does not wait for it
    assert queued == [1]
    _answer(rank, p0, queued)
    assert queued == [1, 0]


def test_a_deferred_ops_failure_releases_its_flag_and_what_waited_and_is_raised_next():
    flags, queued = Flags(), []
    rank = Rank(flags)
    p0 = _issue(rank, 0)
    assert p0.defer()
    p1 = _issue(rank, 1)
    _answer(rank, p1, queued)
    assert queued == []
    p0.fail(RuntimeError("the peer's process ended"))
    assert flags.released == [0] and queued == [1]
    with pytest.raises(RuntimeError, match="went on past its wait.*the peer's process ended"):
        rank.check_deferred()


def test_a_failure_without_a_deferred_wait_only_releases_the_flag():
    flags = Flags()
    rank = Rank(flags)
    p = _issue(rank, 0)
    p.fail(RuntimeError("deadline"))
    assert flags.released == [0]
    rank.check_deferred()


def test_an_op_answered_through_the_host_writes_its_flag_after_the_copy():
    flags = Flags()
    rank = Rank(flags)
    p = _issue(rank, 0)
    assert p.defer()
    p.complete(["a host tensor"])  # a receive whose send went through the coordinator
    assert flags.signalled == [] and p.after_apply is not None
    p.after_apply()  # the process group calls it after copying into the program's tensors
    assert flags.signalled == [0]


def test_no_deferral_while_parking_can_stop_the_rank_in_the_first_steps_past_the_cap_once_answered_or_without_flags():
    flags = Flags()
    rank = Rank(flags)
    rank._progress.unparked = False
    assert not _issue(rank, 0).defer()
    rank._progress.unparked = True
    rank._progress.unit = DEFER_FROM_STEP - 1  # the first steps load and compile its kernels
    assert not _issue(rank, 4).defer()
    rank._progress.unit = DEFER_FROM_STEP
    done = _issue(rank, 1)
    rank.in_order(1, lambda: done.complete([]))
    assert not done.defer() and flags.waited == []
    rank._deferred = set(range(100, 100 + MAX_DEFERRED))
    assert not _issue(rank, 2).defer()
    assert _issue(Rank(None), 3).defer is None


def test_a_receive_is_ordered_but_never_deferred():
    """A receive may be answered through the host (its sender did not stage on its GPU): the
    copy into the program's tensors would queue behind a wait on the program's stream."""
    flags, queued = Flags(), []
    rank = Rank(flags)
    p0 = _issue(rank, 0)
    assert p0.defer()
    p1 = Pending("recv 1", 30.0, 1)
    rank.gpu_op(1, p1, deferrable=False)
    assert p1.defer is None
    _answer(rank, p1, queued)
    assert queued == []  # issued after op 0's deferred wait: queued after its fold
    _answer(rank, p0, queued)
    assert queued == [0, 1] and flags.waited == [0]


def test_the_context_the_driver_makes_has_wide_queues_and_eager_kernels_while_os_environ_keeps_the_users(monkeypatch):
    import ctypes
    import os

    from nccl_ext.exchange import device_flags

    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    device_flags.prepare_context()
    try:
        assert libc.getenv(b"CUDA_DEVICE_MAX_CONNECTIONS") == str(device_flags.CONNECTIONS).encode()
        assert libc.getenv(b"CUDA_MODULE_LOADING") == b"EAGER"  # no lazy load's context sync under a wait
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # what Megatron's checks read
        assert "CUDA_MODULE_LOADING" not in os.environ
    finally:
        device_flags.restore_context()
    assert libc.getenv(b"CUDA_DEVICE_MAX_CONNECTIONS") == b"1"
    assert libc.getenv(b"CUDA_MODULE_LOADING") is None
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    device_flags.prepare_context()
    device_flags.restore_context()
    assert libc.getenv(b"CUDA_DEVICE_MAX_CONNECTIONS") is None
    assert libc.getenv(b"CUDA_MODULE_LOADING") == b"LAZY"


def test_a_deferred_op_not_written_by_its_deadline_fails_and_releases_the_gpu(monkeypatch, capsys):
    import time

    from nccl_ext.capture import deferred_waits

    monkeypatch.setattr(deferred_waits, "WATCH_S", 0.02)
    flags = Flags()
    flags.by_fold = set()
    rank = Rank(flags)
    ok, stuck = _issue(rank, 0, timeout_s=0.2), _issue(rank, 1, timeout_s=0.2)
    assert ok.defer() and stuck.defer()
    flags.by_fold.add(0)  # op 0's fold wrote its flag; op 1's answer never comes
    deadline = time.monotonic() + 10
    while 1 not in flags.released and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(flags.released) == {1}  # the program's stream goes on; op 0 was written in time
    assert stuck.error is not None and not ok.is_done
    with pytest.raises(RuntimeError) as e:
        rank.check_deferred()  # the program's next op
    said = str(e.value)
    assert "deadline exceeded: op 1" in said and "capture.gpu_waits=false" in said and "have not all been staged" in said
    assert "rank 7: deadline exceeded: op 1" in capsys.readouterr().err
    assert not _issue(rank, 2).defer()  # no wait is deferred any more
    rank._closed.set()


def test_a_deferred_op_whose_peer_never_staged_says_so_at_its_deadline(monkeypatch):
    import time

    from nccl_ext.capture import deferred_waits

    monkeypatch.setattr(deferred_waits, "WATCH_S", 0.02)
    flags = Flags()
    flags.by_fold = set()
    rank = Rank(flags)
    p = _issue(rank, 0, timeout_s=0.2)
    assert p.defer()
    rank.await_staging(0)  # answered; the gate waits for a peer's staging event that never completes
    deadline = time.monotonic() + 10
    while p.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "a peer's staging of its contribution has not run" in str(p.error) and 0 in flags.released
    rank._closed.set()


def test_a_deferred_op_stalls_after_stall_s_however_far_its_deadline_and_the_launcher_hears_of_it(monkeypatch):
    import time

    from nccl_ext.capture import deferred_waits

    monkeypatch.setattr(deferred_waits, "WATCH_S", 0.02)
    monkeypatch.setattr(deferred_waits, "STALL_S", 0.1)
    flags = Flags()
    flags.by_fold = set()
    rank = Rank(flags)
    sent = []
    rank._send = sent.append
    p = _issue(rank, 0, timeout_s=300.0)  # comm.timeout_s far off
    assert p.defer()
    t0 = time.monotonic()
    while p.error is None and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert p.error is not None and time.monotonic() - t0 < 5 and 0 in flags.released
    assert "were not written within 0 s of it" in str(p.error)  # of the wait's return, not of comm.timeout_s
    assert [(type(m), m.rank) for m in sent] == [(Stalled, 7)] and "deadline exceeded: op 0" in sent[0].what
    rank._closed.set()
