"""Flags a CUDA stream waits on, on the GPU: CUDA's stream memory operations (driver API
``cuStreamWaitValue32`` / ``cuStreamWriteValue32``), which torch does not expose.

A captured rank's collective whose result the GPU exchange computes can then be waited for as
NCCL's is: the program's stream waits for the op's flag and the program goes on issuing kernels;
the fold's stream writes the flag once the results are in the program's tensors
(:mod:`nccl_ext.capture.deferred_waits`). The flags live in page-locked host memory mapped for the device
(``cuMemHostAlloc``, outside the program's allocator and its memory figures), so the CPU can
write one at once: a failed op's flag, or a self-test's that the GPU did not honour. Op ``i``
uses slot ``i % slots`` and waits until it holds at least ``i + 1``.

A stream waiting on a flag holds the hardware work queue it is on: whatever is queued behind it
there waits too. With ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's setting) every stream of a
process shares one queue, and the fold that writes the flag would wait behind the wait itself.
:func:`prepare_context` gives a captured rank's CUDA context more queues as the driver reads
the variable at start-up (``os.environ`` keeps the user's value); :func:`self_test` checks the
very pair of streams — the program's and the fold's — before any wait is deferred on them.

Kernels loaded lazily (CUDA's default, ``CUDA_MODULE_LOADING=LAZY``) are loaded at their first
launch, and loading synchronizes the context: a program that launches a kernel for the first time
while its stream waits for a flag stops there for good — the flag's write is queued by this
process, after the launch returns (measured on the H200: every such case hung, the self-test
passed). :func:`prepare_context` makes the driver load every kernel with the context instead.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from nccl_ext.core.errors import DeviceFlagsUnavailable

SLOTS = 4096
"""Flags per rank (ops deferred at once stay far below: :data:`~nccl_ext.capture.deferred_waits.MAX_DEFERRED`)."""

SELF_TEST_S = 2.0
"""How long :func:`self_test` gives a waiting stream to go on once its flag is written."""

CONNECTIONS = 32
"""Hardware work queues a captured rank's CUDA context gets (:func:`prepare_context`; the
driver's most)."""

CONTEXT_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": str(CONNECTIONS), "CUDA_MODULE_LOADING": "EAGER"}
"""What the driver reads for a captured rank's context when waits go to the GPU: more hardware
queues than Megatron's one (a stream's wait holds its queue), and every kernel loaded when the
context is made — a kernel loaded lazily, at its first launch, synchronizes the context, which
never finishes while a stream waits for a flag that only this process writes later."""

_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
_WAIT_GEQ = 0x0
"""``CU_STREAM_WAIT_VALUE_GEQ``."""
_WRITE_DEFAULT = 0x0
"""``CU_STREAM_WRITE_VALUE_DEFAULT``."""
_HOSTALLOC = 0x1 | 0x2
"""``CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP``."""

_lib = None
_lib_lock = threading.Lock()
_user_env: dict[str, bytes | None] = {}
_prepared = False


def prepare_context() -> None:
    """Before this process's CUDA context exists: the driver reads :data:`CONTEXT_ENV` instead of
    the user's values; the program's ``os.environ`` keeps the user's (Megatron checks
    ``CUDA_DEVICE_MAX_CONNECTIONS``), and :func:`restore_context` puts the process environment
    back once the context is made (for the program's child processes)."""
    global _user_env, _prepared
    import os

    libc = ctypes.CDLL(None)
    _user_env = {k: os.environb.get(k.encode()) for k in CONTEXT_ENV}
    for k, v in CONTEXT_ENV.items():
        libc.setenv(k.encode(), v.encode(), 1)
    _prepared = True


