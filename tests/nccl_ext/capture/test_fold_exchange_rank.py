"""A captured rank's side of a folded group's weighted reduction summed through the exchange
(:meth:`nccl_ext.capture.rank_exchange.RankExchange._compute_folded`), on both of its paths, with the
GPU exchange stood in for by host tensors (its views, its own staged pieces, its completion): the
caller's tensors get the coordinator's sum, written in place; a sandbox rank stages its result
and names it in its ``xread``; a virtual rank's ``xread`` names nothing."""

from collections import defaultdict
from types import SimpleNamespace

import torch

from nccl_ext.capture.rank_exchange import RankExchange
from nccl_ext.exchange.arena import Arena, PeerViews, claim_directory, release_directory
from nccl_ext.exchange.ipc import DEVICE_TAG
from nccl_ext.core.replica_sums import terms, weighted_sum
from nccl_ext.core.ops import Collective, ReduceKind
from nccl_ext.core.pending import Pending
from nccl_ext.capture.pending_ops import PendingOps
from nccl_ext.capture.progress import RankProgress
from nccl_ext.core.protocol import XRead

N = 100  # members; 0 and 1 captured, each standing in for 49 others
PARTS = terms([g < 2 for g in range(N)], [g % 2 for g in range(N)])


class FakeGpu:
    """The GPU exchange's surface the folded path uses, over host tensors."""

    def __init__(self, staged: dict, scratch_bytes: int = 64):
        self.staged = staged  # rank -> its staged pieces
        self.fold = SimpleNamespace(buf=torch.empty(scratch_bytes, dtype=torch.uint8))  # a few elements a slice
        self.gated = []

    def views(self, location, host_views):
        return self.staged[location[0]]

    def own_views(self, descs):
        return self.staged[self.me]

    def when_staged(self, locations, then, gated):
        self.gated.append((len(locations), gated))
        then()

    def complete(self, p, op_id, issue, program, results, flag=None):
        p.complete(results())


def Rank(rank: int, directory: str, scope, gpu=None) -> RankExchange:
    """A rank's exchange over host arenas, its messages to the coordinator in ``.sent`` (its waits
    on the GPU: none deferred)."""
    sent = []
    waits = SimpleNamespace(deferring=False, await_staging=lambda op_id: None,
                            in_order=lambda op_id, queue_fold: queue_fold(), flag_writer=lambda op_id: None)
    x = RankExchange(RankProgress(rank), directory, scope, 0, PendingOps(30.0), sent.append,
                     lambda: (0.0, 0.0, 0.0), waits, defaultdict(float))
    x._gpu = gpu
    x._arena, x._peers = Arena(directory, rank), PeerViews(directory)
    x.sent = sent
    return x


def _contributions(kind):
    g = torch.Generator().manual_seed(7)
    pieces = N * 2 if kind is Collective.REDUCE_SCATTER else 2
    return {r: [torch.randn(37, generator=g) * 100 for _ in range(pieces)] for r in (0, 1)}


def _want(kind, contributions, me, reduce):
    idx = [i * N + me for i in range(2)] if kind is Collective.REDUCE_SCATTER else [0, 1]
    return [weighted_sum([(contributions[g][i], k) for g, k in PARTS], reduce, N) for i in idx]


def _op(rank: Rank, kind, contributions, me, issue):
    """Issue op 3 as ``_exchanged`` leaves it, then answer it as the coordinator's ``xok`` does."""
    p = Pending(f"rank {me} op", 30.0, 3)
    rank._pending.add(3, p)
    mine = [t.clone() for t in contributions[me]]
    targets = [torch.full((37,), float("nan")) for _ in range(2)] if kind is Collective.REDUCE_SCATTER else mine
    rank._xops[3] = (kind, ReduceKind.SUM, None, me, mine, None, issue)
    rank._xtargets[3] = targets
    return p, targets


def test_the_gpu_path_sums_into_the_callers_tensors_and_stages_the_sandbox_members_result(tmp_path):
    d = claim_directory(tmp_path)
    try:
        for kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER):
            contributions = _contributions(kind)
            for me, scope in ((1, frozenset({1})), (0, frozenset({1}))):
                gpu = FakeGpu(contributions)
                gpu.me = me
                rank = Rank(me, d, scope, gpu)
                p, targets = _op(rank, kind, contributions, me, issue=("event", "stream"))
                locations = [(g, DEVICE_TAG, [], g, None) if g < 2 else None for g in range(N)]
                rank._compute_exchanged(3, locations, PARTS)
                assert p.is_done and p.error is None and gpu.gated == [(1, False)]  # gated on its one captured peer
                got = p.result()
                assert all(a is b for a, b in zip(got, targets))  # written in place: no copy to make
                assert all(torch.equal(t, w) for t, w in zip(targets, _want(kind, contributions, me, ReduceKind.SUM)))
                rank._xread(3)
                if me in scope:
                    (op, (gen, descs)), = rank.sent
                    staged = rank._peers.views((me, gen, descs))
                    assert op == 3 and all(torch.equal(s, t) for s, t in zip(staged, targets))
                else:
                    assert rank.sent == [XRead(3, None)] and 3 not in rank._kept
                rank._arena.close()
                rank._peers.close()
    finally:
        release_directory(d)


def test_the_host_path_sums_from_the_peers_arenas(tmp_path):
    d = claim_directory(tmp_path)
    try:
        kind = Collective.REDUCE_SCATTER
        contributions = _contributions(kind)
        rank = Rank(1, d, frozenset({1}))
        arenas = {0: Arena(d, 0), 1: rank._arena}  # each rank stages in its own arena
        locations = [None] * N
        for r in (0, 1):
            gen, descs, _ = arenas[r].put(contributions[r])
            locations[r] = (r, gen, descs)
        p, targets = _op(rank, kind, contributions, 1, issue=None)
        rank._compute_exchanged(3, locations, PARTS)
        assert p.is_done and p.error is None and all(torch.equal(t, w) for t, w in zip(targets, _want(kind, contributions, 1, ReduceKind.SUM)))
        (op, (gen, descs)), = rank.sent  # the host path reports its read with the kept result
        assert op == 3 and all(torch.equal(s, t) for s, t in zip(rank._peers.views((1, gen, descs)), targets))
        arenas[0].close()
        rank._arena.close()
        rank._peers.close()
    finally:
        release_directory(d)
