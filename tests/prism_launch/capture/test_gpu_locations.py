"""The coordinator's side of contributions and sends staged on a GPU (:mod:`nccl_ext.exchange.ipc`):
it answers with the locations as they are, records shapes from the location where the trace
reads no data, takes the trace's notes (the sandbox rank's digest, a kept contribution) from the
host copy only once every member has read — the host copies are complete then — frees the
regions after those notes, and refuses, naming the setting, a GPU-only location whose data the
trace needs."""

import json
import pickle

import pytest
import torch

from nccl_ext.exchange.arena import Arena, claim_directory, release_directory
from nccl_ext.exchange.ipc import DEVICE_TAG
from nccl_ext.core.ops import Collective, ReduceKind
from nccl_ext.core.protocol import PROTOCOL_VERSION, Group, Hello, Stalled, XColl, XRead
from prism_launch.capture.coordinator import Coordinator


class FakeConn:
    def __init__(self):
        self.sent = []

    def send_bytes(self, b):
        self.sent.append(b)

    def headers(self):
        out = []
        for b in self.sent:
            try:
                out.append(pickle.loads(b)[0])
            except Exception:  # noqa: BLE001 - raw tensor bytes
                pass
        return out


@pytest.fixture
def coord(tmp_path):
    xdir = claim_directory(tmp_path)
    c = Coordinator(str(tmp_path / "c.sock"), b"k" * 16, 4, 30.0, payload="exact", scope=(1,), exchange=xdir)
    conns = [FakeConn() for _ in range(4)]
    for r, conn in enumerate(conns):
        c._handle(conn, Hello(PROTOCOL_VERSION, r, 1000 + r), [])
    for conn in conns[:2]:
        c._handle(conn, Group("tp", (0, 1), 0, "TENSOR_MODEL_PARALLEL_GROUP"), [])
    for conn in conns[2:]:
        c._handle(conn, Group("tp2", (2, 3), 0, "TENSOR_MODEL_PARALLEL_GROUP"), [])
    yield c, conns, xdir
    c.notes.close()
    release_directory(xdir)


def _xcoll(op_id, key, seq, loc):
    return XColl(op_id, key, seq, "all_reduce", str(Collective.ALL_REDUCE), str(ReduceKind.SUM), None, True,
            0, 0.0, 0.0, 0.0, loc)


def _row(c, rank, key):
    gid = c._groups[key].id
    return next(r for r in c.events if r["rank"] == rank and r["group"] == gid and r["kind"] == "collective")


def test_notes_of_gpu_staged_data_wait_for_every_read_then_the_regions_go(coord):
    c, conns, xdir = coord
    data = [torch.arange(8.0), torch.arange(8.0) * 3]
    arenas = [Arena(xdir, r) for r in range(2)]
    for r in range(2):
        gen, descs, _ = arenas[r].put([data[r]])
        loc = (DEVICE_TAG, [(0, "float32", [8])], r, (gen, descs))
        c._handle(conns[r], _xcoll(7, "tp", 0, loc), [])
    c.drain()
    for r in range(2):
        xok = [h for h in conns[r].headers() if h[0] == "xok"]
        assert len(xok) == 1 and xok[0][2][0][1] == DEVICE_TAG and xok[0][2][1][0] == 1  # (rank, tag, ...)
    assert _row(c, 1, "tp")["extra"] is None  # the sandbox rank's digest waits for the reads
    assert not c.sink.tensors
    c._handle(conns[0], XRead(7), [])
    c.drain(wait=True)
    assert _row(c, 1, "tp")["extra"] is None and not any(h[0] == "xfree" for h in conns[0].headers())
    c._handle(conns[1], XRead(7), [])
    c.drain(wait=True)
    c.drain(wait=True)
    extra = json.loads(_row(c, 1, "tp")["extra"])
    assert extra["digests"] and extra["shapes"] == [[8]]
    kept = c.sink.tensors[0]  # rank 0's contribution, which the sandbox rank 1 folds
    assert torch.equal(next(iter(kept.values())), data[0])
    assert all(any(h == ("xfree", 7) for h in conns[r].headers()) for r in range(2))
    for a in arenas:
        a.close()


