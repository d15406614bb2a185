"""Contributions staged on a GPU and read by peer processes through CUDA IPC
(:mod:`nccl_ext.exchange.ipc`): each member's result, computed on its fold stream after the
owners' interprocess events, has the bits of the host fold — also when the owner's data was
still being computed when it was staged (the read is ordered on the GPU, not by the CPU);
the host copy the trace reads holds the same bytes; a member is told an op was read only
after its fold ran; a full buffer says so and a freed region is reused."""

import os
import pickle
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from nccl_ext.exchange.arena import Arena, PeerViews
from nccl_ext.exchange.device_reduce import DeviceFold, gpu_results
from nccl_ext.exchange.ipc import GpuExchange
from nccl_ext.core.ops import Collective, ReduceKind, compute
from nccl_ext.core.pending import Pending

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")

N = 3
CASES = [(Collective.ALL_REDUCE, ReduceKind.SUM, torch.bfloat16), (Collective.ALL_REDUCE, ReduceKind.AVG, torch.float32),
         (Collective.ALL_GATHER, None, torch.bfloat16), (Collective.REDUCE_SCATTER, ReduceKind.SUM, torch.float32),
         (Collective.ALL_TO_ALL, None, torch.float32), (Collective.BROADCAST, None, torch.bfloat16)]


def _contributions(kind, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if kind in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return [[torch.randn(5, 7, generator=g).to(dtype) for _ in range(N)] for _ in range(N)]
    return [[torch.randn(64, 33, generator=g).to(dtype)] for _ in range(N)]


def _member(rank, directory, inbox, outbox):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    reads = []
    fold = DeviceFold(dev)
    gpu = GpuExchange(directory, rank, fold, 8 << 20, reads.append, scope=None)
    host = Arena(directory, rank, pin=True)
    peers = PeerViews(directory, pin=True)
    results, hosts = [], []
    for op, (kind, reduce, dtype) in enumerate(CASES):
        cs = _contributions(kind, dtype, op)
        mine = [torch.zeros_like(t, device=dev) for t in cs[rank]]
        torch.cuda._sleep(20_000_000)  # the program's stream is busy: the values below land late
        for m, t in zip(mine, cs[rank]):
            m.add_(t.to(dev, non_blocking=True))
        location, token = gpu.stage(mine, host)
        issue = gpu.issued()
        outbox.put((rank, op, location))
        locations = inbox.get()
        p = Pending(f"rank {rank} op {op}", 60.0, op)
        got = []

        def on_done(p, got=got):
            with torch.cuda.stream(p.apply_stream):
                got.extend(t.clone() for t in p.result())
                p.after_apply()

        p.add_done_callback(on_done)
        gpu.complete(p, op, issue, torch.cuda.current_stream(dev), lambda: gpu_results(
            fold, kind, [mine if g == rank else gpu.views(loc, peers.views) for g, loc in enumerate(locations)],
            rank, reduce, 0))
        torch.cuda.current_stream(dev).wait_event(p.device_done)
        results.append([t.cpu() for t in got])
        p.device_done.synchronize()
        hosts.append([t.clone() for t in peers.views((rank, *location[3]))])
        outbox.put((rank, op, "read"))
        inbox.get()  # every member has read: the region may go
        gpu.free(token, host)
    gpu.close(30.0)
    # plain bytes: a tensor put on a queue is passed by a file descriptor, gone once this process ends
    outbox.put(pickle.dumps((rank, "done", results, hosts, sorted(reads), gpu.ops, gpu.arena.full)))


def test_members_fold_each_others_gpu_pieces_bit_exactly():
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        inboxes = [ctx.Queue() for _ in range(N)]
        outbox = ctx.Queue()
        procs = [ctx.Process(target=_member, args=(r, d, inboxes[r], outbox)) for r in range(N)]
        for p in procs:
            p.start()
        try:
            for _op in CASES:
                locs = [None] * N
                for _ in range(N):
                    r, _o, loc = outbox.get(timeout=120)
                    locs[r] = (r, *loc)
                for q in inboxes:
                    q.put(locs)
                for _ in range(N):
                    outbox.get(timeout=120)
                for q in inboxes:
                    q.put("go")
            done = {}
            for _ in range(N):
                r, _tag, results, hosts, reads, staged, full = pickle.loads(outbox.get(timeout=120))
                done[r] = (results, hosts, reads, staged, full)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        assert all(p.exitcode == 0 for p in procs)
    dev = torch.device("cuda", 0)
    for op, (kind, reduce, dtype) in enumerate(CASES):
        cs = _contributions(kind, dtype, op)
        for r in range(N):
            # the same fold on the same device (CUDA divides an average by a reciprocal's product,
            # so its last bit may differ from the CPU's quotient)
            want = [t.cpu() for t in compute(kind, [[t.to(dev) for t in c] for c in cs], reduce=reduce, root=0)[r]]
            got = done[r][0][op]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape
                assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8)), (kind, reduce, r)
            for h, c in zip(done[r][1][op], cs[r]):  # the host copy the trace reads
                assert torch.equal(h, c)
    for r in range(N):
        assert done[r][2] == list(range(len(CASES)))  # each op reported read, after its fold
        assert done[r][3] == len(CASES) and done[r][4] == 0


def test_a_full_buffer_says_so_and_a_freed_region_is_reused():
    dev = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as d:
        gpu = GpuExchange(d, 0, DeviceFold(dev, 1 << 20), 2 << 20, lambda op: None, scope=frozenset({5}))
        x = torch.ones(1 << 18, device=dev)  # 1 MiB
        a = gpu.stage([x], None)
        b = gpu.stage([x], None)
        assert a is not None and b is not None and gpu.stage([x], None) is None
        assert gpu.arena.full == 1 and a[0][3] is None
        gpu.free(a[1], None)
        c = gpu.stage([x], None)
        assert c is not None and c[0][1] == a[0][1]
        assert gpu.needs_host((4, 5)) and not gpu.needs_host((1, 2))
        gpu.close(5.0)
