"""Logical GPUs onto physical ones.

The script sees the target's topology: ``LOCAL_RANK`` up to ``--nproc-per-node - 1``, and it
names its GPU as it would on an 8-GPU node. Here the rank runs on the physical GPU the
launcher gave it: its device slot in the rank plan (``RankPlan.device_slot``) modulo the GPUs
present. A rank owns one GPU, as under
torchrun, so every CUDA index it names — ``LOCAL_RANK`` or any other — means that GPU:

* ``torch.cuda.set_device(anything)`` selects it, so ``torch.cuda.current_device()`` — what
  Megatron-style code and DeepSpeed's ``current_device_name()`` allocate on — is the physical
  GPU;
* ``torch.cuda.device(i)`` (the context manager, and ``device_of``), and the ``torch.cuda``
  functions that take a device (``synchronize``, ``get_device_properties``,
  ``memory_allocated`` …, :data:`DEVICE_FUNCTIONS`) map their index;
* when ``LOCAL_RANK`` differs from the physical index (a logical GPU that does not exist
  here), :class:`LogicalCudaMode`, a global ``TorchFunctionMode``, maps explicit indices in
  torch calls: ``device=`` keyword arguments (``torch.device("cuda", 5)``, ``"cuda:5"``, ``5``),
  the positional device of ``Tensor.to`` (so ``module.to(f"cuda:{local_rank}")``) and of
  ``Tensor.cuda``. A rank whose ``LOCAL_RANK`` is its physical index does not pay for the mode,
  nor does a rank whose integrations do not ask for it (``EXPLICIT_CUDA_INDICES`` in a
  compatibility module: DeepSpeed's): the mode runs Python on every torch call, which a
  launch-bound Megatron step would feel in its step time and its calibrated spans.

What a ``torch.device("cuda", 5)`` object itself prints is unchanged (it is not a torch call);
tensors made with it are on the physical GPU. Frameworks that pick their device elsewhere
(DeepSpeed's accelerator) are mapped by their integration, from the same plan rule.
"""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "physical", "map_index", "map_device", "LogicalCudaMode", "DEVICE_FUNCTIONS"]

DEVICE_FUNCTIONS = (
    "synchronize", "get_device_properties", "get_device_name", "get_device_capability", "mem_get_info",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
    "memory_summary", "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_accumulated_memory_stats",
    "set_per_process_memory_fraction",
)
"""``torch.cuda`` functions whose ``device`` argument (first positional or keyword) is mapped."""

_STATE: dict[str, object] = {}


def physical() -> int | None:
    """The physical GPU index every logical one maps to (None: not installed)."""
    return _STATE.get("physical")  # type: ignore[return-value]


def map_index(device, target: int):
    """``device`` (an int, ``"cuda[:N]"``, a ``torch.device`` or None) with any CUDA index made
    ``target``; anything else is returned unchanged. Integers stay integers, strings strings."""
    if isinstance(device, bool) or device is None:
        return device
    if isinstance(device, int):
        return target
    if isinstance(device, str):
        if device.startswith("cuda:") and device != f"cuda:{target}":
            return f"cuda:{target}"
        return device
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None \
            and device.index != target:
        return torch.device("cuda", target)
    return device


def map_device(device, target: torch.device):
    """A device argument of a torch call mapped onto ``target``: a CUDA device with an index
    other than ``target``'s, or an integer index, becomes ``target`` (a ``torch.device``)."""
    if isinstance(device, bool) or device is None:
        return device
    if isinstance(device, int):
        return target
    if isinstance(device, str):
        if device.startswith("cuda:") and device != str(target):
            return target
        return device
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None \
            and device != target:
        return target
    return device


class LogicalCudaMode(TorchFunctionMode):
    """Explicit CUDA indices in torch calls -> ``target`` (the rank's physical GPU)."""

    def __init__(self, target: torch.device):
        super().__init__()
        self.target = target
        self._positional = {torch.Tensor.to: self._to, torch.Tensor.cuda: self._cuda}

    def _to(self, args):
        return (args[0], map_device(args[1], self.target), *args[2:])

    def _cuda(self, args):
        index = self.target.index if self.target.type == "cuda" else None
        return (args[0], args[1] if index is None else map_index(args[1], index), *args[2:])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None:
                mapped = map_device(dev, self.target)
                if mapped is not dev:
                    kwargs = {**kwargs, "device": mapped}
        else:
            kwargs = {}
        fix = self._positional.get(func)
        if fix is not None and len(args) > 1:
            args = fix(args)
        return func(*args, **kwargs)


def _map_first_arg(fn, target: int):
    def wrapper(*args, **kwargs):
        if args:
            args = (map_index(args[0], target), *args[1:])
        elif kwargs.get("device") is not None:
            kwargs["device"] = map_index(kwargs["device"], target)
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


def install(slot: int | None = None, *, index: int | None = None, local_rank: int | None = None,
            cuda=None, mode: bool | None = None) -> int | None:
    """Redirect device selection to physical GPU ``index`` (default: ``slot % GPUs``); returns it.

    ``local_rank`` defaults to ``LOCAL_RANK``; the TorchFunctionMode is pushed when it differs
    from the physical index (``mode`` forces it on or off). ``cuda`` is the ``torch.cuda``
    module to patch (tests pass a stand-in)."""
    cuda = torch.cuda if cuda is None else cuda
    if not cuda.is_available():
        return None
    if "physical" in _STATE:
        return _STATE["physical"]  # type: ignore[return-value]
    physical_index = slot % cuda.device_count() if index is None else index
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", physical_index))
    real_set_device = cuda.set_device

    def set_device(device) -> None:
        real_set_device(physical_index)

    set_device.__doc__ = real_set_device.__doc__
    set_device.__wrapped__ = real_set_device
    cuda.set_device = set_device
    for name in DEVICE_FUNCTIONS:
        fn = getattr(cuda, name, None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            setattr(cuda, name, _map_first_arg(fn, physical_index))
    device_cls = getattr(cuda, "device", None)
    if isinstance(device_cls, type) and not hasattr(device_cls.__init__, "__wrapped__"):
        real_init = device_cls.__init__

        def __init__(self, device):
            real_init(self, map_index(device, physical_index))
            if isinstance(getattr(self, "idx", None), int) and self.idx >= 0:
                self.idx = physical_index

        __init__.__wrapped__ = real_init
        device_cls.__init__ = __init__
    real_set_device(physical_index)
    _STATE["physical"] = physical_index
    if mode if mode is not None else local_rank != physical_index:
        m = LogicalCudaMode(torch.device("cuda", physical_index))
        m.__enter__()
        _STATE["mode"] = m
    return physical_index
