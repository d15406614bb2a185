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
* **is_available() stays False.** Scripts then choose the ``gloo`` backend and
  Megatron keeps its CPU-safe branches (straggler detector, TE float8 imports,
  activation offloading).

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

Checked against torch 2.13 (CPU build) and megatron-core 0.16.1.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
import time
import types

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "uninstall", "is_installed", "CudaAsCpuMode"]

_CPU = torch.device("cpu")
_LOCK = threading.RLock()
_INSTALLED = False
_MODE: "CudaAsCpuMode | None" = None
_PATCHES: list = []  # (owner, name, had_attr, original) in application order
_REPLACED: dict = {}  # id(original) -> (original, replacement)


# --------------------------------------------------------------------------- mode


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return isinstance(dev, int) and not isinstance(dev, bool)


_LEGACY_NAMES = {
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "CharTensor": torch.int8,
    "ShortTensor": torch.int16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
    "BoolTensor": torch.bool,
}
# Legacy tensor-type classes (stock torch.cuda.* and our replacements) -> dtype.
_TYPE_CLASS_TO_DTYPE: dict = {}


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
    elif isinstance(dtype, type) and dtype in _TYPE_CLASS_TO_DTYPE:
        dtype = _TYPE_CLASS_TO_DTYPE[dtype]
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
    """Rewrites CUDA device arguments of torch calls to CPU (see module doc)."""

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


def _mode_active() -> bool:
    n = torch._C._len_torch_function_stack()
    for i in range(n):
        if isinstance(torch._C._get_function_stack_at(i), CudaAsCpuMode):
            return True
    return False


def _ensure_mode(fn):
    """Wrap ``fn`` so it always runs with a CudaAsCpuMode on the stack."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _INSTALLED or _mode_active():
            return fn(*args, **kwargs)
        with CudaAsCpuMode():
            return fn(*args, **kwargs)

    wrapper.__cpu_compat_wrapped__ = fn
    return wrapper


# --------------------------------------------------------------------------- torch.cuda stand-ins


def _device_count() -> int:
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        n = 1
    return max(1, n)


def _current_device() -> int:
    return 0


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def _false(*args, **kwargs):
    return False


def _host_memory():
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = free = 0
    return free, total


def _mem_get_info(device=None):
    return _host_memory()


def _memory_stats(device=None):
    return collections.defaultdict(int)


def _memory_summary(device=None, abbreviated=False):
    return ""


def _memory_snapshot(*args, **kwargs):
    return []


class _DeviceProperties:
    def __init__(self):
        self.name = "cpu"
        self.major = 8
        self.minor = 0
        self.total_memory = _host_memory()[1]
        self.multi_processor_count = os.cpu_count() or 1
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.max_threads_per_multi_processor = 2048
        self.warp_size = 32
        self.L2_cache_size = 0
        self.regs_per_multiprocessor = 65536
        self.gcnArchName = ""
        self.uuid = "00000000-0000-0000-0000-000000000000"
        self.pci_bus_id = 0
        self.pci_device_id = 0
        self.pci_domain_id = 0

    def __repr__(self):
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
            f"minor={self.minor}, total_memory={self.total_memory // (1024 * 1024)}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


def _get_device_properties(device=None):
    return _DeviceProperties()


def _get_device_capability(device=None):
    return (8, 0)


def _get_device_name(device=None):
    return "cpu"


def _true(*args, **kwargs):
    return True


# RNG: everything aliases the CPU default generator.


def _get_rng_state(device="cuda"):
    return torch.default_generator.get_state()


def _get_rng_state_all():
    return [torch.default_generator.get_state() for _ in range(_device_count())]


def _set_rng_state(new_state, device="cuda"):
    torch.default_generator.set_state(new_state)


def _set_rng_state_all(new_states):
    for state in new_states:
        torch.default_generator.set_state(state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _seed():
    torch.default_generator.seed()


def _initial_seed():
    return torch.default_generator.initial_seed()


def _lazy_call(callable, **kwargs):
    callable()


class _DeviceContext:
    """No-op replacement for ``torch.cuda.device`` / ``device_of``."""

    def __init__(self, device=None):
        self.idx = 0
        self.prev_idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    """Host stand-in for ``torch.cuda.Event``; timestamps at ``record``."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event):
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0

    def ipc_handle(self):
        raise RuntimeError("IPC event handles are not available on CPU")

    @property
    def cuda_event(self):
        return 0

    def __repr__(self):
        return "<torch.cuda.Event (cpu stand-in)>"


