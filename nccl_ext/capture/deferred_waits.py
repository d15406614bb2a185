"""Waits on the GPU for a captured rank's collectives and receives computed by the GPU exchange
(:mod:`nccl_ext.exchange.ipc`): as over NCCL, the program's ``wait()`` returns at once and its
stream waits for the op's flag (:mod:`nccl_ext.exchange.device_flags`), so a rank does not stop issuing
kernels at every tensor-parallel all-reduce until its peer has arrived.

Once the coordinator has said every captured rank keeps its slot (no parking: ``free``), a wait
on such an op that is not complete yet is deferred. Every such op's flag is written: by its
fold's stream after its results are in the program's tensors, or at once when it fails — the
program then hears of the failure at its next op. The ops' folds are queued on the fold stream in
the order the program issued them: a later op's fold waits for the program's stream to pass the
earlier op's flag, which that earlier op's fold writes (one stream, as NCCL's).
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from nccl_ext.exchange.device_flags import DeviceFlags, DeviceFlagsUnavailable, restore_context, self_test
from nccl_ext.capture.progress import RankProgress
from nccl_ext.core.protocol import Stalled
from nccl_ext.core.pending import LIMIT_KEY, CommDeadlineError, Pending

HELPER_PREFIX = "prism-"
"""The names of a captured rank's own threads begin so; every other thread is the program's."""

MAX_DEFERRED = 1024
"""Ops whose waits are deferred at once, at most (past it the program waits on the host)."""

DEFER_FROM_STEP = 2
"""No wait is deferred in the program's first two steps (``unit`` 0 and 1): they load and
compile its kernels (a JIT-compiled kernel's module load may synchronize the context, which a
stream waiting for a flag would stop for good; ``torch.compile`` may compile again at the
second call), make its cuBLAS handles, grow the exchange's arenas and open its peers' IPC
handles. Upstream Megatron's second iteration is still several times its steady one."""

STALL_S = 60.0
"""A deferred op whose flag is not written this long after its wait returned stops the waits on
the GPU (or at its own deadline, ``comm.timeout_s``, if sooner): its peers are running (no
rank is parked while waits are deferred), so so long a wait is a stop — a thread of this rank
held in the driver behind the wait — more likely than a slow peer."""

RESERVE_HEADROOM = 1 << 30
"""At the step boundary the host arena grows to twice its high water, by at most this much."""

WATCH_S = 0.5
"""How often the watchdog of deferred ops looks whether their flags were written."""

CLOSE_WAIT_S = 10.0
"""Once the rank closes, how long the flags still deferred may take to be written (their folds
were queued, or are about to be) before they fail by name and are written from the CPU — a
closed rank's stream must not wait on the GPU for good (``DeferredWaits.deferred_close_s``)."""

CLOSE_POLL_S = 0.02
"""How often the watchdog looks at the flags still deferred once the rank closes."""


