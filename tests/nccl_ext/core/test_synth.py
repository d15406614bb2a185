"""Synthesized results (``payload=none``): every member contributes what this rank contributes,
written into the caller's tensors, finite and deterministic."""

import torch
import torch.distributed as dist

from nccl_ext.core import synth
from nccl_ext.core.groups import GroupInfo
from nccl_ext.core.ops import Collective, ReduceKind
from nccl_ext.core.call import CollectiveCall
from nccl_ext.frontend.process_group import PrismProcessGroup, PrismWorld


class _Synth:
    """A transport answering every op with :func:`synth.results` (as a payload-none capture does)."""

    timeout_s = 5.0

    def __init__(self, rank):
        self.rank = rank

    def register_group(self, group):
        pass

    def collective(self, group, seq, call):
        from nccl_ext.core.pending import Pending

        return Pending.done("op", synth.results(call, group.size, group.group_rank(self.rank)))

    def recv(self, group, src, tag, seq, like):
        from nccl_ext.core.pending import Pending

        return Pending.done("recv", [synth.fill(like)])

    def send(self, *a):
        from nccl_ext.core.pending import Pending

        return Pending.done("send")

    def park(self, pending):
        return None

    def waited(self, *a):
        pass

    def marker(self, name):
        pass


def _group(rank=1, size=4):
    world = PrismWorld(rank, size, _Synth(rank))
    info = world.registry.make(tuple(range(size)), "")
    return PrismProcessGroup(world, info)


def test_all_reduce_sums_n_copies_in_place_and_keeps_other_reductions():
    pg = _group()
    x = torch.tensor([1.0, -2.0, 3.5])
    ptr = x.data_ptr()
    pg.allreduce([x]).wait()
    assert torch.equal(x, torch.tensor([4.0, -8.0, 14.0])) and x.data_ptr() == ptr
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG):
        y = torch.tensor([1.5, 2.0])
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([y], opts).wait()
        assert torch.equal(y, torch.tensor([1.5, 2.0]))


def test_gathers_repeat_this_ranks_piece_and_reduce_scatter_scales_its_chunk():
    pg = _group(rank=2, size=4)
    out = torch.empty(8)
    pg._allgather_base(out, torch.tensor([7.0, 9.0])).wait()
    assert torch.equal(out, torch.tensor([7.0, 9.0] * 4))
    inp = torch.arange(8, dtype=torch.float32)
    res = torch.empty(2)
    pg._reduce_scatter_base(res, inp).wait()
    assert torch.equal(res, torch.tensor([4.0 * 4, 5.0 * 4]))  # chunk 2 of 4, four members


def test_all_to_all_pieces_are_the_one_addressed_to_me_so_exchanged_splits_agree():
    pg = _group(rank=1, size=4)
    counts = torch.tensor([3, 5, 2, 1])  # tokens this rank sends to each member
    recv_counts = torch.empty(4, dtype=torch.int64)
    pg.alltoall_base(recv_counts, counts, [], []).wait()
    assert recv_counts.tolist() == [5, 5, 5, 5]  # every member sends me what I send myself
    tokens = torch.arange(11, dtype=torch.float32).unsqueeze(1)
    out = torch.empty(20, 1)
    pg.alltoall_base(out, tokens, recv_counts.tolist(), counts.tolist()).wait()
    mine = tokens[3:8]
    assert torch.equal(out, torch.cat([mine] * 4))
    odd = torch.empty(6, 1)  # sizes that do not match: filled, finite
    pg.alltoall_base(odd, tokens, [1, 2, 2, 1], counts.tolist()).wait()
    assert torch.isfinite(odd).all()


def test_broadcast_and_receive_buffers_are_filled_deterministically_without_touching_the_rng():
    pg = _group(rank=1, size=2)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    a, b = torch.full((64,), float("nan")), torch.full((64,), float("nan"))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([a], opts).wait()
    pg.recv([b], 0, 0).wait()
    assert torch.isfinite(a).all() and torch.equal(a, b) and a.min() >= 0.5 and a.max() < 1.5
    assert a.unique().numel() > 1  # not a constant a layer norm would flatten
    assert torch.equal(torch.random.get_rng_state(), state)
    ids = torch.full((5,), -7, dtype=torch.int64)
    pg.recv([ids], 0, 0).wait()
    assert ids.tolist() == [0] * 5  # a valid token id


def test_only_small_broadcasts_are_carried():
    small = CollectiveCall("broadcast", Collective.BROADCAST, [torch.zeros(16)], root=0)
    large = CollectiveCall("broadcast", Collective.BROADCAST, None, root=0, standin=[torch.zeros(1 << 16)])
    reduce = CollectiveCall("allreduce", Collective.ALL_REDUCE, [torch.zeros(4)], reduce=ReduceKind.SUM)
    assert synth.carried(small, 1024) and not synth.carried(large, 1024) and not synth.carried(reduce, 1 << 30)
    assert synth.payload_bytes(large) == 4 << 16


def test_group_info_sizes_are_used():
    info = GroupInfo("3:x:0", (0, 1, 2), 0)
    call = CollectiveCall("allreduce", Collective.ALL_REDUCE, [torch.ones(2)], reduce=ReduceKind.SUM)
    assert synth.results(call, info.size, info.group_rank(2))[0].tolist() == [3.0, 3.0]
