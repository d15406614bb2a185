"""A folded group's only captured member computes its collectives itself: the bits equal the
coordinator's (``compute`` over the member-by-member fold up to 64 members, the weighted fold
beyond), reductions land in the caller's tensors, and a scratch smaller than the tensor slices
the work without changing a bit."""

import pytest
import torch

from nccl_ext.core import mirrored
from nccl_ext.core.ops import Collective, ReduceKind, compute
from nccl_ext.core.call import CollectiveCall
from prism_launch.capture.folded_reduction import weighted_reduction
from prism_launch.capture.ops_state import OpGroup, PendingCollective


def _coordinator(kind, reduce, mine, n, me, root=None):
    """What the coordinator computes for member ``me`` when every member mirrors ``me``'s data."""
    ranks = tuple(range(n))
    group = OpGroup(0, "k", ranks, 0, "DATA_PARALLEL_GROUP", sources=(me,) * n, present=1)
    pc = PendingCollective(group, 0, "x", kind, reduce, root, 0.0, [None] * n)
    pc.contributions[me] = [t.clone() for t in mine]
    pc.arrivals[me] = object()
    got = weighted_reduction(pc, group) if n > mirrored.EXACT_FOLD_MAX else None
    if got is None:
        got = compute(kind, [[t.clone() for t in mine] for _ in range(n)], reduce=reduce, root=root)
    return got[me]


def _data(dtype, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 3
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


@pytest.mark.parametrize("n", [2, 7, 64, 65, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("reduce", [ReduceKind.SUM, ReduceKind.AVG, ReduceKind.MAX, ReduceKind.PRODUCT])
def test_all_reduce_in_place_has_the_coordinators_bits(n, dtype, reduce):
    if reduce is ReduceKind.PRODUCT and dtype is torch.int64:
        pytest.skip("integer products of 1024 terms overflow alike but say nothing")
    x = _data(dtype, 1000)
    want = _coordinator(Collective.ALL_REDUCE, reduce, [x], n, me=3 % n)
    live = x.clone()
    scratch = torch.empty(96, dtype=torch.uint8)  # a few elements per slice: many slices
    out = mirrored.results(CollectiveCall("allreduce", Collective.ALL_REDUCE, [live], reduce=reduce), n, 3 % n, scratch)
    assert out[0] is live  # in place, as the real backend writes it
    assert torch.equal(live.view(torch.uint8) if dtype.is_floating_point else live,
                       want[0].view(torch.uint8) if dtype.is_floating_point else want[0])


@pytest.mark.parametrize("n", [4, 100])
def test_reduce_scatter_and_reduce(n):
    me, k = 2, 2
    pieces = [_data(torch.float32, 33, seed=i) for i in range(k * n)]
    want = _coordinator(Collective.REDUCE_SCATTER, ReduceKind.SUM, pieces, n, me)
    outs = [torch.empty(33) for _ in range(k)]
    call = CollectiveCall("reduce_scatter", Collective.REDUCE_SCATTER, [p.clone() for p in pieces],
                          reduce=ReduceKind.SUM, outputs=outs)
    got = mirrored.results(call, n, me, torch.empty(40, dtype=torch.uint8))
    assert all(a is b for a, b in zip(got, outs))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a reduce answers only its root
    x = _data(torch.float32, 10)
    assert mirrored.results(CollectiveCall("reduce", Collective.REDUCE, [x.clone()], reduce=ReduceKind.SUM, root=0),
                            n, me, torch.empty(64, dtype=torch.uint8)) == []
    want = _coordinator(Collective.REDUCE, ReduceKind.SUM, [x], n, me, root=me)
    got = mirrored.results(CollectiveCall("reduce", Collective.REDUCE, [x.clone()], reduce=ReduceKind.SUM, root=me),
                           n, me, torch.empty(64, dtype=torch.uint8))
    assert torch.equal(got[0], want[0])


def test_data_movement_is_the_members_own_pieces():
    n, me = 5, 1
    x = [_data(torch.float32, 8, seed=i) for i in range(n)]
    scratch = torch.empty(64, dtype=torch.uint8)
    gathered = mirrored.results(CollectiveCall("allgather", Collective.ALL_GATHER, [x[0]]), n, me, scratch)
    assert [torch.equal(a, b) for a, b in zip(gathered, _coordinator(Collective.ALL_GATHER, None, [x[0]], n, me))] == [True] * n
    a2a = mirrored.results(CollectiveCall("alltoall", Collective.ALL_TO_ALL, x), n, me, scratch)
    assert all(torch.equal(a, b) for a, b in zip(a2a, _coordinator(Collective.ALL_TO_ALL, None, x, n, me)))
    own = _data(torch.float32, 8)
    # a non-root member standing in for the root: the root's data is its own buffer
    assert mirrored.results(CollectiveCall("broadcast", Collective.BROADCAST, None, root=0, standin=[own]),
                            n, me, scratch)[0] is own
    assert mirrored.results(CollectiveCall("barrier", Collective.BARRIER, None), n, me, scratch) == []


def test_non_contiguous_tensors_are_reduced_in_place():
    base = _data(torch.float32, 40).view(8, 5)
    live = base.t()  # not contiguous
    want = _coordinator(Collective.ALL_REDUCE, ReduceKind.SUM, [live.contiguous()], 3, 0)
    mirrored.results(CollectiveCall("allreduce", Collective.ALL_REDUCE, [live], reduce=ReduceKind.SUM), 3, 0,
                     torch.empty(16, dtype=torch.uint8))
    assert torch.equal(base.t().contiguous(), want[0])
