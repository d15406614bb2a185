"""Recording off the coordinator's thread: the trace writer's per-tensor work (its content hash
over every byte, the spill files' writes) runs on a thread of its own, so the coordinator goes
on answering ranks while the last op's tensors are hashed and written. Both release the
interpreter for large buffers, so the two threads do overlap.

The tensors waiting are bounded (:data:`PENDING_BYTES`): past it :meth:`BackgroundSink.record_tensor`
waits for the writer, so the launcher's memory stays bounded however fast ranks produce. A
failure of the writer (a full disk: :class:`~prism_launch.trace.errors.TraceSpaceError`) is
raised on the coordinator's thread by the next record, or by :meth:`BackgroundSink.close`.

Both of the coordinator's waits for the writer — for room, and for the last tensors at close —
end when the writer has taken nothing for ``stall_s`` (the run's ``comm.timeout_s``): the
coordinator's thread is the one that answers every rank and watches their exits, so a writer
stalled for good (storage that stopped answering) must not hold it for good. The wait then
raises :class:`WriterStalledError` naming the tensor the writer is on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from prism_launch.errors import WriterStalledError
from prism_launch.trace.spill import content_address, storable

PENDING_BYTES = 256 << 20
"""Tensor bytes handed over but not yet taken by the writer, at most (one larger tensor may pass
alone)."""

ADDRESS_THREADS = 4
"""Threads taking the content addresses of the tensors handed over (a sha256 over every byte,
the writer's costliest pass: in parallel, ahead of the writer, which stores them in order)."""

ALONE_BYTES = 1 << 20
"""A tensor of at least this size is addressed on its own (in parallel with its neighbours)."""

STALL_S = 300.0
"""How long the writer may take nothing before a wait for it fails, where the capture passes no
``stall_s`` (``comm.timeout_s``'s default)."""


def _addressed(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, str]]:
    """Each tensor as stored and its content address; a tensor given more than once (the pieces of
    a folded all-gather's result: every stand-in's contribution again) is addressed once."""
    done: dict[int, tuple[torch.Tensor, str]] = {}
    out = []
    for tensor in tensors:
        entry = done.get(id(tensor))
        if entry is None:
            t = storable(tensor)
            entry = done[id(tensor)] = (t, content_address(t))
        out.append(entry)
    return out


