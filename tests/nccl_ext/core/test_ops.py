import pytest
import torch
import torch.distributed as dist

from nccl_ext.core.ops import Collective, ReduceKind, compute, contributors, fold, reduce_kind


def test_fold_is_left_to_right_in_group_order():
    # float addition is not associative: the fold order must be exactly ((a+b)+c)
    a, b, c = torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])
    assert fold(ReduceKind.SUM, [a, b, c]).item() == ((a + b) + c).item()
    assert fold(ReduceKind.SUM, [a, c, b]).item() == ((a + c) + b).item()
    assert fold(ReduceKind.SUM, [a, b, c]).item() != fold(ReduceKind.SUM, [a, c, b]).item()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (ReduceKind.SUM, [6.0, 3.0]),
        (ReduceKind.AVG, [2.0, 1.0]),
        (ReduceKind.PRODUCT, [6.0, 1.0]),
        (ReduceKind.MIN, [1.0, 1.0]),
        (ReduceKind.MAX, [3.0, 1.0]),
    ],
)
def test_reduce_kinds(kind, expected):
    ts = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 1.0]), torch.tensor([3.0, 1.0])]
    assert fold(kind, ts).tolist() == expected


def test_fold_does_not_alias_inputs():
    a = torch.ones(2)
    out = fold(ReduceKind.SUM, [a, a])
    assert out.tolist() == [2.0, 2.0] and a.tolist() == [1.0, 1.0]


def test_reduce_kind_maps_torch_ops_and_rejects_premul():
    assert reduce_kind(dist.ReduceOp.SUM) is ReduceKind.SUM
    assert reduce_kind(dist.ReduceOp.MAX) is ReduceKind.MAX
    with pytest.raises(NotImplementedError, match="not supported"):
        reduce_kind(dist._make_nccl_premul_sum(2.0))


def test_compute_every_collective():
    n = 3
    x = [[torch.tensor([float(m)])] for m in range(n)]
    assert [r[0].item() for r in compute(Collective.ALL_REDUCE, x, reduce=ReduceKind.SUM)] == [3.0] * 3
    red = compute(Collective.REDUCE, x, reduce=ReduceKind.SUM, root=1)
    assert red[0] == [] and red[1][0].item() == 3.0
    bc = compute(Collective.BROADCAST, [None, [torch.tensor([7.0])], None], root=1)
    assert [r[0].item() for r in bc] == [7.0] * 3
    ag = compute(Collective.ALL_GATHER, x)
    assert [t.item() for t in ag[2]] == [0.0, 1.0, 2.0]
    ga = compute(Collective.GATHER, x, root=0)
    assert [t.item() for t in ga[0]] == [0.0, 1.0, 2.0] and ga[1] == []
    sc = compute(Collective.SCATTER, [[torch.tensor([5.0]), torch.tensor([6.0]), torch.tensor([7.0])], None, None], root=0)
    assert [r[0].item() for r in sc] == [5.0, 6.0, 7.0]
    # reduce-scatter: member m contributes pieces [m*10+j for j]; member j gets sum over m
    rs_in = [[torch.tensor([m * 10.0 + j]) for j in range(n)] for m in range(n)]
    rs = compute(Collective.REDUCE_SCATTER, rs_in, reduce=ReduceKind.SUM)
    assert [r[0].item() for r in rs] == [30.0 + 3 * j for j in range(n)]
    # all-to-all with uneven pieces: member m sends piece j (length j+1) to member j
    a2a_in = [[torch.full((j + 1,), float(m)) for j in range(n)] for m in range(n)]
    a2a = compute(Collective.ALL_TO_ALL, a2a_in)
    assert [t.tolist() for t in a2a[2]] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
    assert compute(Collective.BARRIER, [None] * n) == [[], [], []]


def test_contributors():
    assert contributors(Collective.BROADCAST, 4, 2) == [2]
    assert contributors(Collective.ALL_REDUCE, 3, None) == [0, 1, 2]
    assert contributors(Collective.BARRIER, 3, None) == []


def test_long_folds_are_chunked_without_changing_a_bit(monkeypatch):
    """A data-parallel reduction over many members folds slice by slice; every element sees
    the same additions in the same order, so the result is bit-identical to the plain fold."""
    import nccl_ext.core.ops as ops

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(200_003, generator=g) * (10.0 ** (i % 5)) for i in range(5)]
    terms = [xs[i % 5] for i in range(40)]
    for kind in (ops.ReduceKind.SUM, ops.ReduceKind.AVG):
        chunked = ops.fold(kind, terms)
        monkeypatch.setattr(ops, "_CHUNKED_MIN_TERMS", 10**9)
        plain = ops.fold(kind, terms)
        monkeypatch.undo()
        assert torch.equal(chunked, plain)
