"""A module entry point for `-m pkg.train` tests: one all_reduce, prints the result."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"MODULE rank {dist.get_rank()} name {__name__} sum {t.item()!r}", flush=True)
dist.destroy_process_group()
