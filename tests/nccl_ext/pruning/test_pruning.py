"""Pruned rings with compensation, run for real over gloo between processes: every live
member's result equals the full group's (``nccl_ext.core.ops.compute``) bit for bit, for
all-reduce, reduce-scatter and all-gather, with live members at the ring's edges, adjacent,
far apart, alone, and all live (the unpruned reference)."""

import datetime
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from nccl_ext.pruning import rings as pruning
from nccl_ext.core.ops import Collective, ReduceKind, compute
from nccl_ext.pruning.rings import PrunedRing, RingChannels, ring_processes

N = 8
ELEMS = 300_001  # a few 1 MiB chunks in float32, an odd count
REDUCES = [ReduceKind.SUM, ReduceKind.AVG, ReduceKind.MAX]


def test_plan_keeps_live_members_and_one_edge_per_arc():
    ring = PrunedRing.plan(8, [3], lambda m: 0, edge_host=9)
    assert [(x.live, x.leading, x.arc, x.trailing) for x in ring.nodes] == [
        (None, (0, 1, 2), (), (4, 5, 6, 7)), (3, (), (), ())]
    assert ring.pruned == 6 and ring.chain() == [(0, "leading"), (1, "live"), (0, "trailing")]
    ring = PrunedRing.plan(8, [0, 7], lambda m: m, edge_host=9)
    assert [x.members for x in ring.nodes] == [(0,), tuple(range(1, 7)), (7,)]
    ring = PrunedRing.plan(8, [1, 6], lambda m: m, edge_host=9)
    assert [x.members for x in ring.nodes] == [(0, 7), (1,), (2, 3, 4, 5), (6,)]
    assert [x.phys for x in ring.nodes] == [9, 1, 9, 6]
    ring = PrunedRing.plan(4, range(4), lambda m: m, edge_host=9)
    assert all(x.live is not None for x in ring.nodes) and ring.pruned == 0
    with pytest.raises(ValueError):
        PrunedRing.plan(4, [5], lambda m: m, edge_host=9)


def _member(m: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + m)
    return (torch.randn(ELEMS, generator=g) * 10 ** (m % 4)).to(dtype)


def _chunks(m: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + m)
    return [(torch.randn(ELEMS // 4, generator=g) * 7 ** (m % 3)).to(dtype) for _ in range(N)]


def _node(phys: int, size: int, live: list[int], store_path: str, out, tags: bool) -> None:
    torch.set_num_threads(1)  # forked after the parent's OpenMP pool ran: stay out of it
    try:
        store = dist.FileStore(store_path, size)
        made = []

        def make(gid, members):
            made.append((gid, members))
            return dist.ProcessGroupGloo(dist.PrefixStore(f"g{gid}", store), members.index(phys), len(members),
                                         datetime.timedelta(seconds=60))

        channels = RingChannels(make, tags=tags)
        ring = PrunedRing.plan(N, live, lambda m: live.index(m), edge_host=len(live))
        group, local = channels.get(7, ring_processes(ring))
        assert channels.get(7, ring_processes(ring))[0] is group and made == [(7, tuple(range(size)))]
        res = {}
        tag = 0 if tags else None
        for dtype in (torch.float32, torch.bfloat16):
            for red in REDUCES:
                tag = tag + 1 if tags else None
                got = pruning.all_reduce(ring, group, local, phys, red, lambda m: _member(m, dtype),
                                         _member(0, dtype), tag=tag)
                res.update({("ar", str(dtype), red.value, m): t for m, t in got.items()})
            tag = tag + 1 if tags else None
            got = pruning.reduce_scatter(ring, group, local, phys, ReduceKind.SUM,
                                         lambda m, j: _chunks(m, dtype)[j], _chunks(0, dtype)[0], tag=tag)
            res.update({("rs", str(dtype), "sum", m): t for m, t in got.items()})
            tag = tag + 1 if tags else None
            got = pruning.all_gather(ring, group, local, phys, lambda m: _member(m, dtype)[:1000],
                                     _member(0, dtype)[:1000], tag=tag)
            res.update({("ag", str(dtype), "", m): torch.stack(ts) for m, ts in got.items()})
        torch.save(res, f"{store_path}.{phys}.pt")  # files, not the queue: no fd passing at exit
        out.put((phys, None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        out.put((phys, repr(e)))


def _run(live: list[int], tmp_path, tags: bool = True) -> dict:
    size = len(live) + (1 if len(live) < N else 0)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_node, args=(p, size, live, str(tmp_path / "store"), out, tags)) for p in range(size)]
    for p in procs:
        p.start()
    results: dict = {}
    for _ in procs:
        phys, err = out.get(timeout=180)
        assert err is None, (phys, err)
        results.update(torch.load(tmp_path / f"store.{phys}.pt"))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def _expected(live: list[int]) -> dict:
    exp = {}
    for dtype in (torch.float32, torch.bfloat16):
        members = [[_member(m, dtype)] for m in range(N)]
        for red in REDUCES:
            full = compute(Collective.ALL_REDUCE, members, reduce=red)
            exp.update({("ar", str(dtype), red.value, m): full[m][0] for m in live})
        full = compute(Collective.REDUCE_SCATTER, [_chunks(m, dtype) for m in range(N)], reduce=ReduceKind.SUM)
        exp.update({("rs", str(dtype), "sum", m): full[m][0] for m in live})
        full = compute(Collective.ALL_GATHER, [[_member(m, dtype)[:1000]] for m in range(N)])
        exp.update({("ag", str(dtype), "", m): torch.stack(full[m]) for m in live})
    return exp


@pytest.mark.parametrize("live", [[0], [7], [3], [0, 7], [3, 4], [1, 6], [0, 2, 5], list(range(N))],
                         ids=["first", "last", "middle", "both-edges", "adjacent", "far-apart", "three", "unpruned"])
@pytest.mark.parametrize("tags", [True, False], ids=["tagged", "ordered"])
def test_pruned_ring_results_equal_the_full_group_bit_for_bit(live, tags, tmp_path):
    """``ordered``: messages carry no tag, so gloo matches them by issue order only — NCCL's rule."""
    got, exp = _run(live, tmp_path, tags), _expected(live)
    assert got.keys() == exp.keys()
    for key, t in exp.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