class DeferredWaits:
    """The deferred waits of one captured rank: given where the rank stands (``progress``: its
    step, whether it keeps its slot, whether it closed), whether waits may go to the GPU at all
    (``enabled``: ``capture.gpu_waits``), and ``send`` to its coordinator (None: none)."""

    def __init__(self, progress: RankProgress, enabled: bool, send=None) -> None:
        self._progress = progress
        self.rank = progress.rank
        self._closed = progress.closed
        self._send = send
        self._defer_enabled = enabled
        self._flags: DeviceFlags | None = None
        self._fold_stream: torch.cuda.Stream | None = None
        self._order_lock = threading.Lock()
        self._open: set[int] = set()
        """GPU ops whose folds are not queued yet (nor failed, nor answered through the host)."""
        self._deferred: set[int] = set()
        """Open ops whose waits were deferred: the program's stream waits for their flags."""
        self._after: dict[int, frozenset[int]] = {}
        """op id -> the ops deferred when it was issued (its fold waits for their flags)."""
        self._ready: dict[int, object] = {}
        self._gated: set[int] = set()
        """Answered ops whose folds wait for their peers' stagings to run (:meth:`await_staging`)."""
        """op id -> the queuing of its fold, waiting for the folds of the ops in ``_after``."""
        self._draining = False
        self._deferred_error: BaseException | None = None
        self.deferred_waits = 0
        """Waits that returned at once, the program's stream waiting for the op on the GPU."""
        self._deferred_at: dict[int, float] = {}
        """Deferred op id -> when its wait returned."""
        self._watched: dict[int, Pending] = {}
        """Deferred ops whose flags the watchdog has not seen written yet."""
        self._watchdog: threading.Thread | None = None
        self._stall: BaseException | None = None
        self._host_results: torch.cuda.Stream | None = None

    def start_flags(self, device: torch.device, writer: torch.cuda.Stream) -> None:
        """The flags of this rank's GPU (before its first GPU op; ``writer``: the fold's stream),
        or none — said once — where the driver cannot wait on them (every wait then blocks the
        host, as before)."""
        restore_context()  # the context exists: child processes see the user's value again
        if not self._defer_enabled or self._flags is not None:
            return
        self._fold_stream = writer
        try:
            self._flags = self_test(device, writer)
            self._host_results = torch.cuda.Stream(device)
        except (DeviceFlagsUnavailable, RuntimeError) as e:
            self._defer_enabled = False
            print(f"prism-launch: rank {self.rank}: waits on the GPU are unavailable ({e}); each collective's "
                  "wait blocks the rank until its peers have arrived", file=sys.stderr, flush=True)

    @property
    def deferring(self) -> bool:
        """Whether waits may go to the GPU now (flags, and past the program's first steps): the
        orderings that only deferred waits need hold from then on; the first steps run as
        without waits on the GPU."""
        return self._flags is not None and self._progress.unit >= DEFER_FROM_STEP

    def may_lock_pages(self) -> bool:
        """Whether the calling thread may page-lock host memory for the GPU now: the program's
        threads always; this module's helper threads (named ``prism-…``) until waits go to the
        GPU — locking waits for the driver's context lock, which the program holds while it sits
        in a synchronous copy behind a deferred op whose fold a helper would queue."""
        return not self.deferring or not threading.current_thread().name.startswith(HELPER_PREFIX)

    def may_unlock_pages(self) -> bool:
        """Whether page-locked host memory may be unlocked now: until waits go to the GPU, by no
        thread after — ``cuMemHostUnregister`` waits for work on the GPU that a deferred wait
        holds (H200: upstream Megatron's dense capture stopped in it, on the program's own
        thread, its tensor-parallel peer waiting for the op it was about to stage)."""
        return not self.deferring

    def before_deferring(self, arena) -> None:
        """The program's thread, at the step boundary from which waits may be deferred: the
        host arena grows now, page-locked, to twice the most it held at once so far (by at most
        :data:`RESERVE_HEADROOM`; where there is no room, not at all), so that
        the steps after it neither register pages nor leave a drained generation locked."""
        if self._flags is not None and arena is not None and arena.pin and arena.high_water:
            want = min(2 * arena.high_water, arena.high_water + RESERVE_HEADROOM)
            try:
                arena.reserve(want)
            except OSError as e:  # no room: it grows as it needs, as before
                print(f"prism-launch: rank {self.rank}: could not grow the host arena ahead to "
                      f"{want / 2**20:.0f} MiB ({e}); it grows as it needs", file=sys.stderr, flush=True)

    def from_host(self, p: Pending, call) -> None:
        """Collective ``p`` (``call``) is answered through the host (the coordinator's): where
        waits go to the GPU its results are copied into the program's tensors on a stream of
        their own. The receiving thread's current stream is CUDA's legacy default one, which
        Megatron computes on: a copy there would wait behind the program's waits for deferred ops
        (a copy from host memory synchronizes), holding the thread that queues their folds. The
        program's stream is drained here first (a contribution's copy to the host drains it
        anyway), and its host blocks at the op's wait until the copy is done, so nothing of the
        program's races the copy."""
        if self._host_results is None or not self.deferring:
            return
        cuda = [t for t in (*(call.tensors or ()), *(call.outputs or ())) if t.is_cuda]
        if cuda:
            torch.cuda.current_stream(cuda[0].device).synchronize()
            p.apply_stream = self._host_results

    def gpu_op(self, op_id: int, p: Pending, deferrable: bool = True) -> None:
        """Op ``op_id`` (its issue event recorded) will be completed by the GPU exchange: its fold
        is queued after those of the ops deferred so far, and a wait on it may be deferred —
        not where it may be answered through the host instead (a receive whose sender may not
        stage on its GPU: the copy into the program's tensors would queue behind the wait)."""
        if self._flags is None:
            return
        with self._order_lock:
            self._open.add(op_id)
            if self._deferred:
                self._after[op_id] = frozenset(self._deferred)
        p.add_done_callback(lambda done: self._gpu_op_done(op_id, done))
        if deferrable:
            p.defer = lambda: self._defer(op_id, p)

    def await_staging(self, op_id: int) -> None:
        """Op ``op_id`` is answered; its fold waits for its peers' stagings to run on their GPUs."""
        with self._order_lock:
            self._gated.add(op_id)

    def in_order(self, op_id: int, queue_fold) -> None:
        """Queue op ``op_id``'s fold (``queue_fold()``, which writes its flag after its results)
        once the ops deferred before it was issued have queued theirs (reader thread)."""
        with self._order_lock:
            self._gated.discard(op_id)
            self._ready[op_id] = queue_fold
        self._run_ready()

    def _next_ready(self):
        for op_id in sorted(self._ready):
            if self._after.get(op_id, frozenset()).isdisjoint(self._deferred):
                return op_id
        return None

    def _run_ready(self) -> None:
        """Queue the folds whose deferred predecessors are queued, one thread at a time, in
        sequence (whichever thread finds the loop idle runs it; the others leave their work to
        it): an op leaves ``_deferred`` just before its fold and flag are queued, and nothing
        after it is queued before they are."""
        with self._order_lock:
            if self._draining:
                return
            self._draining = True
        try:
            while True:
                with self._order_lock:
                    op_id = self._next_ready()
                    if op_id is None:
                        self._draining = False
                        return
                    fn = self._ready.pop(op_id)
                    self._after.pop(op_id, None)
                    self._open.discard(op_id)
                    self._deferred.discard(op_id)
                fn()
        except BaseException:
            with self._order_lock:
                self._draining = False
            raise

    def _gpu_op_done(self, op_id: int, p: Pending) -> None:
        """A GPU op completed or failed. Answered through the host (not by its fold): its flag is
        written after its results' copy. Failed: its flag is written now (nothing on the GPU
        waits for it forever) and, if the program went on past its wait, its next op raises the
        error."""
        with self._order_lock:
            was_open = op_id in self._open
            deferred = op_id in self._deferred
            self._open.discard(op_id)
            self._deferred.discard(op_id)
            self._after.pop(op_id, None)
            self._ready.pop(op_id, None)
            self._gated.discard(op_id)
        flags = self._flags
        if p.error is None:
            if was_open:  # the copy into the program's tensors runs after this, on the current stream
                before = p.after_apply
                p.after_apply = lambda: (before() if before is not None else None,
                                         flags.signal_here(op_id))
        else:
            try:
                flags.release(op_id)
            except Exception as e:  # noqa: BLE001 - the op's own error is the one to report
                print(f"prism-launch: rank {self.rank}: could not release the GPU's wait for {p.what}: {e}",
                      file=sys.stderr, flush=True)
            if deferred and self._deferred_error is None:
                self._deferred_error = p.error
        if was_open:
            self._run_ready()

    def _defer(self, op_id: int, p: Pending) -> bool:
        """Make the program's current stream wait for op ``op_id`` on the GPU instead of blocking
        (False: wait on the host — parking may still stop this rank, the program's first steps,
        too many are deferred, or the op's fold is queued already)."""
        if not self._progress.unparked or self._progress.unit < DEFER_FROM_STEP or self._closed.is_set() or p.is_done:
            return False
        with self._order_lock:
            if op_id not in self._open or len(self._deferred) >= MAX_DEFERRED:
                return False
        program = self._flags.waiting_stream(self._fold_stream)
        if program is None:  # this stream's wait would hold the fold's queue
            return False
        with self._order_lock:
            if op_id not in self._open or self._stall is not None:
                return False
            self._deferred.add(op_id)
            self._watched[op_id] = p
            self._deferred_at[op_id] = time.monotonic()
        self._flags.wait(program, op_id)
        self.deferred_waits += 1
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="prism-deferred-watchdog", daemon=True)
            self._watchdog.start()
        return True

    def _watch(self) -> None:
        """Until the rank closes and no deferred flag is left unwritten: a deferred op whose flag
        is not written by its deadline (``comm.timeout_s``) stops the waits on the GPU
        (:meth:`_stalled`) — the program's stream would otherwise wait for it for good, and a
        host copy behind it with it. Once the rank closes, the flags still deferred have
        :data:`CLOSE_WAIT_S` more (their own deadlines still apply); those not written then fail
        by name (:meth:`_unwritten_at_close`)."""
        closed_at = None
        while True:
            if closed_at is None:
                if self._closed.wait(WATCH_S):
                    closed_at = time.monotonic()
            else:
                time.sleep(CLOSE_POLL_S)
            now = time.monotonic()
            with self._order_lock:
                watched = list(self._watched.items())
            for op_id, p in watched:
                if self._flags.written(op_id):
                    with self._order_lock:
                        self._watched.pop(op_id, None)
                        self._deferred_at.pop(op_id, None)
                elif now > min(p.deadline, self._deferred_at.get(op_id, now) + STALL_S):
                    self._stalled(op_id, p, now - self._deferred_at.get(op_id, now))
                    return
            if closed_at is not None:
                with self._order_lock:
                    left = dict(self._watched)
                if not left:
                    return
                if now > closed_at + self.deferred_close_s:
                    self._unwritten_at_close(left, now - closed_at)
                    return

    deferred_close_s: float = CLOSE_WAIT_S
    """How long the rank's close waits for the flags still deferred (see :data:`CLOSE_WAIT_S`)."""

    def close_deferred(self, timeout_s: float) -> list[str]:
        """At the rank's close (after its ``_closed`` is set): wait for the flags still deferred
        — at most ``timeout_s`` and :attr:`deferred_close_s` — and fail by name, their flags
        written from the CPU, those not written by then. Returns what each failed op was."""
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.join(max(0.0, min(timeout_s, self.deferred_close_s + 2 * CLOSE_POLL_S)))
        with self._order_lock:
            left = dict(self._watched)
        if left:
            self._unwritten_at_close(left, timeout_s)
        return [p.what for p in left.values()]

    def _unwritten_at_close(self, left: dict[int, Pending], waited_s: float) -> None:
        """The rank closed with the flags of ``left`` deferred and not written: each op fails
        with a deadline error naming it, and its flag is written from the CPU (nothing on the
        program's stream waits for it for good)."""
        with self._order_lock:
            for op_id in left:
                self._watched.pop(op_id, None)
                self._deferred_at.pop(op_id, None)
        names = ", ".join(p.what for p in list(left.values())[:8]) + (" ..." if len(left) > 8 else "")
        for op_id, p in sorted(left.items()):
            error = CommDeadlineError(
                f"deadline exceeded: {p.what}: the rank closed while its wait was passed on the GPU "
                f"(capture.gpu_waits=true) and its results were still not written {waited_s:.1f} s later; its "
                f"flag is written from the CPU so the program's stream goes on (ops left so: {names})")
            if self._deferred_error is None:
                self._deferred_error = error
            if not p.is_done:  # its failure writes its flag (_gpu_op_done)
                p.fail(error)
                continue
            try:  # answered, its fold's flag still unwritten: written here
                self._flags.release(op_id)
            except Exception as e:  # noqa: BLE001 - the deadline error is the one to report
                print(f"prism-launch: rank {self.rank}: could not release the GPU's wait for {p.what}: {e}",
                      file=sys.stderr, flush=True)
        print(f"prism-launch: rank {self.rank}: closed with {len(left)} op(s) deferred and not written: {names}",
              file=sys.stderr, flush=True)

    def _stalled(self, op_id: int, p: Pending, waited_s: float) -> None:
        """Op ``op_id``'s flag was not written by its deadline: the op fails with a deadline
        error that says where it stands, the launcher hears of it (``stalled``: it may capture
        again without waits on the GPU), every deferred flag is written from the CPU (the
        program's stream goes on), no wait is deferred from here on, and the program's next op
        raises the error."""
        with self._order_lock:
            queued = op_id not in self._open
            before = sorted(self._after.get(op_id, frozenset()) & self._deferred)
            gated = op_id in self._gated
            unanswered = sorted(o for o in self._open if o not in self._ready and o not in self._gated)
            watched = sorted(self._watched)
            self._watched.clear()
            self._deferred_at.clear()
        if queued:
            where = "its fold was queued on the GPU and has not run (it waits there for the program's stream to reach the op)"
        elif gated:
            where = "it was answered, and a peer's staging of its contribution has not run on that peer's GPU"
        elif before:
            where = f"its fold waits for the folds of ops {before}, deferred before it was issued"
        else:
            where = "its peers' contributions have not all been staged (the coordinator has not answered it)"
        error = CommDeadlineError(
            f"deadline exceeded: {p.what}: its wait was passed on the GPU (capture.gpu_waits=true) and its results "
            f"were not written within {waited_s:.0f} s of it: {where}. Ops of this rank not answered yet: "
            f"{unanswered[:16]}; deferred and not written: {watched[:16]}. Capture with capture.gpu_waits=false "
            f"(each wait then blocks on the host), or raise {LIMIT_KEY}= if the peers are only slow")
        self._stall = error
        if self._deferred_error is None:
            self._deferred_error = error
        print(f"prism-launch: rank {self.rank}: {error}", file=sys.stderr, flush=True)
        self._report_stall(str(error))
        p.fail(error)
        for o in watched:
            try:
                self._flags.release(o)
            except Exception as e:  # noqa: BLE001 - the deadline error is the one to report
                print(f"prism-launch: rank {self.rank}: could not release the GPU's wait for op {o}: {e}",
                      file=sys.stderr, flush=True)

    def _report_stall(self, what: str) -> None:
        """Tell the capture's coordinator (where there is one) that waits on the GPU stopped."""
        send = self._send
        if send is not None:
            try:
                send(Stalled(self.rank, what))
            except OSError:
                pass

    @property
    def deferred_error(self) -> BaseException | None:
        """The failure of an op whose wait the program passed on the GPU, not raised yet."""
        return self._deferred_error

    def deferred_failed(self, p: Pending, error: BaseException) -> None:
        """Writing a deferred op's results failed after its wait returned: the next op raises it."""
        if self._deferred_error is None:
            self._deferred_error = RuntimeError(f"{p.what}: {error}")

    def check_deferred(self) -> None:
        """Raise the failure of an op whose wait the program passed on the GPU."""
        e = self._deferred_error
        if e is not None:
            raise RuntimeError(f"rank {self.rank}: an earlier op failed after the program went on past its wait "
                               f"(its stream waited on the GPU, as over NCCL): {e}") from e

    def flag_writer(self, op_id: int):
        """What writes op ``op_id``'s flag on the fold's stream once its results are written."""
        flags = self._flags
        return None if flags is None else (lambda stream: flags.signal(stream, op_id))
