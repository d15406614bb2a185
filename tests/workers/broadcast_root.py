"""Broadcasts from rank 0 (a root a folded capture may not run) and a world all-reduce."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.arange(4, dtype=torch.float32) + 10.0  # what every rank holds before the broadcast
dist.broadcast(x, src=0)
empty = torch.empty(0)
dist.broadcast(empty, src=0)  # a zero-byte payload from a virtual root
y = torch.full((3,), float(rank))
dist.all_reduce(y)
print(f"R{rank} x {x.tolist()!r} y {y.tolist()!r}", flush=True)
dist.destroy_process_group()
