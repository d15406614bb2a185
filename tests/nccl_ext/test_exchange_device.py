"""Exchanged results computed in a rank's scratch (:mod:`nccl_ext.exchange_device`) are bitwise
those of :func:`nccl_ext.ops.compute` for every kind; pieces that do not fit fall back."""

import pytest
import torch

from nccl_ext.exchange_device import DeviceFold
from nccl_ext.ops import Collective, ReduceKind, compute

KINDS = [Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER,
         Collective.BROADCAST, Collective.ALL_TO_ALL, Collective.GATHER, Collective.SCATTER]


def contributions(kind, n, dtype, gen):
    pieces = n if kind in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL, Collective.SCATTER) else 2
    out = []
    for m in range(n):
        if kind in (Collective.BROADCAST, Collective.SCATTER) and m != 1:
            out.append(None)
        else:
            out.append([(torch.randn(37, 5, generator=gen) * 1e3).to(dtype) for _ in range(pieces)])
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_results_are_the_host_folds_bits(kind, n, dtype):
    gen = torch.Generator().manual_seed(n)
    cs = contributions(kind, n, dtype, gen)
    reduce = ReduceKind.SUM if kind in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER) else None
    fold = DeviceFold(torch.device("cpu"), 1 << 20)
    for me in range(n):
        want = compute(kind, [None if c is None else [t.clone() for t in c] for c in cs], reduce=reduce, root=1)[me]
        got = fold.results(kind, cs, me, reduce=reduce, root=1)
        assert got is not None and len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g.view(torch.uint8) if g.dtype == torch.bfloat16 else g,
                               w.view(torch.uint8) if w.dtype == torch.bfloat16 else w)
            if cs[me] is not None and not any(g is t for t in cs[me]):
                assert g.data_ptr() >= fold.buf.data_ptr()  # a peer's piece or a fold: in the scratch
    assert fold.device_ops == n and fold.host_ops == 0


def test_own_pieces_are_used_in_place_and_peers_copied():
    cs = [[torch.arange(4.0)], [torch.arange(4.0) + 10]]
    fold = DeviceFold(torch.device("cpu"), 1 << 16)
    out = fold.results(Collective.ALL_GATHER, cs, 0)
    assert out[0] is cs[0][0]
    assert out[1] is not cs[1][0] and torch.equal(out[1], cs[1][0])


@pytest.mark.parametrize("kind", [Collective.ALL_REDUCE, Collective.ALL_GATHER])
def test_pieces_that_do_not_fit_fall_back_to_the_host(kind):
    cs = [[torch.ones(1000)], [torch.ones(1000)], [torch.ones(1000)]]
    fold = DeviceFold(torch.device("cpu"), 4096)  # one piece (4000 B) fits, two do not
    assert fold.results(kind, cs, 0, reduce=ReduceKind.SUM) is None
    assert fold.host_ops == 1
