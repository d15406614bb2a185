"""Logical GPUs onto physical ones.

The script sees the target's topology: ``LOCAL_RANK`` up to ``--nproc-per-node - 1`` and calls
``torch.cuda.set_device(LOCAL_RANK)`` as it would on an 8-GPU node. Here the rank runs on the
physical GPU the launcher gave it (its device slot in the rank plan, modulo the GPUs present): every
``set_device`` is redirected there, so ``torch.cuda.current_device()`` — what Megatron-style
code allocates on — is the physical GPU. (Tensors created with an explicit ``cuda:N`` beyond the
physical count are not redirected.)
"""

from __future__ import annotations


def install(slot: int) -> int | None:
    """Redirect device selection to the physical GPU of device slot ``slot``; returns its index."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    physical = slot % n
    real_set_device = torch.cuda.set_device

    def set_device(device) -> None:
        real_set_device(physical)

    set_device.__doc__ = real_set_device.__doc__
    torch.cuda.set_device = set_device
    real_set_device(physical)
    return physical
