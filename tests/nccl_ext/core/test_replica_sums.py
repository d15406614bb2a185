"""The weighted sum of a large folded group's reduction (:mod:`nccl_ext.core.replica_sums`) has the same
bits whoever computes it: the coordinator (a new tensor, in slices on threads) and a captured
member (into its own tensor, through a small scratch)."""

import pytest
import torch

from nccl_ext.core.replica_sums import exchangeable, fold_into, shard_indices, terms, weighted_sum
from nccl_ext.core.ops import Collective, ReduceKind


def test_terms_are_the_present_members_then_each_stand_in_with_its_count():
    present = [False, True, False, False, True, False]
    sources = [1, 1, 4, 1, 4, 4]
    assert terms(present, sources) == [(1, 1), (4, 1), (1, 2), (4, 2)]
    sources = [4, 1, 1, 4, 4, 1]
    assert terms(present, sources) == [(1, 1), (4, 1), (4, 2), (1, 2)]  # stand-ins in order of first absent member


def test_only_weighted_reductions_of_folded_groups_with_several_captured_members_are_exchanged():
    ranks = list(range(100))
    assert exchangeable(Collective.ALL_REDUCE, ReduceKind.SUM, ranks, {3, 7}, 8)
    assert exchangeable(Collective.REDUCE_SCATTER, ReduceKind.AVG, ranks, {3, 7, 200}, 8)
    assert not exchangeable(Collective.ALL_REDUCE, ReduceKind.SUM, ranks, {3}, 8)  # mirrored
    assert not exchangeable(Collective.ALL_REDUCE, ReduceKind.MAX, ranks, {3, 7}, 8)
    assert not exchangeable(Collective.ALL_GATHER, None, ranks, {3, 7}, 8)
    assert not exchangeable(Collective.ALL_REDUCE, ReduceKind.SUM, ranks[:64], {3, 7}, 8)  # folded exactly
    assert not exchangeable(Collective.ALL_REDUCE, ReduceKind.SUM, ranks, set(range(9)), 8)
    assert not exchangeable(Collective.ALL_REDUCE, ReduceKind.SUM, ranks, None, 8)
    assert shard_indices(Collective.REDUCE_SCATTER, 8, 4, 1) == [1, 5]
    assert shard_indices(Collective.ALL_REDUCE, 3, 4, 1) == [0, 1, 2]


def test_a_member_sums_into_its_own_tensor_slice_by_slice_with_the_coordinators_bits():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(10_001, generator=g).mul(1e3).to(dtype) for _ in range(2))
        parts = [(a, 1), (b, 1), (a, 255), (b, 256)]
        for reduce in (ReduceKind.SUM, ReduceKind.AVG):
            want = weighted_sum(parts, reduce, 513)
            out = torch.full_like(a, float("nan"))
            fold_into(out, parts, reduce, 513, torch.empty(96, dtype=torch.uint8))  # 24 fp32 / 48 bf16 a slice
            assert torch.equal(out, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_member_on_a_gpu_gets_the_coordinators_host_bits_for_a_sum():
    """SUM: every step (a scaled term, an addition) is one IEEE operation on either device. (An
    AVG's division by a host scalar is a multiplication by its reciprocal on CUDA: there the
    trace keeps the member's own result, so emulation still serves the bits the program got.)"""
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(100_003, generator=g).mul(1e3).to(dtype) for _ in range(2))
        parts = [(a, 1), (b, 1), (a, 255), (b, 256)]
        want = weighted_sum(parts, ReduceKind.SUM, 513)
        out = torch.empty(a.shape, dtype=dtype, device=dev)
        peer_on_host = [(a.to(dev), 1), (b, 1), (a.to(dev), 255), (b, 256)]  # a peer's pieces staged on the host
        fold_into(out, peer_on_host, ReduceKind.SUM, 513, torch.empty(4096, dtype=torch.uint8, device=dev))
        assert torch.equal(out.cpu(), want), dtype
