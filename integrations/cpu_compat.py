"""Run CUDA-bound training code (Megatron-core and similar) on a CPU-only torch.

``install()`` makes code written for GPUs execute unchanged on CPU tensors:

* **Device arguments.** A process-wide :class:`torch.overrides.TorchFunctionMode`
  (pushed once and kept on the main thread's mode stack) rewrites
  ``device="cuda"``, ``device="cuda:N"``, ``device=torch.device("cuda", N)``
  and integer ``device=N`` keyword arguments of every torch call to CPU, as well
  as the positional device of ``Tensor.to(...)``. ``pin_memory=True`` becomes
  ``False``. ``Tensor.cuda()`` and ``Tensor.pin_memory()`` return the tensor
  itself (so ``Module.cuda()`` is a no-op); ``Tensor.record_stream()``
  accepts the stand-in streams and does nothing.
* **Type strings.** ``Tensor.type()`` reports CPU tensors as
  ``torch.cuda.<T>Tensor`` (Megatron compares ``param.type()`` with
  ``'torch.cuda.FloatTensor'`` in its optimizers and grad clipping), and
  ``Tensor.type('torch.cuda.<T>Tensor')`` converts dtype on CPU.
  ``torch.cuda.<T>Tensor`` legacy constructors build CPU tensors and
  ``isinstance`` against them matches CPU tensors of that dtype.
  ``Tensor.is_cuda`` and ``Tensor.device`` are left truthful.
* **torch.cuda API.** ``current_device`` -> 0; ``set_device``,
  ``synchronize``, ``empty_cache``, ``ipc_collect``, ``init``, ``_lazy_init``
  -> no-ops; ``device_count`` -> ``LOCAL_WORLD_SIZE`` (at least 1), so
  recipes that guard CUDA seeding with ``device_count() > 0`` still seed;
  ``device``/``device_of`` -> no-op context managers; memory statistics -> 0
  (``mem_get_info`` reports host memory); ``get_device_properties`` /
  ``get_device_capability`` describe an sm_80-class device (bf16 capable, no
  Hopper-only paths); ``utilization``/``temperature``/``power_draw``/
  ``clock_rate`` -> 0; ``Stream``/``ExternalStream``/``Event``/``stream()``/
  ``current_stream``/``default_stream``/``set_stream`` -> host stubs (events
  record wall-clock time so ``elapsed_time`` works);
  ``is_current_stream_capturing`` -> False; ``nvtx`` -> no-ops.
* **RNG.** ``torch.cuda`` RNG functions (``get_rng_state``/``set_rng_state``
  (+``_all``), ``manual_seed``(+``_all``), ``seed``, ``initial_seed``) and
  ``torch.cuda.default_generators`` all act on ``torch.default_generator``,
  the generator CPU kernels actually draw from. Megatron's
  ``CudaRNGStatesTracker`` therefore forks real CPU RNG streams (TP-rank
  dependent weight init and dropout behave as on GPU). ``torch.cuda._lazy_call``
  runs its callback immediately, which Megatron's ``_set_cuda_rng_state`` relies
  on (the stock CPU build would queue it forever).
* **is_available() stays False** (truthful: it counts GPUs with torch's own
  ``device_count``). Scripts then choose the ``gloo`` backend and Megatron keeps
  its CPU-safe branches (straggler detector, TE float8 imports, activation
  offloading). It is replaced because on a CUDA build of torch with
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (importing DeepSpeed sets it) the stock
  ``is_available`` counts the stand-in ``device_count`` and answers True
  without a GPU.

Backward pass: a TorchFunctionMode is popped while its own handler runs.
``Tensor.backward``/``torch.autograd.backward``/``torch.autograd.grad`` are
themselves torch functions, so the autograd engine would be entered from inside
the handler and capture a mode stack without the mode; every custom
``autograd.Function.backward`` and hook would then escape it (Megatron's tensor
parallel mappings allocate ``device=cuda`` tensors in backward). Two hooks fix
this generally: ``torch.autograd.graph._engine_run_backward`` (the single
Python entry into the engine for ``backward``/``grad``) re-enters the mode
around the engine call, whose thread-local state the engine propagates to all
backward nodes and hooks; and ``BackwardCFunction.apply``/``apply_boxed`` (how
the engine calls any custom ``Function.backward``) re-enter the mode if it is
missing, which covers engine entries that bypass ``_engine_run_backward``.

Modules that did ``from torch.cuda import X`` before ``install()`` (e.g.
``megatron.core.tensor_parallel.random`` binds ``_lazy_call``/``device``) are
rebound: every non-torch module (and ``torch.cuda.*``) already in
``sys.modules`` whose globals hold a replaced object gets the replacement, so
``install()`` works before or after ``import megatron.core``.

The mode lives on the calling thread's stack; threads started afterwards that
run torch code would need ``install()``'s mode pushed themselves (Megatron's
training path is single-threaded). Thread counts are left untouched.

The parts: :mod:`integrations.cpu_compat_mode` (the TorchFunctionMode rewriting device
arguments), :mod:`integrations.cpu_compat_cuda` (the ``torch.cuda`` stand-ins); this module
applies them, keeps the mode on the stack through backward passes, and undoes it all.

Checked against torch 2.13 (CPU build) and megatron-core 0.16.1.
"""

