"""Flags a CUDA stream waits on, on the GPU: CUDA's stream memory operations (driver API
``cuStreamWaitValue32`` / ``cuStreamWriteValue32``), which torch does not expose.

A captured rank's collective whose result the GPU exchange computes can then be waited for as
NCCL's is: the program's stream waits for the op's flag and the program goes on issuing kernels;
the fold's stream writes the flag once the results are in the program's tensors
(:mod:`nccl_ext.deferred_waits`). The flags live in a small device buffer of the driver's own
(not the program's allocator: outside its memory figures); op ``i`` uses slot ``i % slots`` and
waits until it holds at least ``i + 1``.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

SLOTS = 4096
"""Flags per rank (ops deferred at once stay far below: :data:`~nccl_ext.deferred_waits.MAX_DEFERRED`)."""

SELF_TEST_S = 5.0
"""How long :func:`self_test` gives a waiting stream to go on once its flag is written."""

_WAIT_GEQ = 0x0
"""``CU_STREAM_WAIT_VALUE_GEQ``."""
_WRITE_DEFAULT = 0x0
"""``CU_STREAM_WRITE_VALUE_DEFAULT``."""

_lib = None
_lib_lock = threading.Lock()


class DeviceFlagsUnavailable(RuntimeError):
    """The driver cannot wait on flags here (no ``libcuda``, no stream memory operations)."""


def _driver():
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise DeviceFlagsUnavailable(f"no CUDA driver library: {e}") from None
            for name, args in (("cuStreamWaitValue32_v2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]),
                               ("cuStreamWriteValue32_v2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]),
                               ("cuMemAlloc_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
                               ("cuMemsetD32_v2", [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t]),
                               ("cuMemFree_v2", [ctypes.c_uint64])):
                fn = getattr(lib, name, None)
                if fn is None:
                    raise DeviceFlagsUnavailable(f"the CUDA driver has no {name}")
                fn.argtypes, fn.restype = args, ctypes.c_int
            _lib = lib
        return _lib


def _check(res: int, what: str) -> None:
    if res != 0:
        raise DeviceFlagsUnavailable(f"{what} failed (CUresult {res})")


class DeviceFlags:
    """One rank's flags on ``device`` (call on a thread whose current device is ``device``)."""

    def __init__(self, device: torch.device, slots: int = SLOTS):
        self.device = device
        self.slots = int(slots)
        self._lib = _driver()
        torch.cuda.set_device(device)  # the primary context current on this thread
        ptr = ctypes.c_uint64(0)
        _check(self._lib.cuMemAlloc_v2(ctypes.byref(ptr), 4 * self.slots), "cuMemAlloc")
        self._base = ptr.value
        _check(self._lib.cuMemsetD32_v2(self._base, 0, self.slots), "cuMemsetD32")
        torch.cuda.synchronize(device)
        self._rescue: torch.cuda.Stream | None = None

    def _addr(self, op_id: int) -> int:
        return self._base + 4 * (op_id % self.slots)

    def wait(self, stream: torch.cuda.Stream, op_id: int) -> None:
        """``stream`` waits (on the GPU) until op ``op_id``'s flag is written."""
        _check(self._lib.cuStreamWaitValue32_v2(stream.cuda_stream, self._addr(op_id), (op_id + 1) & 0xFFFFFFFF,
                                                _WAIT_GEQ), "cuStreamWaitValue32")

    def wait_here(self, op_id: int) -> None:
        """The calling thread's current stream (on this device) waits for op ``op_id``'s flag."""
        self.wait(torch.cuda.current_stream(self.device), op_id)

    def signal_here(self, op_id: int) -> None:
        """Write op ``op_id``'s flag on the calling thread's current stream (on this device)."""
        self.signal(torch.cuda.current_stream(self.device), op_id)

    def signal(self, stream: torch.cuda.Stream, op_id: int) -> None:
        """Write op ``op_id``'s flag on ``stream`` (after what is queued there)."""
        _check(self._lib.cuStreamWriteValue32_v2(stream.cuda_stream, self._addr(op_id), (op_id + 1) & 0xFFFFFFFF,
                                                 _WRITE_DEFAULT), "cuStreamWriteValue32")

    def release(self, op_id: int) -> None:
        """Write op ``op_id``'s flag at once (a stream of its own): the op failed, and whatever
        waits for it on the GPU must not wait forever (the program hears of the failure at its
        next op)."""
        if self._rescue is None:
            self._rescue = torch.cuda.Stream(self.device)
        self.signal(self._rescue, op_id)

    def reset(self) -> None:
        """Every flag unwritten again (nothing may wait on one)."""
        torch.cuda.synchronize(self.device)
        _check(self._lib.cuMemsetD32_v2(self._base, 0, self.slots), "cuMemsetD32")
        torch.cuda.synchronize(self.device)


def self_test(device: torch.device) -> DeviceFlags:
    """Flags on ``device`` that a wait and a write on two streams were seen to honour (raises
    :class:`DeviceFlagsUnavailable` where they were not)."""
    flags = DeviceFlags(device)
    waiter, writer = torch.cuda.Stream(device), torch.cuda.Stream(device)
    flags.wait(waiter, 0)
    done = torch.cuda.Event()
    done.record(waiter)
    if done.query():
        raise DeviceFlagsUnavailable("a stream waiting on an unwritten flag went on")
    flags.signal(writer, 0)
    deadline = time.monotonic() + SELF_TEST_S
    while not done.query():
        if time.monotonic() > deadline:
            raise DeviceFlagsUnavailable(f"a stream waiting on a written flag did not go on within {SELF_TEST_S:g} s")
        time.sleep(0.001)
    flags.reset()
    return flags
