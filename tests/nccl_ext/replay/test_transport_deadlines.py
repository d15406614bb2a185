"""A sandbox rank whose assistant stalls (joined the physical group, never sends) or dies
fails its op by the deadline — or at once when the assistant's connection closes — with a
message naming the rank, the group, the op, its sequence number and the assistant; the
transport's threads have ended when it closes. Real :class:`ReplayTransport` and
:class:`PrismProcessGroup` over a real gloo group; only the assistant is a fake."""

import datetime
import time

import pytest
import torch
from tests.nccl_ext.deadline_fakes import ELEMS, MisbehavingPeer, TinyRecording

from nccl_ext.core.pending import CommDeadlineError
from nccl_ext.frontend.process_group import PrismWorld
from nccl_ext.replay.transport import ReplayTransport


@pytest.fixture
def sandbox_with(tmp_path, request):
    """Sandbox rank 0 of a world of 2 whose virtual rank 1 is served by a misbehaving assistant."""
    peer = MisbehavingPeer(tmp_path, request.param)
    made = []

    def make(timeout_s: float):
        physical = peer.join(timeout_s)
        transport = ReplayTransport(rank=0, sandbox=(0,), recording=TinyRecording((0, 1), {(1, 0, 0, 0): 0.0}),
                                    timeout_s=timeout_s, physical=physical, timing="none", assistant=1)
        world = PrismWorld(rank=0, world_size=2, transport=transport)
        made.append((transport, physical))
        return transport, world.make_group((0, 1), desc="default_pg")

    yield make
    for transport, _physical in made:
        transport.close()
    peer.end()


@pytest.mark.parametrize("sandbox_with", ["stall"], indirect=True)
def test_an_assistant_that_never_sends_fails_the_wait_by_the_callers_timeout_then_the_deadline(sandbox_with):
    transport, pg = sandbox_with(2.0)
    work = pg.allreduce([torch.ones(ELEMS)])
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError) as err:
        work.wait(datetime.timedelta(seconds=0.5))
    assert 0.45 <= time.monotonic() - t0 < 1.5
    msg = str(err.value)
    assert msg.startswith("timed out: rank 0: allreduce on group default_pg seq 0: not complete within the caller's "
                          "timeout of 0.5 s")
    assert "the assistant (physical rank 1" in msg and "virtual rank(s) [1]' recorded data for this rank's op #0" in msg
    with pytest.raises(CommDeadlineError) as err:  # waited again without a limit: the op's own deadline
        work.wait()
    assert time.monotonic() - t0 < 4.0
    msg = str(err.value)
    assert msg.startswith("deadline exceeded: rank 0: allreduce on group default_pg seq 0")
    assert "the assistant (physical rank 1" in msg and "comm.timeout_s" in msg
    transport.close()
    assert transport.stats.in_flight_at_close == []  # the exchange thread ended by the deadline


@pytest.mark.parametrize("sandbox_with", ["stall"], indirect=True)
def test_a_virtual_peers_message_that_never_comes_fails_the_recv_by_its_deadline(sandbox_with):
    transport, pg = sandbox_with(1.0)
    t0 = time.monotonic()
    work = pg.recv([torch.zeros(1)], 1, 0)
    with pytest.raises(CommDeadlineError) as err:
        work.wait()
    assert 0.9 <= time.monotonic() - t0 < 3.0
    msg = str(err.value)
    assert msg.startswith("deadline exceeded: rank 0: recv #0 from rank 1 tag 0 on group default_pg")
    assert "virtual rank(s) [1]' recorded data for this rank's op #1" in msg and "comm.timeout_s" in msg


@pytest.mark.parametrize("sandbox_with", ["die", "die-later"], indirect=True)
def test_an_assistant_that_dies_fails_the_op_at_once_naming_it(sandbox_with, request):
    transport, pg = sandbox_with(20.0)
    died_first = request.node.callspec.params["sandbox_with"] == "die"
    if died_first:
        time.sleep(1.5)  # its connection is closed before the op is issued
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        pg.allreduce([torch.ones(ELEMS)]).wait()
    assert time.monotonic() - t0 < 10.0  # the closed connection, not the 20 s deadline
    msg = str(err.value)
    assert msg.startswith("rank 0: allreduce on group default_pg seq 0: ")
    assert "ended or closed its connection" in msg and not isinstance(err.value, CommDeadlineError)
    if not died_first:  # posted, then the assistant died under it
        assert "waiting for the assistant (physical rank 1" in msg
    transport.close()
    assert transport.stats.in_flight_at_close == []