def test_a_group_without_sandbox_ranks_needs_no_host_copy_and_records_shapes(coord):
    c, conns, _xdir = coord
    for r in (2, 3):
        c._handle(conns[r], _xcoll(1, "tp2", 0, (DEVICE_TAG, [(0, "bfloat16", [3, 5])], 0, None)), [])
    for r in (2, 3):
        c._handle(conns[r], XRead(1), [])
    c.drain(wait=True)
    row = _row(c, 2, "tp2")
    assert row["shape"] == [3, 5] and row["dtype"] == "bfloat16" and row["nbytes"] == 30
    assert json.loads(row["extra"])["shapes"] == [[3, 5]] and not c.sink.tensors


def test_a_gpu_only_location_of_data_the_trace_reads_is_refused_by_name(coord):
    c, conns, _xdir = coord
    with pytest.raises(RuntimeError, match="gpu_exchange_mib=0"):
        c._handle(conns[1], _xcoll(2, "tp", 0, (DEVICE_TAG, [(0, "float32", [8])], 0, None)), [])


def test_a_folded_groups_reduction_summed_by_its_members_keeps_the_sandbox_members_own_result(tmp_path):
    """A data-parallel group of 130 members with two captured (ranks 0 and 1, each standing in
    for 64 others): the members get the sum's terms with the locations, only the sandbox rank's
    contribution is read on the host (rank 0's lies on its GPU alone), and the result the trace
    keeps is the one the sandbox rank staged — its program's bits — freed with the contributions."""
    from prism_launch.trace.fold import FoldPlan

    xdir = claim_directory(tmp_path)
    world = 130
    fold = FoldPlan(world_size=world, captured=[0, 1], rep=[r % 2 for r in range(world)],
                    replicated=["DATA_PARALLEL"])
    c = Coordinator(str(tmp_path / "c.sock"), b"k" * 16, world, 30.0, payload="exact", scope=(1,), exchange=xdir,
                    fold=fold)
    conns = [FakeConn(), FakeConn()]
    for r, conn in enumerate(conns):
        c._handle(conn, Hello(PROTOCOL_VERSION, r, 1000 + r), [])
        c._handle(conn, Group("dp", tuple(range(world)), 0, "DATA_PARALLEL_GROUP"), [])
    arena = Arena(xdir, 1)
    try:
        gen, descs, _ = arena.put([torch.arange(8.0)])  # the sandbox rank's host copy of its contribution
        c._handle(conns[0], _xcoll(5, "dp", 0, (DEVICE_TAG, [(0, "float32", [8])], 0, None)), [])
        c._handle(conns[1], _xcoll(5, "dp", 0, (DEVICE_TAG, [(0, "float32", [8])], 0, (gen, descs))), [])
        c.drain()
        for conn in conns:
            [xok] = [h for h in conn.headers() if h[0] == "xok"]
            assert xok[4] == [(0, 1), (1, 1), (0, 64), (1, 64)]
            assert [loc is not None for loc in xok[2]] == [True, True] + [False] * (world - 2)
        result = torch.arange(8.0) * 7 + 0.5
        rgen, rdescs, _ = arena.put([result])
        c._handle(conns[1], XRead(5, (rgen, rdescs)), [])
        c._handle(conns[0], XRead(5), [])
        c.drain(wait=True)
        c.drain(wait=True)
        gid = c._groups["dp"].id
        assert set(c.sink.tensors) == {1} and torch.equal(c.sink.tensors[1][f"r/{gid}/0/0"], result)
        assert json.loads(_row(c, 1, "dp")["extra"])["digests"]  # the sandbox rank's digest, from its host copy
        assert all(any(h == ("xfree", 5) for h in conn.headers()) for conn in conns)
    finally:
        arena.close()
        c.notes.close()
        release_directory(xdir)


def test_a_rank_whose_waits_on_the_gpu_stopped_is_noted(coord):
    c, conns, _ = coord
    c._handle(conns[1], Stalled(1, "deadline exceeded: op 9"), [])
    assert c.gpu_waits_stalled == [(1, "deadline exceeded: op 9")]
