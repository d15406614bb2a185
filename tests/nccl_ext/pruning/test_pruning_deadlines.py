"""A pruned ring whose edge host stalls (joined the ring's communicator, never plays its
edge) fails the live member's op by its deadline, naming the op and the ring position it
waited for; one whose edge host dies fails at once. The live member runs the real
:func:`nccl_ext.pruning.rings.run_op` on a :class:`SerialWorker`, as a sandbox rank does."""

import threading
import time

import pytest
import torch
from tests.nccl_ext.deadline_fakes import MisbehavingPeer

from nccl_ext.pruning import rings as pruning
from nccl_ext.core.ops import ReduceKind
from nccl_ext.core.pending import CommDeadlineError
from nccl_ext.pruning.rings import PrunedRing, SerialWorker

WHAT = "rank 0: allreduce on group dp seq 3"


def _run_live_member(pg, deadline_s: float) -> tuple[BaseException | None, float]:
    """Live member 0 of a group of 4 whose virtual members 1-3 are one wrap edge on physical
    rank 1; returns the op's error and how long it took."""
    ring = PrunedRing.plan(4, [0], lambda m: 0, edge_host=1)
    worker, done, out = SerialWorker("prism-ring-test"), threading.Event(), {}

    def job() -> None:
        t0 = time.monotonic()
        try:
            pruning.run_op(ring, pg, {0: 0, 1: 1}, 0, 9, 3, "all_reduce", ReduceKind.SUM, lambda m: [torch.ones(64)],
                           1, tags=False, deadline=time.monotonic() + deadline_s, what=WHAT)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e
        out["s"] = time.monotonic() - t0
        done.set()

    worker.submit(job)
    assert done.wait(30)
    assert worker.close(5.0)  # the ring's thread ended with its op
    return out.get("error"), out["s"]


@pytest.mark.parametrize("mode", ["stall", "die-later"])
def test_a_pruned_ring_whose_edge_host_misbehaves_fails_naming_op_and_position(tmp_path, mode):
    peer = MisbehavingPeer(tmp_path, mode)
    try:
        pg = peer.join(30.0)  # the communicator's own timeout is far longer: the op's deadline rules
        error, took = _run_live_member(pg, 1.0 if mode == "stall" else 10.0)
    finally:
        peer.end()
    assert error is not None
    msg = str(error)
    assert msg.startswith(f"{WHAT}: pruned ring: waiting ")
    assert "ring position 0 (the edge of virtual members [1, 2, 3] of the group, physical rank 1)" in msg
    if mode == "stall":
        assert isinstance(error, CommDeadlineError) and 0.9 <= took < 3.0
        assert "raise it with comm.timeout_s=" in msg
    else:
        assert not isinstance(error, CommDeadlineError) and took < 6.0  # its death, not the 10 s deadline
        assert "ended or closed the connection" in msg