def _chunks(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, split for the address threads: each large one alone (hashed in
    parallel with the others), runs of small ones together."""
    out: list[list[torch.Tensor]] = []
    run: list[torch.Tensor] = []
    for t in tensors:
        if t.numel() * t.element_size() >= ALONE_BYTES:
            if run:
                out.append(run)
                run = []
            out.append([t])
        else:
            run.append(t)
    if run:
        out.append(run)
    return out


def _distinct_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


class BackgroundSink:
    """Hands ``record_tensor(rank, key, tensor)`` and ``record_tensors(rank, keys, tensors)`` to
    ``writer`` on a worker thread, started on the first record (after the rank processes were
    forked: no thread exists at fork). One batch is one hand-over, whatever its length: the
    coordinator's thread does not pay per piece (each hand-over lets the other threads take the
    interpreter, and a 1,024-piece result would wait for them 1,024 times)."""

    def __init__(self, writer, pending_bytes: int = PENDING_BYTES, stall_s: float = STALL_S):
        self.writer = writer
        self.pending_bytes_max = int(pending_bytes)
        self.stall_s = float(stall_s)
        self._progress_at = time.monotonic()
        """When the writer last took or finished a hand-over (a wait for it counts from there)."""
        self._on: tuple[int, str, int] | None = None
        """(rank, first key, keys) of the hand-over the writer is on."""
        self._queue: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._closing = False
        self._discard = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._addressing: ThreadPoolExecutor | None = None
        self.busy_s = 0.0
        """The worker's seconds in the writer."""
        self.waited_s = 0.0
        """Seconds the coordinator waited for room (the writer's pace bounded the capture's)."""

    def record_tensor(self, rank: int, key: str, tensor: torch.Tensor) -> None:
        self.record_tensors(rank, [key], [tensor])

    def record_tensors(self, rank: int, keys: list[str], tensors: list[torch.Tensor]) -> None:
        """Store ``tensors[i]`` as ``keys[i]`` of ``rank``, in order, as one hand-over."""
        if len(keys) != len(tensors):
            raise ValueError(f"record_tensors: {len(keys)} keys for {len(tensors)} tensors")
        if not keys:
            return
        nbytes = _distinct_bytes(tensors)
        with self._cond:
            self._raise_error()
            if self._thread is None:
                self._addressing = ThreadPoolExecutor(ADDRESS_THREADS, thread_name_prefix="prism-trace-address")
                self._thread = threading.Thread(target=self._run, name="prism-trace-writer", daemon=True)
                self._thread.start()
            t0 = time.perf_counter()
            while self._pending and self._pending + nbytes > self.pending_bytes_max and self._error is None:
                self._check_stall("room for rank %d's %d tensor(s) (%s ...)" % (rank, len(keys), keys[0]))
                self._cond.wait(min(0.5, self.stall_s))
            self.waited_s += time.perf_counter() - t0
            self._raise_error()
            futures = [self._addressing.submit(_addressed, chunk) for chunk in _chunks(list(tensors))]
            self._queue.append((rank, list(keys), nbytes, futures))
            self._pending += nbytes
            self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _check_stall(self, waiting_for: str) -> None:
        """Raise :class:`WriterStalledError` where the writer took nothing for ``stall_s`` (the
        caller holds ``_cond``)."""
        idle = time.monotonic() - self._progress_at
        if idle <= self.stall_s:
            return
        on = "nothing (its thread ended)" if self._on is None else (
            f"rank {self._on[0]}'s tensor {self._on[1]!r}" + (f" and {self._on[2] - 1} more" if self._on[2] > 1 else ""))
        raise WriterStalledError(
            f"deadline exceeded: the capture's coordinator waited {idle:.0f} s for {waiting_for} while the trace "
            f"writer took nothing: it is on {on}, with {self._pending / 2**20:.1f} MiB handed over and not "
            f"written. The trace directory's storage stopped answering, or is that slow: check it (or put "
            f"trace.dir elsewhere), or raise comm.timeout_s= (now {self.stall_s:g})")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue or self._discard:
                    return
                rank, keys, nbytes, futures = self._queue.popleft()  # its bytes stay pending until written
                self._on, self._progress_at = (rank, keys[0], len(keys)), time.monotonic()
            t0 = time.perf_counter()
            try:
                addressed = [entry for f in futures for entry in f.result()]
                for key, (tensor, addr) in zip(keys, addressed, strict=True):
                    self.writer.record_tensor(rank, key, tensor, addr)
            except BaseException as e:  # noqa: BLE001 - raised on the coordinator's thread
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._pending = 0
                    self._cond.notify_all()
                return
            self.busy_s += time.perf_counter() - t0
            with self._cond:
                self._pending = max(0, self._pending - nbytes)
                self._on, self._progress_at = None, time.monotonic()
                self._cond.notify_all()

    def close(self, discard: bool = False) -> None:
        """Wait until the writer has every tensor (``discard``: drop those still waiting, the
        capture failed), end the worker; raises the writer's failure, if any (not when
        discarding), or :class:`WriterStalledError` where the writer took nothing for
        ``stall_s`` (when discarding too: the worker, a daemon, is then left to its write)."""
        with self._cond:
            self._closing = True
            self._discard = discard
            if discard:
                self._queue.clear()
                self._pending = 0
            self._progress_at = max(self._progress_at, time.monotonic()) if self._on is None else self._progress_at
            self._cond.notify_all()
        stalled = None
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(min(0.5, self.stall_s))
                with self._cond:
                    try:
                        if self._thread.is_alive():
                            self._check_stall("the last tensors to be written" if not discard else
                                              "the writer to end (the capture failed)")
                    except WriterStalledError as e:
                        stalled = e
                        break
        if self._addressing is not None:  # its hashes are in memory: they end (and were taken, unless stalled)
            self._addressing.shutdown(wait=stalled is None, cancel_futures=True)
        if stalled is not None:
            raise stalled
        if not discard:
            self._raise_error()


class MemorySink:
    """Keeps recorded tensors in memory (``tensors[rank][key]``): for tests and tools that want
    them at hand; a capture gives the coordinator the trace writer instead."""

    def __init__(self) -> None:
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}

    def record_tensor(self, rank: int, key: str, tensor: torch.Tensor) -> None:
        self.tensors.setdefault(rank, {})[key] = tensor

    def record_tensors(self, rank: int, keys: list[str], tensors: list[torch.Tensor]) -> None:
        self.tensors.setdefault(rank, {}).update(zip(keys, tensors, strict=True))
