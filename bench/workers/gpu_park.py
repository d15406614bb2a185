"""A GPU job whose ranks each hold ``BALLAST_GIB`` of device memory (filled with a rank-specific
value) and exchange results every step; prints each step's results and whether the ballast
survived (for ``bench/gpu_park.py``)."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
torch.cuda.set_device(dev)
ballast = torch.empty(int(float(os.environ.get("BALLAST_GIB", "1")) * 2**30) // 4, dtype=torch.float32, device=dev)
ballast.fill_(rank + 0.5)
expected = ballast.sum().item()  # same kernel, same data -> same bits after every resume
g = torch.Generator(device=dev).manual_seed(1234 + rank)
w = torch.randn(1024, 1024, device=dev, generator=g)
for step in range(int(os.environ.get("STEPS", "2"))):
    x = torch.randn(1024, 1024, device=dev, generator=g) @ w
    dist.all_reduce(x)
    y = x[:8, 0].clone() if rank == 0 else torch.zeros(8, device=dev)
    dist.broadcast(y, 0)
    w = w + 1e-3 * x / world
    intact = ballast.sum().item() == expected and bool(ballast[:: 1 << 20].eq(rank + 0.5).all())
    print(f"R{rank} step {step} x {x.double().sum().item()!r} y {y.double().sum().item()!r} "
          f"w {w.double().sum().item()!r} ballast_intact {intact} "
          f"allocated_gib {torch.cuda.memory_allocated(dev) / 2**30:.2f}", flush=True)
dist.barrier()