def restore_context() -> None:
    """The process environment's :data:`CONTEXT_ENV` variables as the user set them again."""
    global _prepared
    if not _prepared:
        return
    libc = ctypes.CDLL(None)
    for k, v in _user_env.items():
        if v is None:
            libc.unsetenv(k.encode())
        else:
            libc.setenv(k.encode(), v, 1)
    _prepared = False


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
                               ("cuMemHostAlloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]),
                               ("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]),
                               ("cuMemFreeHost", [ctypes.c_void_p])):
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
    """One rank's flags for ``device`` (call on a thread whose current device is ``device``)."""

    def __init__(self, device: torch.device, slots: int = SLOTS):
        self.device = device
        self.slots = int(slots)
        self._lib = _driver()
        torch.cuda.set_device(device)  # the primary context current on this thread
        host = ctypes.c_void_p(0)
        _check(self._lib.cuMemHostAlloc(ctypes.byref(host), 4 * (self.slots + 1), _HOSTALLOC), "cuMemHostAlloc")
        self._host = (ctypes.c_uint32 * (self.slots + 1)).from_address(host.value)
        ctypes.memset(host.value, 0, 4 * (self.slots + 1))
        dev = ctypes.c_uint64(0)
        _check(self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0), "cuMemHostGetDevicePointer")
        self._base = dev.value
        self._test_value = 0
        self._tested: dict[int, bool] = {}
        """program stream handle -> whether a wait on it was seen to go on once the fold's
        stream wrote the flag"""

    def _addr(self, op_id: int) -> int:
        return self._base + 4 * (op_id % self.slots)

    def wait(self, stream: torch.cuda.Stream, op_id: int) -> None:
        """``stream`` waits (on the GPU) until op ``op_id``'s flag is written."""
        _check(self._lib.cuStreamWaitValue32_v2(stream.cuda_stream, self._addr(op_id), (op_id + 1) & 0xFFFFFFFF,
                                                _WAIT_GEQ), "cuStreamWaitValue32")

    def signal_here(self, op_id: int) -> None:
        """Write op ``op_id``'s flag on the calling thread's current stream (on this device)."""
        self.signal(torch.cuda.current_stream(self.device), op_id)

    def signal(self, stream: torch.cuda.Stream, op_id: int) -> None:
        """Write op ``op_id``'s flag on ``stream`` (after what is queued there)."""
        _check(self._lib.cuStreamWriteValue32_v2(stream.cuda_stream, self._addr(op_id), (op_id + 1) & 0xFFFFFFFF,
                                                 _WRITE_DEFAULT), "cuStreamWriteValue32")

    def written(self, op_id: int) -> bool:
        """Whether op ``op_id``'s flag holds its value (read from the CPU)."""
        return self._host[op_id % self.slots] >= ((op_id + 1) & 0xFFFFFFFF)

    def release(self, op_id: int) -> None:
        """Write op ``op_id``'s flag at once, from the CPU: the op failed, and whatever waits for
        it on the GPU must not wait forever (the program hears of the failure at its next op)."""
        slot = op_id % self.slots
        self._host[slot] = max(self._host[slot], (op_id + 1) & 0xFFFFFFFF)

    def waiting_stream(self, writer: torch.cuda.Stream | None):
        """The calling thread's current stream, where a wait on it goes on once ``writer``
        writes (None: it would not, :meth:`usable`)."""
        stream = torch.cuda.current_stream(self.device)
        return stream if writer is None or self.usable(stream, writer) else None

    def usable(self, waiter: torch.cuda.Stream, writer: torch.cuda.Stream) -> bool:
        """Whether a wait on ``waiter`` goes on once ``writer`` writes its flag (tested once per
        waiting stream, on the spare slot past the ops'): false where both share the hardware
        queue the wait holds — the wait is then released from the CPU and that stream's waits
        stay on the host."""
        key = waiter.cuda_stream
        known = self._tested.get(key)
        if known is not None:
            return known
        self._test_value += 1
        value, addr = self._test_value, self._base + 4 * self.slots
        _check(self._lib.cuStreamWaitValue32_v2(waiter.cuda_stream, addr, value, _WAIT_GEQ), "cuStreamWaitValue32")
        done = torch.cuda.Event()
        done.record(waiter)
        _check(self._lib.cuStreamWriteValue32_v2(writer.cuda_stream, addr, value, _WRITE_DEFAULT), "cuStreamWriteValue32")
        deadline = time.monotonic() + SELF_TEST_S
        ok = True
        while not done.query():
            if time.monotonic() > deadline:
                ok = False
                self._host[self.slots] = value  # the waiting stream goes on
                break
            time.sleep(0.0005)
        if not ok:
            done.synchronize()
        self._tested[key] = ok
        return ok


def self_test(device: torch.device, writer: torch.cuda.Stream) -> DeviceFlags:
    """Flags on ``device`` that a wait on a stream of its own and a write on ``writer`` were seen
    to honour (raises :class:`DeviceFlagsUnavailable` where they were not)."""
    flags = DeviceFlags(device)
    if not flags.usable(torch.cuda.Stream(device), writer):
        raise DeviceFlagsUnavailable(f"a stream waiting on a flag written by another stream did not go on within "
                                     f"{SELF_TEST_S:g} s ({_VAR} as the driver read it: a stream's wait may hold "
                                     "the only hardware queue)")
    return flags
