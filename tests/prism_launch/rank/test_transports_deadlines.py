"""A physical node that never arrives: the sandbox ranks that did fail by ``comm.timeout_s``
naming the processes that never joined the physical group (and a node whose store host,
node 0, never comes fails naming the endpoint), instead of waiting without a limit."""

import datetime
import socket
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from nccl_ext.core.pending import CommDeadlineError
from prism_launch.rank.transports import physical_group


def _plan(endpoint: str, sandbox=(0, 5), local=(0,)):
    """The two fields of the rank plan ``physical_group`` reads (node 0 runs rank 0; rank 5 is
    another node's)."""
    return SimpleNamespace(emulate=SimpleNamespace(store=endpoint, sandbox=sandbox), local_ranks=local)


def test_a_physical_node_that_never_arrives_is_named_by_the_ranks_that_did():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)  # node 0's launcher hosts it
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError) as err:
        physical_group(_plan(f"127.0.0.1:{store.port}"), 0, 3, 1.0)  # ranks 0 and 5, and the assistant
    assert time.monotonic() - t0 < 6.0
    msg = str(err.value)
    assert msg.startswith("sandbox rank 0: the physical group (sandbox ranks [0, 5] + the assistant) did not form "
                          "within 1 s: sandbox rank 5, the assistant (physical rank(s) [1, 2]) never arrived")
    assert "physical.node_rank" in msg and "comm.timeout_s=" in msg and "This node runs sandbox rank(s) 0" in msg


def test_a_node_whose_store_host_never_comes_names_the_endpoint():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError) as err:
        physical_group(_plan(f"127.0.0.1:{port}", local=(5,)), 1, 2, 1.0)
    assert time.monotonic() - t0 < 8.0
    msg = str(err.value)
    assert msg.startswith(f"sandbox rank 5: could not reach the run's store at 127.0.0.1:{port} (node 0's "
                          "prism-launch hosts it")
    assert "within 1 s" in msg and "comm.timeout_s=" in msg


def test_a_group_whose_members_all_arrived_but_did_not_connect_says_so():
    """Every member marked itself arrived, yet the gloo mesh did not form (a member exited while
    it formed): the error says so instead of naming no one as missing."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5),
                          wait_for_workers=False)
    store.set("prism/physical-arrived/1", "1")  # arrived, then gone before connecting
    with pytest.raises(CommDeadlineError) as err:
        physical_group(_plan(f"127.0.0.1:{store.port}"), 0, 2, 1.0)
    msg = str(err.value)
    assert msg.startswith("sandbox rank 0: every member of the physical group (sandbox ranks [0, 5]) arrived, "
                          "but connecting them failed: ")
    assert "never arrived" not in msg and "logs" in msg


def test_a_mesh_that_fails_to_connect_once_with_every_member_present_is_formed_again(monkeypatch):
    """On a loaded machine gloo's full mesh at times fails with every member present (a pair's
    connection closed while it formed): every member tries again, and the group works."""
    import threading

    import torch

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    real = dist.ProcessGroupGloo
    tries = []

    def flaky(prefix_store, rank, size, timeout):
        tries.append(rank)
        if rank == 1 and tries.count(1) == 1:
            # gloo fails a pair's connection only once both members published their address:
            # every member has arrived by then
            store.wait(["prism/physical-arrived/0", "prism/physical-arrived/1"], datetime.timedelta(seconds=10))
            raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")
        return real(prefix_store, rank, size, timeout)

    monkeypatch.setattr(dist, "ProcessGroupGloo", flaky)
    out = {}

    def member(i):
        group, _ = physical_group(_plan(f"127.0.0.1:{store.port}"), i, 2, 3.0)
        t = torch.tensor([float(i + 1)])
        group.allreduce([t]).wait()
        out[i] = t.item()

    threads = [threading.Thread(target=member, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: 3.0, 1: 3.0} and sorted(tries) == [0, 0, 1, 1]
