"""How fast the device data path's host tier fills from a trace on disk (runs on the CPU).

    python bench/host_tier.py [--ops 300] [--mib 7] [--threads 4] [--repeat 3]

Writes a trace whose rank 1 (virtual) holds one all-reduce contribution of ``--mib`` MiB per op
and rank 0 (the sandbox) its own (summed for the divergence checks), then fills the host tier
of rank 0's device path from it (mapped pages, as in emulation) and prints GB/s of staged data.
The tier has to run ahead of what the program consumes, or the first steps wait for it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nccl_ext.device_path import DevicePath  # noqa: E402
from nccl_ext.replay.transport import RecordedOp  # noqa: E402
from prism_launch.trace import TraceReader, TraceWriter  # noqa: E402


class Recording:
    """Rank 0 all-reduces with virtual rank 1; contributions read as views of the trace file."""

    def __init__(self, reader: TraceReader, ops: int, numel: int):
        self.reader, self.numel = reader, numel
        self.ops = [(self._op(s), 0, s, -1, 0) for s in range(ops)]

    def _op(self, seq: int) -> RecordedOp:
        return RecordedOp(op="allreduce", unit=0, t_start=0.0, t_end=0.0, n_tensors=1, shapes=((self.numel,),),
                          dtypes=("float32",), idx=seq, kind="all_reduce")

    def ops_of(self, rank):
        return self.ops

    def group_ranks(self, gid):
        return (0, 1)

    def folded(self, gid):
        return False

    def collective(self, rank, gid, seq):
        return self._op(seq)

    def piece(self, rank, gid, seq, i):
        return self.reader.tensor_view(rank, f"op{seq}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--mib", type=float, default=7.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    numel = int(a.mib * 2**20) // 4
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace"
        g = torch.Generator().manual_seed(0)
        with TraceWriter(path) as w:
            for r in (0, 1):
                for s in range(a.ops):
                    w.add_tensors(r, {f"op{s}": torch.randn(numel, generator=g)})
            w.commit(fingerprint={}, versions={}, world_size=2, topology={}, groups=[], ranks_captured=[0, 1])
        staged = a.ops * numel * 4
        rates = []
        for _ in range(a.repeat):
            reader = TraceReader(path, verify=False)
            dp = DevicePath(rank=0, sandbox=(0,), recording=Recording(reader, a.ops, numel), mode="stream",
                            tier_on_host=True, workers=a.threads, host_tier_bytes=staged + (1 << 20))
            t0 = time.monotonic()
            dp.prepare()
            dp._prep.join()
            load_s = time.monotonic() - t0
            assert dp.stats.host_tier_bytes == staged and all(p.refs is not None for p in dp._planned)
            dp.close()
            reader.close()
            rates.append(staged / load_s / 1e9)
        print(f"host tier: {a.ops} ops x {a.mib:g} MiB staged (+ as much summed), {a.threads} threads: "
              f"median {statistics.median(rates):.2f} GB/s of staged data (runs: "
              f"{', '.join(f'{r:.2f}' for r in rates)})")


if __name__ == "__main__":
    main()
