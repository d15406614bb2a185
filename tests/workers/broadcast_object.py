"""Rank 0 broadcasts a Python object (broadcast_object_list: a pickle the receivers unpickle)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
objs = [{"lr": 0.25, "size": torch.Size([2, 3]), "note": "p" * 96}] if rank == 0 else [None]
dist.broadcast_object_list(objs, src=0)
print(f"R{rank} got {objs[0]!r}", flush=True)
dist.destroy_process_group()
