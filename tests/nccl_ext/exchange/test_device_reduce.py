"""Exchanged results computed in a rank's scratch (:mod:`nccl_ext.exchange.device_reduce`) are bitwise
those of :func:`nccl_ext.core.ops.compute` for every kind; pieces that do not fit fall back."""

import pytest
import torch

from nccl_ext.exchange.device_reduce import DeviceFold
from nccl_ext.core.ops import Collective, ReduceKind, compute
from tests.nccl_ext.device_path.test_device_path import KINDS, _contributions

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_results_are_the_host_folds_bits(kind, n, dtype):
    cs = _contributions(kind, n, dtype, torch.Generator().manual_seed(n))
    reduces = [ReduceKind.SUM, ReduceKind.AVG, ReduceKind.MAX, ReduceKind.PRODUCT] \
        if kind in (Collective.ALL_REDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER) else [None]
    fold = DeviceFold(torch.device("cpu"), 1 << 20)
    for reduce in reduces:
        for me in range(n):
            want = compute(kind, [[t.clone() for t in c] for c in cs], reduce=reduce, root=1)[me]
            got = fold.results(kind, cs, me, reduce=reduce, root=1)
            assert got is not None and len(got) == len(want)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape
                assert torch.equal(g.view(torch.int16) if g.dtype == torch.bfloat16 else g.view(torch.int32),
                                   w.view(torch.int16) if w.dtype == torch.bfloat16 else w.view(torch.int32))
                if not any(g is t for t in cs[me]):  # a peer's piece or a fold: in the scratch
                    assert fold.buf.data_ptr() <= g.data_ptr() < fold.buf.data_ptr() + fold.buf.numel()
    assert fold.device_ops == n * len(reduces) and fold.host_ops == 0


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
