"""Large folded groups reduce with stand-in counts: the same sums as member-by-member folding
(exact on integer-valued data), for all-reduce (sum, avg), reduce and reduce-scatter."""

import torch

from nccl_ext.core.ops import Collective, ReduceKind, compute
from prism_launch.capture.ops_state import OpGroup as _Group, PendingCollective as _PendingCollective
from prism_launch.capture.folded_reduction import weighted_reduction as _weighted_reduction


def _case(kind, reduce, n=100, captured=(3, 40), pieces=1, root=None):
    ranks = tuple(range(n))
    sources = tuple(r if r in captured else captured[r % len(captured)] for r in ranks)
    group = _Group(0, "k", ranks, 0, "DATA_PARALLEL_GROUP", sources=sources, present=len(captured))
    pc = _PendingCollective(group, 0, "x", kind, reduce, root, 0.0, [None] * n)
    g = torch.Generator().manual_seed(0)
    mine = {r: [torch.randint(-50, 50, (6,), generator=g).float() for _ in range(pieces)] for r in captured}
    for r in captured:
        pc.contributions[r] = mine[r]
        pc.arrivals[r] = object()
    full = [mine[sources[r]] for r in ranks]
    return pc, group, full


def test_weighted_all_reduce_and_reduce_match_the_member_fold():
    for reduce in (ReduceKind.SUM, ReduceKind.AVG):
        pc, group, full = _case(Collective.ALL_REDUCE, reduce, pieces=2)
        got = _weighted_reduction(pc, group)
        want = compute(Collective.ALL_REDUCE, full, reduce=reduce)
        for r in (3, 40):
            assert all(torch.equal(a, b) for a, b in zip(got[r], want[r]))
    pc, group, full = _case(Collective.REDUCE, ReduceKind.SUM, root=3)
    got, want = _weighted_reduction(pc, group), compute(Collective.REDUCE, full, reduce=ReduceKind.SUM, root=3)
    assert torch.equal(got[3][0], want[3][0]) and got[40] == []


def test_weighted_reduce_scatter_matches_the_member_fold():
    n = 100
    pc, group, full = _case(Collective.REDUCE_SCATTER, ReduceKind.SUM, n=n, pieces=2 * n)
    got = _weighted_reduction(pc, group)
    want = compute(Collective.REDUCE_SCATTER, full, reduce=ReduceKind.SUM)
    for r in (3, 40):
        assert len(got[r]) == 2 and all(torch.equal(a, b) for a, b in zip(got[r], want[r]))


def test_other_kinds_fall_back():
    pc, group, _ = _case(Collective.ALL_GATHER, None)
    assert _weighted_reduction(pc, group) is None
    pc, group, _ = _case(Collective.ALL_REDUCE, ReduceKind.MAX)
    assert _weighted_reduction(pc, group) is None


def test_weighted_fold_of_float_data_stays_within_the_summation_bound():
    """On float data the weighted fold rounds differently from the member fold; its error
    against the exact sum is bounded by (terms + 1) * u * sum|x| (recursive summation over the
    captured members and the scaled stand-ins, one rounding per scaling), where u is the unit
    roundoff — tighter than the member fold's own n * u * sum|x| bound, for any data."""
    n, captured = 1024, (0, 1, 2, 5, 77, 300, 511, 1000)
    for dtype, u in ((torch.float32, 2.0 ** -24), (torch.bfloat16, 2.0 ** -8)):
        for reduce in (ReduceKind.SUM, ReduceKind.AVG):
            ranks = tuple(range(n))
            sources = tuple(r if r in captured else captured[r % len(captured)] for r in ranks)
            group = _Group(0, "k", ranks, 0, "DATA_PARALLEL_GROUP", sources=sources, present=len(captured))
            pc = _PendingCollective(group, 0, "x", Collective.ALL_REDUCE, reduce, None, 0.0, [None] * n)
            g = torch.Generator().manual_seed(1)
            mine = {r: [(torch.randn(4096, generator=g) * 10 ** torch.randint(-3, 3, (4096,), generator=g)).to(dtype)]
                    for r in captured}
            for r in captured:
                pc.contributions[r], pc.arrivals[r] = mine[r], object()
            got = _weighted_reduction(pc, group)[captured[0]][0].double()
            members = torch.stack([mine[sources[r]][0].double() for r in ranks])
            exact, abs_sum = members.sum(0), members.abs().sum(0)
            terms = len(captured) + len(set(sources) - set(captured)) + len(captured)
            bound = (terms + 1) * u * abs_sum
            if reduce is ReduceKind.AVG:
                exact, bound = exact / n, bound / n + u * (exact / n).abs()
            err = (got - exact).abs()
            assert bool((err <= bound).all()), (dtype, reduce, float((err / bound.clamp_min(1e-300)).max()))
            assert float(err.max()) > 0 or dtype is torch.float32  # bf16 does round: the bound is what holds


def test_a_large_weighted_sum_on_several_threads_has_the_bits_of_one_pass():
    """Gradient-sized sums run in slices on a thread pool: every element sees the same
    operations in the same order (each scaled term rounded in its dtype, then added)."""
    from nccl_ext.core.sliced import PARALLEL_MIN
    from prism_launch.capture.folded_reduction import weighted_sum

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(PARALLEL_MIN + 12345, generator=g).to(dtype) for _ in range(2))
        for reduce in (ReduceKind.SUM, ReduceKind.AVG):
            want = a.clone()
            want.add_(b)
            want.add_(a * 255)
            want.add_(b * 255)
            if reduce is ReduceKind.AVG:
                want.div_(512)
            got = weighted_sum([(a, 1), (b, 1), (a, 255), (b, 255)], reduce, 512)
            assert got.dtype == dtype and torch.equal(got, want)
