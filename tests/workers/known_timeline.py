"""A job whose timeline is known by construction, for prediction tests (no prism imports).

Per step: rank r burns COMPUTE_MS[r] ms of its thread's CPU time, then all ranks all-reduce;
then a two-stage pipeline: rank 0 burns 10 ms and sends to rank 1, which burns 15 ms and
sends back. Each rank holds (r + 1) × 256 KiB during the step (its peak is rank-dependent).
An iteration therefore takes max(COMPUTE_MS) + 10 + 15 ms of compute on the critical path,
plus one all-reduce of 1 KiB and two 1 KiB transfers.
"""

import time

import torch
import torch.distributed as dist

COMPUTE_MS = (20.0, 30.0, 25.0, 22.0)
STEPS = 4


def burn(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    for step in range(STEPS):
        held = torch.ones((rank + 1) * 65536)  # (rank + 1) × 256 KiB of float32
        burn(COMPUTE_MS[rank])
        t = torch.full((256,), float(rank))
        dist.all_reduce(t)
        if rank == 0:
            burn(10.0)
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            burn(15.0)
            dist.send(t, 0)
        del held
        p.grad = torch.ones(1)
        opt.step()  # a scheduling-unit boundary
        print(f"step {step} | loss {float(t.sum())!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
