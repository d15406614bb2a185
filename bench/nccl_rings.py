"""Pruned rings over NCCL between two GPUs, checked bit for bit against the full group.

    python bench/nccl_rings.py                   # needs 2 GPUs
    python bench/nccl_rings.py --backend gloo    # the same check on the CPU

Physical rank 0 (GPU 0) plays the live member, physical rank 1 (GPU 1) the edges — the
assistant's part in emulation — through the same code the emulation runs
(``RingChannels`` with ``group_factory(..., "nccl")``: one communicator per logical group,
messages matched by order). For each placement of the live member in a group of 8 it runs
all-reduce (SUM/AVG/MAX), reduce-scatter and all-gather in fp32 and bf16 and compares each
result with ``nccl_ext.core.ops.compute`` over the whole group on the CPU. Prints one line per
placement and the time per all-reduce.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccl_ext import pruning  # noqa: E402
from nccl_ext.core.ops import Collective, ReduceKind, compute  # noqa: E402
from nccl_ext.pruning.rings import PrunedRing, RingChannels, group_factory, ring_processes  # noqa: E402

N, ELEMS = 8, 1 << 18
REDUCES = (ReduceKind.SUM, ReduceKind.AVG, ReduceKind.MAX)


def member(m: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + m)
    return (torch.randn(ELEMS, generator=g) * 10 ** (m % 4)).to(dtype)


def chunks(m: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + m)
    return [(torch.randn(ELEMS // 4, generator=g) * 7 ** (m % 3)).to(dtype) for _ in range(N)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def node(phys: int, port: int, backend: str, out) -> None:
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(phys)
        dev = torch.device("cuda", phys)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=phys == 0)
    channels = RingChannels(group_factory(store, phys, backend, 60), tags=False,
                            device=dev if backend == "nccl" else None)
    lines = []
    for gid, live in enumerate(([0], [7], [3])):
        ring = PrunedRing.plan(N, live, lambda m: 0, edge_host=1)
        pg, local = channels.get(gid, ring_processes(ring))
        bad, t_ar = [], []
        for dtype in (torch.float32, torch.bfloat16):
            on = {m: member(m, dtype).to(dev) for m in range(N)}
            for red in REDUCES:
                sync()
                t0 = time.perf_counter()
                got = pruning.all_reduce(ring, pg, local, phys, red, lambda m: on[m], on[0], tag=None)
                sync()
                t_ar.append(time.perf_counter() - t0)
                if phys == 0:
                    exp = compute(Collective.ALL_REDUCE, [[member(m, dtype)] for m in range(N)], reduce=red)[live[0]][0]
                    bad += [] if torch.equal(got[live[0]].cpu(), exp) else [f"all_reduce {red} {dtype}"]
            cs = {m: [c.to(dev) for c in chunks(m, dtype)] for m in range(N)}
            got = pruning.reduce_scatter(ring, pg, local, phys, ReduceKind.SUM, lambda m, j: cs[m][j], cs[0][0], tag=None)
            sync()
            if phys == 0:
                exp = compute(Collective.REDUCE_SCATTER, [chunks(m, dtype) for m in range(N)], reduce=ReduceKind.SUM)
                bad += [] if torch.equal(got[live[0]].cpu(), exp[live[0]][0]) else [f"reduce_scatter {dtype}"]
            got = pruning.all_gather(ring, pg, local, phys, lambda m: on[m][:1000], on[0][:1000], tag=None)
            sync()
            if phys == 0:
                exp = compute(Collective.ALL_GATHER, [[member(m, dtype)[:1000]] for m in range(N)])[live[0]]
                ok = all(torch.equal(a.cpu(), b) for a, b in zip(got[live[0]], exp, strict=True))
                bad += [] if ok else [f"all_gather {dtype}"]
        if phys == 0:
            lines.append(f"live {live}: {'bit-identical' if not bad else 'MISMATCH ' + ', '.join(bad)}; "
                         f"all-reduce of {ELEMS} elements (fp32, bf16) median {sorted(t_ar)[len(t_ar) // 2] * 1e3:.2f} ms")
    if phys == 0:
        out.put((lines, channels.created))
    time.sleep(1)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    backend = ap.parse_args().backend
    if backend == "nccl" and torch.cuda.device_count() < 2:
        print("--backend nccl needs 2 GPUs (--backend gloo runs the check on the CPU)", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29611 + os.getpid() % 1000
    procs = [ctx.Process(target=node, args=(p, port, backend, out)) for p in range(2)]
    for p in procs:
        p.start()
    lines, created = out.get(timeout=300)
    for p in procs:
        p.join(60)
    for line in lines:
        print(line)
    print(f"{backend}: communicators created: {created} (one per logical group)")
    bad = any("MISMATCH" in l for l in lines) or any(p.exitcode != 0 for p in procs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
