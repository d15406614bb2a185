"""A captured rank's connection to its coordinator: the handshake (within ``comm.timeout_s``),
sending (one message at a time, each one's tensors copied to host memory before the lock), the
reader thread that receives the answers — in any order — and enforces every op's deadline, the
coordinator's heartbeats, and the execution slot the rank waits for before it runs."""

from __future__ import annotations

import threading
import time

from nccl_ext.capture.pending_ops import PendingOps
from nccl_ext.capture.progress import RankProgress
from nccl_ext.core import handshake, protocol, wire
from nccl_ext.core.errors import WireDeadlineError
from nccl_ext.core.pending import CommDeadlineError
from nccl_ext.core.protocol import Alive, Free, Go


class CoordinatorLink:
    """Rank ``progress.rank``'s link to the coordinator at ``address``: fails the ``pending`` ops
    when the connection goes, marks ``progress`` closed and unparked as the coordinator says,
    counts its sending seconds in ``busy_s["send"]``."""

    def __init__(self, address: str, authkey: bytes, timeout_s: float, progress: RankProgress,
                 pending: PendingOps, busy_s: dict) -> None:
        self.timeout_s = timeout_s
        self._progress = progress
        self._pending = pending
        self.busy_s = busy_s
        self.alive = time.monotonic()
        """When the coordinator last said anything (its heartbeat while this rank is queued)."""
        self._conn = handshake.connect(address, authkey, progress.rank, timeout_s)
        self._send_lock = threading.Lock()
        self._go = threading.Semaphore(0)
        self.parked_s = 0.0
        """Time this rank waited for an execution slot."""
        self._handlers: dict = {}
        self._reader = threading.Thread(target=self._read_loop, name="prism-capture-reader", daemon=True)

    def start(self, handlers: dict) -> None:
        """Start receiving: ``handlers`` maps each reply past the slot's own (``go``, ``alive``,
        ``free``) to ``handler(message, tensors)``, called on the reader thread."""
        self._handlers = {**handlers, **self.own_handlers()}
        self._reader.start()

    def own_handlers(self) -> dict:
        return {Go: self._on_go, Alive: self._on_alive, Free: self._on_free}

    # -- the slot ---------------------------------------------------------------------------
    def await_slot(self, what: str) -> None:
        t0 = time.monotonic()
        while not self._go.acquire(timeout=0.5):
            if self._progress.closed.is_set():
                raise RuntimeError(f"{what}: the capture coordinator closed the connection")
            # the coordinator's heartbeat says this rank is still queued (ranks of payload=none run
            # one after another, so a rank may wait longer than one op's deadline for its turn)
            if time.monotonic() - max(t0, self.alive) > self.timeout_s:
                raise CommDeadlineError(
                    f"deadline exceeded: {what} ({self.timeout_s:g}s; the coordinator never resumed this rank; "
                    "raise comm.timeout_s= or capture.slots=)"
                )
        self.parked_s += time.monotonic() - t0

    def _on_go(self, m: Go, tensors) -> None:
        self._go.release()

    def _on_alive(self, m: Alive, tensors) -> None:
        pass

    def _on_free(self, m: Free, tensors) -> None:
        self._progress.unparked = True

    # -- sending ----------------------------------------------------------------------------
    def send(self, message: tuple, tensors=()) -> None:
        t0 = time.perf_counter()
        messages = wire.frames(protocol.encode(message), list(tensors))  # outside the lock: a GPU tensor's copy may wait
        with self._send_lock:
            wire.send_frames(self._conn, messages)
        self.busy_s["send"] += time.perf_counter() - t0

    # -- receiving --------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while not self._progress.closed.is_set():
            try:
                ready = self._conn.poll(0.1)
            except (OSError, EOFError):
                ready = False
                self._fail_all("the capture coordinator closed the connection")
                return
            if ready:
                try:
                    header, tensors = wire.recv(self._conn, self.timeout_s,
                                                f"the capture coordinator's message to rank {self._progress.rank}")
                except WireDeadlineError as e:
                    self._fail_all(str(e))
                    return
                except (OSError, EOFError):
                    self._fail_all("the capture coordinator closed the connection")
                    return
                message = protocol.decode(header)
                self.alive = time.monotonic()
                self._handlers[type(message)](message, tensors)
            self._pending.check_deadlines(time.monotonic())

    def _fail_all(self, why: str) -> None:
        self._progress.closed.set()
        self._pending.fail_all(why)

    def join_reader(self) -> None:
        """End the reader (it polls every 0.1 s once the rank is closed) — and so drop the
        tensors it last received — before Python finalizes (nccl_ext/core/threads.py)."""
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5.0)
