"""All-reduces a few times; HANG_RANK skips one and sleeps (a peer that never arrives).
SCALE multiplies the data (a live input that diverges from a capture); STEPS cuts the run short;
PID_DIR: each rank writes its pid to <PID_DIR>/rank<r>.pid once the process group is up."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("PID_DIR"):
    with open(os.path.join(os.environ["PID_DIR"], f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
scale = float(os.environ.get("SCALE", "1"))
for step in range(int(os.environ.get("STEPS", "3"))):
    t = torch.full((4,), float(rank + step)) * scale
    if os.environ.get("HANG_RANK") == str(rank) and step == 1:
        time.sleep(120)
    dist.all_reduce(t)
    print(f"rank {rank} step {step} | loss {t.sum().item()!r}", flush=True)
dist.destroy_process_group()
