"""Every wait of the prism process group has a deadline: ``PrismWork.wait(timeout)`` keeps the
caller's timeout, and ``monitored_barrier`` reports the ranks that did not arrive within its
own (torch's semantics), each naming rank, group, op and sequence number. Driven through the
real :class:`PrismProcessGroup` over a real :class:`ReplayTransport` whose virtual peers come
from a tiny in-memory recording (their recorded lateness is what makes them late)."""

import datetime
import threading
import time

import pytest
import torch
from tests.nccl_ext.deadline_fakes import TinyRecording

from nccl_ext.core.pending import CommDeadlineError, Pending, timeout_seconds
from nccl_ext.frontend.process_group import MONITORED_BARRIER_TAG, PrismWorld
from nccl_ext.replay.transport import ReplayTransport

T = MONITORED_BARRIER_TAG


def _world(rank: int, recording: TinyRecording, timeout_s: float = 30.0):
    transport = ReplayTransport(rank=rank, sandbox=(rank,), recording=recording, timeout_s=timeout_s,
                                physical=None, timing="recorded")
    world = PrismWorld(rank=rank, world_size=len(recording.ranks), transport=transport)
    return world, world.make_group(recording.ranks, desc="default_pg")


def test_a_caller_timeout_of_none_or_zero_means_the_op_deadline():
    assert timeout_seconds(None) is None and timeout_seconds(datetime.timedelta(0)) is None
    assert timeout_seconds(datetime.timedelta(milliseconds=500)) == 0.5 and timeout_seconds(2) == 2.0


def test_wait_keeps_the_callers_timeout_and_the_op_stays_outstanding():
    # rank 1's recorded send comes 30 s after rank 0 entered its recv: virtual lateness
    world, pg = _world(0, TinyRecording((0, 1), {(1, 0, 5, 0): 30.0}))
    work = pg.recv([torch.zeros(1)], 1, 5)
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError) as err:
        work.wait(datetime.timedelta(seconds=0.5))
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 2.0
    msg = str(err.value)
    assert msg.startswith("timed out: rank 0: recv #0 from rank 1 tag 5 on group default_pg")
    assert "caller's timeout of 0.5 s" in msg and "comm.timeout_s=30" in msg
    assert not work.is_completed()  # as torch's: the op itself is not cancelled
    world.transport.close()


def test_wait_without_a_timeout_ends_by_the_op_deadline():
    world, pg = _world(0, TinyRecording((0, 1), {(1, 0, 5, 0): 30.0}), timeout_s=0.6)
    work = pg.recv([torch.zeros(1)], 1, 5)
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"deadline exceeded: rank 0: recv #0 from rank 1 tag 5 on group "
                       r"default_pg: not complete after 0.6 s \(comm.timeout_s; raise it with comm.timeout_s="):
        work.wait()
    assert time.monotonic() - t0 < 2.0
    world.transport.close()


def test_pending_wait_stops_at_the_earlier_of_the_callers_limit_and_the_deadline():
    p = Pending("rank 3: allreduce on group tp seq 7", 0.3)
    t0 = time.monotonic()
    assert p.wait(5.0) is True  # the deadline (0.3 s) comes first: the op fails
    assert 0.25 <= time.monotonic() - t0 < 1.5 and not p.succeeded
    q = Pending("rank 3: allreduce on group tp seq 8", 30.0)
    threading.Timer(0.1, q.complete, args=([1],)).start()
    assert q.wait(5.0) is True and q.result() == [1]


def _barrier_world(late: dict[int, float], n: int = 4, me: int = 0):
    """Group rank ``me`` is the sandbox; every other member's barrier message is recorded
    ``late[r]`` seconds after this rank's (0 when not given)."""
    p2p = {}
    for r in range(n):
        if r == me:
            continue
        if me == 0:
            p2p[(r, 0, T, 0)] = late.get(r, 0.0)  # member -> rank 0
            p2p[(0, r, T, 0)] = 0.0  # rank 0's release (this rank sends it)
        else:
            p2p[(me, 0, T, 0)] = 0.0
            p2p[(0, me, T, 0)] = late.get(0, 0.0)
    return _world(me, TinyRecording(tuple(range(n)), p2p))


