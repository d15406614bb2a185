"""The TorchFunctionMode of :mod:`integrations.cpu_compat`: CUDA device arguments -> CPU.

This module owns the rewriting of torch calls: :class:`CudaAsCpuMode` turns ``device="cuda"``,
``"cuda:N"``, ``torch.device("cuda", N)`` and integer ``device=N`` keyword arguments (and the
positional device of ``Tensor.to``) into CPU, ``pin_memory=True`` into ``False``, makes
``Tensor.cuda()`` / ``Tensor.pin_memory()`` return the tensor itself, and gives
``Tensor.type()`` its ``torch.cuda.<T>Tensor`` names. Pushing the mode, and keeping it on the
stack through backward passes, is ``cpu_compat``'s business.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaAsCpuMode", "mode_active", "TYPE_CLASS_TO_DTYPE"]

_CPU = torch.device("cpu")


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return isinstance(dev, int) and not isinstance(dev, bool)


TYPE_CLASS_TO_DTYPE: dict = {}
"""Legacy tensor-type classes (stock ``torch.cuda.<T>Tensor`` and their replacements) -> dtype,
for ``Tensor.type(cls)``; ``cpu_compat`` fills it when it replaces the types."""


def _tensor_type(func, args, kwargs):
    if len(args) == 1 and kwargs.get("dtype") is None:
        kwargs.pop("dtype", None)
        name = func(*args, **kwargs)
        if (
            isinstance(name, str)
            and name.startswith("torch.")
            and not name.startswith("torch.cuda.")
            and args[0].device.type == "cpu"
        ):
            return "torch.cuda." + name[len("torch."):]
        return name
    if len(args) > 1:
        self, dtype, rest = args[0], args[1], args[2:]
    else:
        self, dtype, rest = args[0], kwargs.pop("dtype"), ()
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda."):]
    elif isinstance(dtype, type) and dtype in TYPE_CLASS_TO_DTYPE:
        dtype = TYPE_CLASS_TO_DTYPE[dtype]
    return func(self, dtype, *rest, **kwargs)


def _tensor_to(func, args, kwargs):
    if len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], _CPU) + tuple(args[2:])
    return func(*args, **kwargs)


def _return_self(func, args, kwargs):
    return args[0]


_SPECIAL = {
    torch.Tensor.cuda: _return_self,
    torch.Tensor.pin_memory: _return_self,
    torch.Tensor.to: _tensor_to,
    torch.Tensor.type: _tensor_type,
}


class CudaAsCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to CPU (see :mod:`integrations.cpu_compat`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None and _is_cuda_device(dev):
                kwargs = dict(kwargs)
                kwargs["device"] = _CPU
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                kwargs["pin_memory"] = False
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, dict(kwargs) if kwargs else {})
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


def mode_active() -> bool:
    """Whether a CudaAsCpuMode is on this thread's torch-function mode stack."""
    n = torch._C._len_torch_function_stack()
    for i in range(n):
        if isinstance(torch._C._get_function_stack_at(i), CudaAsCpuMode):
            return True
    return False
