"""A small PrismTrace the trace tests write and read back."""

from pathlib import Path

import torch

from prism_launch.trace import TraceWriter

COMMIT_KW = dict(
    fingerprint={"config": "c0ffee", "script": "abc123"},
    versions={"torch": torch.__version__, "prism": "0.1"},
    world_size=4,
    topology={"nodes": 1, "gpus_per_node": 4},
    groups=[
        {"id": 0, "ranks": [0, 1, 2, 3], "backend": "nccl", "desc": "world"},
        {"id": 1, "ranks": [0, 1]},
    ],
    ranks_captured=[0, 1],
)


def sample_events():
    return [
        {
            "rank": 0,
            "idx": 1,
            "unit": 0,
            "kind": "collective",
            "op": "all_reduce",
            "group": 0,
            "seq": 1,
            "dtype": "bfloat16",
            "shape": (2, 3),
            "nbytes": 12,
            "t_start": 1.5,
            "t_end": 1.75,
            "compute_wall_s": 0.25,
            "compute_cpu_s": 0.125,
            "tensor_key": "ar/1",
            "extra": {"async_op": True},
        },
        {"rank": 0, "idx": 0, "kind": "marker", "op": "step_begin"},
        {"rank": 1, "idx": 0, "kind": "p2p", "op": "send", "peer": 0, "shape": torch.Size([4])},
    ]


def sample_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "ar/1": torch.randn(2, 3).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 7, dtype=torch.float16),
        "noncontig": base.t(),
    }


def write_sample(path, *, events=None, tensors=None, extra=None, **kw):
    """Write the sample trace at ``path``; returns the manifest and the tensors of rank 0."""
    tensors = sample_tensors() if tensors is None else tensors
    with TraceWriter(path) as w:
        w.add_events(sample_events() if events is None else events)
        w.add_tensors(0, tensors)
        w.write_json("config.json", {"lr": 0.1, "layers": [1, 2]})
        m = w.commit(**{**COMMIT_KW, **kw}, extra=extra or {"note": "x"})
    return m, tensors


def leftovers(parent: Path):
    """Names of writer staging or set-aside directories in ``parent``."""
    return [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]
