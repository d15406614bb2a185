"""Host stand-ins for the ``torch.cuda`` API, as :mod:`integrations.cpu_compat` installs them.

This module owns what ``torch.cuda`` becomes on a CPU-only torch: device management
(``is_available`` answered from torch's own device count, ``current_device`` 0,
``device_count`` = ``LOCAL_WORLD_SIZE``, no-op ``set_device`` /
``synchronize``, an sm_80-class ``get_device_properties``), zeroed memory statistics
(``mem_get_info`` reports host memory), RNG functions acting on ``torch.default_generator``,
synchronous ``Stream`` / ``Event`` stand-ins (events time with the wall clock), no-op NVTX,
and the legacy ``torch.cuda.<T>Tensor`` types (CPU constructors, dtype ``isinstance``).

It replaces nothing itself: :func:`replacements` and :func:`legacy_tensor_types` list what
to put where, and ``cpu_compat`` applies them (and undoes them in ``uninstall()``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import time

import torch

__all__ = ["replacements", "legacy_tensor_types", "is_host_stream"]

_CPU = torch.device("cpu")


def _device_count() -> int:
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        n = 1
    return max(1, n)


def _is_available(stock_device_count):
    """A stand-in ``torch.cuda.is_available`` that counts the GPUs with ``stock_device_count``
    (torch's own ``device_count``, taken before :func:`_device_count` replaces it).

    Torch's ``is_available`` looks ``device_count`` up in ``torch.cuda`` when
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (which importing DeepSpeed sets), so on a CUDA build of
    torch it would count the stand-in's ``LOCAL_WORLD_SIZE`` devices and report CUDA on a
    machine without a GPU; this one keeps the answer truthful whatever the variable says."""

    def is_available() -> bool:
        return stock_device_count() > 0

    return is_available


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


def _each(owner, table):
    for name, value in table.items():
        yield owner, name, value


def replacements():
    """``(owner, name, value)`` for every ``torch.cuda`` attribute the layer replaces, in the
    order they are applied (the legacy tensor types apart: :func:`legacy_tensor_types`)."""
    cuda = torch.cuda
    import torch.cuda.graphs as cuda_graphs
    import torch.cuda.memory as cuda_memory
    import torch.cuda.nvtx as cuda_nvtx
    import torch.cuda.random as cuda_random
    import torch.cuda.streams as cuda_streams

    # Device management.
    yield from _each(cuda, {
        "is_available": _is_available(cuda.device_count),
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
    })
    yield cuda_graphs, "is_current_stream_capturing", _false

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
        yield cuda, name, fn
        if hasattr(cuda_memory, name):
            yield cuda_memory, name, fn

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
        yield cuda, name, fn
        yield cuda_random, name, fn
    yield cuda, "default_generators", (torch.default_generator,) * max(8, _device_count())

    # Streams and events.
    yield from _each(cuda, {
        "Stream": _Stream,
        "ExternalStream": _ExternalStream,
        "Event": _Event,
        "StreamContext": _StreamContext,
        "stream": _stream,
        "current_stream": _current_stream,
        "default_stream": _current_stream,
        "set_stream": _noop,
        "get_stream_from_external": _get_stream_from_external,
    })
    yield from _each(cuda_streams, {"Stream": _Stream, "ExternalStream": _ExternalStream, "Event": _Event})

    # NVTX.
    yield from _each(cuda_nvtx, {
        "range_push": _range_push,
        "range_pop": _range_pop,
        "range_start": _range_start,
        "range_end": _noop,
        "mark": _noop,
        "range": _nvtx_range,
    })


def legacy_tensor_types():
    """``(name, dtype, replacement)`` for the legacy ``torch.cuda.<T>Tensor`` types."""
    for name, dtype in _LEGACY_NAMES.items():
        yield name, dtype, _make_legacy_type(name, dtype)


def is_host_stream(obj) -> bool:
    """Whether ``obj`` is one of this module's stream stand-ins."""
    return isinstance(obj, _Stream)
