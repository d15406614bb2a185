"""A plain torch.distributed program touching every op the prism group serves.

Prints one line per result (``name <repr of values>``) so runs can be compared.
Written like user code: no prism imports.
"""

import os
import sys

import torch
import torch.distributed as dist


def show(name, t):
    vals = t.flatten().tolist() if isinstance(t, torch.Tensor) else t
    print(f"R{dist.get_rank()} {name} {vals!r}", flush=True)


def main():
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"R{rank} backend {dist.get_backend()} world {world}", flush=True)
    g = torch.Generator().manual_seed(1234 + rank)
    base = torch.randn(6, generator=g)

    for step in range(2):
        t = base * (step + 1)
        a = t.clone(); dist.all_reduce(a); show("all_reduce", a)
        a = t.clone(); dist.all_reduce(a, op=dist.ReduceOp.MAX); show("all_reduce_max", a)
        b = t.clone(); dist.broadcast(b, src=world - 1); show("broadcast", b)
        outs = [torch.empty(6) for _ in range(world)]; dist.all_gather(outs, t); show("all_gather", torch.cat(outs))
        o = torch.empty(6 * world); dist.all_gather_into_tensor(o, t); show("all_gather_into_tensor", o)
        rs = torch.empty(2); dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) + rank); show("reduce_scatter_tensor", rs)
        rl = torch.empty(3); dist.reduce_scatter(rl, [torch.full((3,), float(rank + i)) for i in range(world)]); show("reduce_scatter", rl)
        # uneven all_to_all_single: rank r sends (j+1) elements to rank j
        in_splits = [j + 1 for j in range(world)]
        out_splits = [rank + 1] * world
        inp = torch.arange(float(sum(in_splits))) + 100 * rank
        out = torch.empty(sum(out_splits))
        dist.all_to_all_single(out, inp, out_splits, in_splits); show("all_to_all_single", out)
        ins = [torch.full((2,), float(rank * 10 + j)) for j in range(world)]
        outs = [torch.empty(2) for _ in range(world)]
        dist.all_to_all(outs, ins); show("all_to_all", torch.cat(outs))
        r = t.clone(); dist.reduce(r, dst=0); show("reduce", r if rank == 0 else "n/a")
        gl = [torch.empty(6) for _ in range(world)] if rank == 0 else None
        dist.gather(t, gl, dst=0); show("gather", torch.cat(gl) if rank == 0 else "n/a")
        sc = torch.empty(2)
        dist.scatter(sc, [torch.full((2,), float(j)) for j in range(world)] if rank == 0 else None, src=0); show("scatter", sc)
        # ring p2p with batch_isend_irecv
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        recvd = torch.empty(6)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, recvd, prv)]):
            w.wait()
        show("ring", recvd)
        if rank % 2 == 0 and rank + 1 < world:
            dist.send(t, rank + 1)
        elif rank % 2 == 1:
            x = torch.empty(6); dist.recv(x, rank - 1); show("send_recv", x)
        w = dist.all_reduce(t.clone(), async_op=True); w.wait()
        obj = [{"step": step, "from": rank}] if rank == 0 else [None]
        dist.broadcast_object_list(obj, src=0); show("broadcast_object_list", obj)
        objs = [None] * world; dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank}); show("all_gather_object", objs)
        sub = dist.new_group(list(range(0, world, 2)))
        if rank % 2 == 0:
            s = t.clone(); dist.all_reduce(s, group=sub); show("subgroup_all_reduce", s)
        gsub = dist.new_group(list(range(1, world, 2)), backend="gloo")
        if rank % 2 == 1:
            s = t.clone(); dist.all_reduce(s, group=gsub); show("gloo_subgroup_all_reduce", s)
        import torch.distributed._functional_collectives as fc
        f = fc.all_reduce(t.clone(), "sum", dist.group.WORLD); show("functional_all_reduce", f.wait() if hasattr(f, "wait") else f + 0)
        dist.barrier()
        # a scheduling unit boundary, as a training step would make
        p = torch.nn.Parameter(torch.zeros(1)); opt = torch.optim.SGD([p], lr=0.1); p.grad = torch.ones(1); opt.step()
        print(f"step {step} | loss {float(a.sum())!r}", flush=True)
    if os.environ.get("FAIL_RANK") == str(rank):
        raise RuntimeError(f"injected failure on rank {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.exit(0)
