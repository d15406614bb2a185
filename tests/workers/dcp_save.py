"""A torch.distributed.checkpoint save from every rank of a data-parallel world: its planner
gathers each rank's save plan to rank 0, which scatters the global plan back (what Megatron-LM's
``--ckpt-format torch_dist`` does). Prints what the checkpoint directory holds afterwards."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

dist.init_process_group("gloo")
rank = dist.get_rank()
state = {"w": torch.arange(8, dtype=torch.float32), "step": torch.tensor([3])}  # replicated, as DP ranks hold
dcp.save(state, checkpoint_id="ckpt")
dist.barrier()
print(f"R{rank} saved {sorted(os.listdir('ckpt'))}", flush=True)
dist.destroy_process_group()
