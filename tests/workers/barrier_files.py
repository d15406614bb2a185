"""Rank 0 writes a file after a pause; every rank reads it after a barrier (the order a script
relies on when one rank writes what others read, e.g. a checkpoint's tracker file)."""

import time
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
flag = Path("written_by_rank0")
if rank == 0:
    time.sleep(2.0)
    flag.write_text("ready")
dist.barrier()
print(f"R{rank} sees {flag.read_text() if flag.exists() else 'nothing'}", flush=True)
dist.destroy_process_group()
