"""Initialise megatron-core's parallel state for the layout in the environment, then do one
collective (where group discovery stops)."""

import os

import torch.distributed as dist
from megatron.core import parallel_state

dist.init_process_group("gloo")
parallel_state.initialize_model_parallel(
    tensor_model_parallel_size=int(os.environ.get("TP", 1)),
    pipeline_model_parallel_size=int(os.environ.get("PP", 1)),
    context_parallel_size=int(os.environ.get("CP", 1)),
    expert_model_parallel_size=int(os.environ.get("EP", 1)),
    expert_tensor_parallel_size=int(os.environ["ETP"]) if os.environ.get("ETP") else None,
)
dist.barrier()