from __future__ import annotations

import functools
import sys
import threading
import types

import torch

from integrations import cpu_compat_cuda, cpu_compat_mode
from integrations.cpu_compat_mode import TYPE_CLASS_TO_DTYPE, CudaAsCpuMode, mode_active

__all__ = ["install", "uninstall", "is_installed", "CudaAsCpuMode"]

_LOCK = threading.RLock()
_INSTALLED = False
_MODE: "CudaAsCpuMode | None" = None
_PATCHES: list = []  # (owner, name, had_attr, original) in application order
_REPLACED: dict = {}  # id(original) -> (original, replacement)


# --------------------------------------------------------------------------- patch bookkeeping


def _distinct(fn, name):
    # Every patched name gets its own function object: torch._dynamo's trace
    # rules map torch.cuda objects back to names and reject one object bound
    # under names with different rules.
    clone = types.FunctionType(
        fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__
    )
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__dict__.update(fn.__dict__)
    clone.__doc__ = fn.__doc__
    clone.__qualname__ = name
    return clone


def _patch(owner, name, value, distinct=True):
    if (
        distinct
        and isinstance(value, types.FunctionType)
        and not hasattr(value, "__cpu_compat_wrapped__")
    ):
        value = _distinct(value, name)
    namespace = vars(owner)
    had = name in namespace
    original = namespace.get(name)
    if had and original is value:
        return
    _PATCHES.append((owner, name, had, original))
    setattr(owner, name, value)
    if had and original is not None and not isinstance(original, (int, float, str, bool, tuple)):
        _REPLACED[id(original)] = (original, value)


def _patch_torch_cuda():
    for owner, name, value in cpu_compat_cuda.replacements():
        _patch(owner, name, value)
    for name, dtype, replacement in cpu_compat_cuda.legacy_tensor_types():
        stock = getattr(torch.cuda, name, None)
        if stock is not None:
            TYPE_CLASS_TO_DTYPE[stock] = dtype
        TYPE_CLASS_TO_DTYPE[replacement] = dtype
        _patch(torch.cuda, name, replacement)


def _patch_tensor_methods():
    # record_stream's argument parser rejects stand-in streams before any
    # torch-function dispatch, so it is overridden on the class instead.
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if cpu_compat_cuda.is_host_stream(stream):
            return None
        return original(self, stream)

    record_stream.__cpu_compat_wrapped__ = original
    _patch(torch.Tensor, "record_stream", record_stream)


def _ensure_mode(fn):
    """Wrap ``fn`` so it always runs with a CudaAsCpuMode on the stack."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _INSTALLED or mode_active():
            return fn(*args, **kwargs)
        with CudaAsCpuMode():
            return fn(*args, **kwargs)

    wrapper.__cpu_compat_wrapped__ = fn
    return wrapper


def _patch_autograd():
    import torch.autograd
    import torch.autograd.graph as graph
    from torch.autograd.function import BackwardCFunction

    engine_run = _ensure_mode(graph._engine_run_backward)
    _patch(graph, "_engine_run_backward", engine_run)
    _patch(torch.autograd, "_engine_run_backward", engine_run)
    for name in ("apply", "apply_boxed"):
        if name in BackwardCFunction.__dict__:
            _patch(BackwardCFunction, name, _ensure_mode(BackwardCFunction.__dict__[name]))


def _rebind_stale_references():
    """Point module globals bound to replaced objects at the replacements."""
    ours = (sys.modules.get(__name__), cpu_compat_mode, cpu_compat_cuda)
    for modname, module in list(sys.modules.items()):
        if module is None or any(module is m for m in ours):
            continue
        if modname.startswith("torch") and not modname.startswith("torch.cuda."):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            entry = _REPLACED.get(id(value))
            if entry is not None and entry[0] is value:
                _patch(module, attr, entry[1], distinct=False)


# --------------------------------------------------------------------------- public API


def is_installed() -> bool:
    return _INSTALLED


def install() -> None:
    """Install the CPU compatibility layer (idempotent)."""
    global _INSTALLED, _MODE
    with _LOCK:
        if _INSTALLED:
            if not mode_active():
                _MODE.__enter__()
            return
        _patch_torch_cuda()
        _patch_tensor_methods()
        _patch_autograd()
        _rebind_stale_references()
        _MODE = CudaAsCpuMode()
        _MODE.__enter__()
        _INSTALLED = True


def uninstall() -> None:
    """Undo :func:`install` (restores every patched attribute, pops the mode)."""
    global _INSTALLED, _MODE
    with _LOCK:
        if not _INSTALLED:
            return
        _INSTALLED = False
        n = torch._C._len_torch_function_stack()
        if _MODE is not None and n and torch._C._get_function_stack_at(n - 1) is _MODE:
            _MODE.__exit__(None, None, None)
        _MODE = None
        while _PATCHES:
            owner, name, had, original = _PATCHES.pop()
            if had:
                setattr(owner, name, original)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
        _REPLACED.clear()
        TYPE_CLASS_TO_DTYPE.clear()
