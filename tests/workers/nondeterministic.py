"""A program with the three kinds of divergence between runs (no prism imports): wall-clock
times all-reduced from ``log_times`` (host scalars when the config names that site), float
data with noise in the sixth digit, as a non-deterministic kernel gives (within tolerance), and —
only when DIVERGE=1 — a changed value."""

import os
import random
import time

import torch
import torch.distributed as dist

T0 = time.time()
N = 1 << 16


def log_times() -> None:
    t = torch.tensor([time.time() - T0, time.process_time()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)


def noisy(step: int) -> torch.Tensor:
    # 64Ki elements: the noise of two runs leaves the same 32-bit word sum (the device path's
    # check) with a chance near 4e-4 per op, against 2e-3 at 1,000 elements
    base = torch.randn(N, generator=torch.Generator().manual_seed(step)) + 2.0
    t = base * (1 + 1e-6 * torch.rand(N, generator=torch.Generator().manual_seed(random.randrange(2**62))))
    dist.all_reduce(t)
    return t


def main() -> None:
    dist.init_process_group("gloo")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    for step in range(3):
        t = noisy(step)
        log_times()
        x = torch.full((8,), float(dist.get_rank() + step))
        if os.environ.get("DIVERGE") == "1" and step == 2:
            x += 1
        dist.all_reduce(x)
        p.grad = torch.ones(1)
        opt.step()
        print(f"step {step} | loss {float(x.sum())!r} | noisy {float(t.sum()):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