def test_monitored_barrier_passes_when_every_member_arrives_in_time():
    world, pg = _barrier_world({1: 0.05, 2: 0.1})
    t0 = time.monotonic()
    pg.monitored_barrier(datetime.timedelta(seconds=5))
    assert time.monotonic() - t0 < 2.0
    world.transport.close()


def test_monitored_barrier_names_the_first_rank_that_failed_to_arrive():
    world, pg = _barrier_world({2: 30.0, 3: 30.0})
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError) as err:
        pg.monitored_barrier(datetime.timedelta(seconds=0.5))
    assert 0.45 <= time.monotonic() - t0 < 2.5
    msg = str(err.value)
    assert msg.startswith("rank 0: monitored_barrier seq 0 on group default_pg (ranks [0, 1, 2, 3]): ranks [2] "
                          "failed to pass monitored_barrier within 0.5 s")
    assert "wait_all_ranks=True lists all" in msg
    world.transport.close()


def test_monitored_barrier_with_wait_all_ranks_names_every_missing_rank():
    world, pg = _barrier_world({1: 30.0, 3: 30.0})
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"monitored_barrier seq 0 on group default_pg \(ranks \[0, 1, 2, 3\]\): "
                       r"ranks \[1, 3\] failed to pass monitored_barrier within 0.5 s"):
        pg.monitored_barrier(datetime.timedelta(seconds=0.5), wait_all_ranks=True)
    assert time.monotonic() - t0 < 2.5  # one deadline for the whole barrier, not one per rank
    world.transport.close()


def test_monitored_barrier_on_a_member_whose_rank_0_never_releases_it():
    world, pg = _barrier_world({0: 30.0}, n=3, me=2)
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"rank 2: monitored_barrier seq 0 on group default_pg \(ranks \[0, 1, "
                       r"2\]\): this rank arrived, but group rank 0 \(rank 0\) did not release it within 0.5 s"):
        pg.monitored_barrier(0.5)
    assert time.monotonic() - t0 < 2.0
    world.transport.close()


def test_a_deadline_error_carries_rank_group_op_and_sequence_as_fields():
    world, pg = _world(0, TinyRecording((0, 1), {(1, 0, 5, 0): 30.0}), timeout_s=0.3)
    work = pg.recv([torch.zeros(1)], 1, 5)
    with pytest.raises(CommDeadlineError) as err:
        work.wait()
    e = err.value
    assert (e.rank, e.group, e.op, e.seq) == (0, "default_pg", "recv", 0)
    world.transport.close()


def test_a_backend_error_at_issue_is_a_peer_closed_error_and_the_layers_own_pass_as_they_are():
    from nccl_ext.core.errors import CommError, DivergenceError, PeerClosedError

    world, pg = _world(0, TinyRecording((0, 1), {}))
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234\nmore")

    def closed(*a):
        raise gloo

    with pytest.raises(PeerClosedError) as err:
        pg._issue("send seq 3 to rank 1 tag 0 on group default_pg", "send", 3, closed)
    e = err.value
    assert (e.rank, e.group, e.op, e.seq) == (0, "default_pg", "send", 3) and e.__cause__ is gloo
    assert str(e).startswith("rank 0: send seq 3 to rank 1 tag 0 on group default_pg: [gloo/transport/tcp/pair.cc"
                             ":598] Connection closed by peer [127.0.0.1]:1234 (a physical peer's process ended")
    for own in (DivergenceError("rank 0: recv: not in the trace; capture again"), CommError("rank 9 says")):
        def raises(*a, own=own):
            raise own

        with pytest.raises(type(own)) as err:
            pg._issue("recv", "recv", 0, raises)
        assert err.value is own  # not wrapped, whatever its text says
    world.transport.close()
