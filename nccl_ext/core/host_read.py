"""A few device values read on the host without a copy to pageable memory.

A copy from the GPU to pageable host memory (``tensor.cpu()``, ``tensor.tolist()``,
``float(tensor)``) returns only once the stream has reached it, and meanwhile holds the CUDA
driver's lock. Behind a wait on the GPU (:mod:`nccl_ext.capture.deferred_waits`) the stream
reaches it only after the op's fold, which another thread queues with driver calls: that
thread waits for the lock, the copy for the fold, and the rank stops. A copy into pinned memory
is queued like a kernel and returns at once; the host then waits on an event, which holds no
lock. What a capture reads of the program's tensors (routing counts, auxiliary losses) goes
through :func:`read`; :func:`to_pinned` is the same copy left for the caller to wait on.
"""

from __future__ import annotations

import torch


def to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in pinned host memory, copied on the current stream (not waited for:
    the caller synchronises before reading them); a CPU tensor as it is."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def read(tensors: list[torch.Tensor]) -> list[list]:
    """Each tensor's values as a flat Python list, the device ones through pinned memory and one
    event wait (module doc)."""
    with torch.no_grad():
        hosts = [to_pinned(t.detach().reshape(-1)) for t in tensors]
        if any(t.is_cuda for t in tensors):
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
        return [h.tolist() for h in hosts]