class _Stream:
    """Host stand-in for ``torch.cuda.Stream``: everything is synchronous."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = _CPU
        self.device_index = 0
        self.device_type = 0
        self.priority = priority
        self.stream_id = 0
        self.cuda_stream = 0

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        if event is None:
            event = _Event()
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        pass

    @property
    def _as_parameter_(self):
        return 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return "<torch.cuda.Stream (cpu stand-in)>"


class _ExternalStream(_Stream):
    def __init__(self, stream_ptr=0, device=None, **kwargs):
        super().__init__(device=device)
        self.cuda_stream = stream_ptr


_DEFAULT_STREAM = _Stream()


def _current_stream(device=None):
    return _DEFAULT_STREAM


class _StreamContext:
    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def _stream(stream=None):
    return _StreamContext(stream)


def _get_stream_from_external(data_ptr, device=None):
    return _ExternalStream(data_ptr, device)


# nvtx
def _range_push(msg):
    return 0


def _range_pop():
    return 0


def _range_start(msg):
    return 0


@contextlib.contextmanager
def _nvtx_range(msg, *args, **kwargs):
    yield


class _LegacyCudaTensorMeta(type):
    def __instancecheck__(cls, obj):
        return (
            isinstance(obj, torch.Tensor)
            and obj.layout == torch.strided
            and obj.dtype == cls.dtype
        )

    def __call__(cls, *args, **kwargs):
        return cls.cpu_type(*args, **kwargs)


def _make_legacy_type(name, dtype):
    cpu_type = getattr(torch, name)
    return _LegacyCudaTensorMeta(
        name,
        (),
        {"dtype": dtype, "cpu_type": cpu_type, "is_cuda": True, "__module__": "torch.cuda"},
    )


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
    cuda = torch.cuda
    import torch.cuda.graphs as cuda_graphs
    import torch.cuda.memory as cuda_memory
    import torch.cuda.nvtx as cuda_nvtx
    import torch.cuda.random as cuda_random
    import torch.cuda.streams as cuda_streams

    # Device management.
    for name, fn in {
        "current_device": _current_device,
        "device_count": _device_count,
        "set_device": _noop,
        "synchronize": _noop,
        "ipc_collect": _noop,
        "init": _noop,
        "_lazy_init": _noop,
        "_lazy_call": _lazy_call,
        "device": _DeviceContext,
        "device_of": _DeviceContext,
        "get_device_properties": _get_device_properties,
        "get_device_capability": _get_device_capability,
        "get_device_name": _get_device_name,
        "is_bf16_supported": _true,
        "utilization": _zero,
        "temperature": _zero,
        "power_draw": _zero,
        "clock_rate": _zero,
        "memory_usage": _zero,
        "device_memory_used": _zero,
        "set_sync_debug_mode": _noop,
        "get_sync_debug_mode": _zero,
        "is_current_stream_capturing": _false,
    }.items():
        _patch(cuda, name, fn)
    _patch(cuda_graphs, "is_current_stream_capturing", _false)

    # Memory.
    memory_fns = {
        "empty_cache": _noop,
        "memory_allocated": _zero,
        "max_memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_reserved": _zero,
        "memory_cached": _zero,
        "max_memory_cached": _zero,
        "reset_peak_memory_stats": _noop,
        "reset_max_memory_allocated": _noop,
        "reset_max_memory_cached": _noop,
        "reset_accumulated_memory_stats": _noop,
        "set_per_process_memory_fraction": _noop,
        "memory_stats": _memory_stats,
        "memory_stats_as_nested_dict": _memory_stats,
        "memory_summary": _memory_summary,
        "memory_snapshot": _memory_snapshot,
        "list_gpu_processes": _memory_summary,
        "mem_get_info": _mem_get_info,
        "_record_memory_history": _noop,
    }
    for name, fn in memory_fns.items():
        _patch(cuda, name, fn)
        if hasattr(cuda_memory, name):
            _patch(cuda_memory, name, fn)

    # RNG.
    rng_fns = {
        "get_rng_state": _get_rng_state,
        "get_rng_state_all": _get_rng_state_all,
        "set_rng_state": _set_rng_state,
        "set_rng_state_all": _set_rng_state_all,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed,
        "seed": _seed,
        "seed_all": _seed,
        "initial_seed": _initial_seed,
    }
    for name, fn in rng_fns.items():
        _patch(cuda, name, fn)
        _patch(cuda_random, name, fn)
    _patch(cuda, "default_generators", (torch.default_generator,) * max(8, _device_count()))

    # Streams and events.
    for name, value in {
        "Stream": _Stream,
        "ExternalStream": _ExternalStream,
        "Event": _Event,
        "StreamContext": _StreamContext,
        "stream": _stream,
        "current_stream": _current_stream,
        "default_stream": _current_stream,
        "set_stream": _noop,
        "get_stream_from_external": _get_stream_from_external,
    }.items():
        _patch(cuda, name, value)
    for name, value in {"Stream": _Stream, "ExternalStream": _ExternalStream, "Event": _Event}.items():
        _patch(cuda_streams, name, value)

    # NVTX.
    for name, fn in {
        "range_push": _range_push,
        "range_pop": _range_pop,
        "range_start": _range_start,
        "range_end": _noop,
        "mark": _noop,
        "range": _nvtx_range,
    }.items():
        _patch(cuda_nvtx, name, fn)

    # Legacy tensor types.
    for name, dtype in _LEGACY_NAMES.items():
        stock = getattr(cuda, name, None)
        replacement = _make_legacy_type(name, dtype)
        if stock is not None:
            _TYPE_CLASS_TO_DTYPE[stock] = dtype
        _TYPE_CLASS_TO_DTYPE[replacement] = dtype
        _patch(cuda, name, replacement)


def _patch_tensor_methods():
    # record_stream's argument parser rejects stand-in streams before any
    # torch-function dispatch, so it is overridden on the class instead.
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, _Stream):
            return None
        return original(self, stream)

    record_stream.__cpu_compat_wrapped__ = original
    _patch(torch.Tensor, "record_stream", record_stream)


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
    this = sys.modules.get(__name__)
    for modname, module in list(sys.modules.items()):
        if module is None or module is this:
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
            if not _mode_active():
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
        _TYPE_CLASS_TO_DTYPE.clear()
