"""What a capture's trace keeps of the tensors ranks exchange — digests, a sandbox rank's
statistics, copies of the tensors it stores — taken after the coordinator has answered the ranks:
staged contributions and sends are noted at the end of the pump (:meth:`TraceNotes.drain`), and
the digests, statistics and copies of staged tensors run on worker threads (each releases the
GIL). A region of a rank's arena is freed only once the work that reads it is done."""

from __future__ import annotations

import json
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from nccl_ext.core import wire
from nccl_ext.replay.divergence import piece_stats
from nccl_ext.exchange.arena import detached
from prism_launch.capture.piece_refs import materialized


SUMMARY_THREADS = 4
"""Worker threads taking digests, statistics and copies (:meth:`TraceNotes.summarize`, :meth:`TraceNotes.record`)."""


def _summary(tensors: list[torch.Tensor], stats: bool) -> tuple[list[str], list | None, float]:
    t0 = time.perf_counter()
    tensors = materialized(tensors)
    digests = [wire.digest(t) for t in tensors]
    return digests, [piece_stats(t) for t in tensors] if stats else None, time.perf_counter() - t0


def copies(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """Detached copies of ``tensors`` (staged pieces, whose regions are freed after the op), and the seconds taken."""
    t0 = time.perf_counter()
    return [detached(t) for t in materialized(tensors)], time.perf_counter() - t0


class TraceNotes:
    """The coordinator's notes of the tensors ranks exchange: ``scope`` (the sandbox ranks, None:
    every rank), the ``sink`` that stores tensors, the coordinator's ``busy_s`` (``digest``,
    ``copy``, ``record`` seconds) and ``count(nbytes)``, which counts stored bytes against the
    payload budget."""

    def __init__(self, scope: frozenset[int] | None, sink, busy_s: dict, count) -> None:
        self.scope = scope
        self.sink = sink
        self.busy_s = busy_s
        self._count = count
        self._deferred: deque = deque()
        """Work left for after the replies of this pump (:meth:`drain`)."""
        self._summaries: deque = deque()
        """(future, what to do with its result here) of work on the worker threads — digests
        (:meth:`summarize`), copies of staged tensors (:meth:`record`) — in issue order."""
        self._pool: ThreadPoolExecutor | None = None
        self._submitted = 0
        self._taken = 0
        self._after: deque = deque()
        """(summaries submitted so far, what to do once they are taken in): frees of regions that
        the work submitted before them reads (:meth:`after_notes`)."""

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def note_contribution(self, rank: int, row: dict, extra: dict, contribution, keep: bool, tkey: str,
                           staged: bool) -> None:
        """A contribution's digest, statistics (a sandbox rank's, what its divergence checks read)
        and, when the trace keeps it, a copy of its data."""
        self.summarize(rank, row, extra, contribution or (),
                        stats=contribution is not None and not keep and rank in (self.scope or ()))
        if keep:
            # a staged piece is the member's until every member has read it: the trace keeps a copy
            self.record(rank, [f"{tkey}/{i}" for i in range(len(contribution))], contribution, staged)

    def record(self, rank: int, keys: list[str], tensors: list, staged: bool) -> None:
        """Store ``tensors`` under ``keys``: staged ones (in a rank's arena until it frees the
        region) through a copy made on a worker thread, before the region is freed."""
        if not staged:
            t0 = time.perf_counter()
            self.sink.record_tensors(rank, keys, list(tensors))
            self.busy_s["record"] += time.perf_counter() - t0
            self._count(sum(t.numel() * t.element_size() for t in tensors))
            return

        def store(copies: tuple[list, float]) -> None:
            self.busy_s["copy"] += copies[1]
            self.record(rank, keys, copies[0], staged=False)

        self.submit(copies, store, list(tensors))

    def submit(self, fn, then, *args) -> None:
        """Run ``fn(*args)`` on a worker thread; ``then(result)`` here, at a :meth:`drain`, in order."""
        self._summaries.append((self._workers().submit(fn, *args), then))
        self._submitted += 1

    def after_notes(self, fn) -> None:
        """Call ``fn`` once the work noted so far — deferred notes included — is done (the notes
        of staged data read it where it lies): at a later :meth:`drain`, without waiting for it."""
        self._deferred.append((self._queue_after, (fn,)))

    def defer(self, fn, args: tuple) -> None:
        """Call ``fn(*args)`` at the next :meth:`drain` (after the replies of this pump)."""
        self._deferred.append((fn, args))

    def _queue_after(self, fn) -> None:
        self._after.append((self._submitted, fn))

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=SUMMARY_THREADS, thread_name_prefix="prism-capture-digest")
        return self._pool

    def drain(self, wait: bool = False) -> None:
        """Do the work left for after the replies (:meth:`note_contribution` of staged
        contributions, digests of sends) and take in the summaries that are done — all of them
        with ``wait``: before a region is freed and before the events are written."""
        while self._deferred:
            fn, args = self._deferred.popleft()
            fn(*args)
        while self._summaries and (wait or self._summaries[0][0].done()):
            fut, then = self._summaries.popleft()
            self._taken += 1
            then(fut.result())
        while self._after and self._after[0][0] <= self._taken:
            self._after.popleft()[1]()

    def summarize(self, rank: int, row: dict, extra: dict, tensors, *, stats: bool) -> None:
        """Set ``row``'s extra once the digests of ``rank``'s contribution or send (and with
        ``stats`` their :func:`piece_stats`) are taken, on a worker thread: the divergence checks
        of a sandbox rank read them, and in a sandbox-scoped trace only sandbox ranks replay (a
        digest of every other rank's data would cost a pass over every byte the capture moves).
        Both release the GIL, so the coordinator goes on answering meanwhile."""
        if not tensors or (self.scope is not None and rank not in self.scope):
            row["extra"] = json.dumps(extra)
            return

        def fill(summary: tuple[list[str], list | None, float]) -> None:
            extra["digests"] = summary[0]
            if summary[1] is not None:
                extra["stats"] = summary[1]
            row["extra"] = json.dumps(extra)
            self.busy_s["digest"] += summary[2]

        self.submit(_summary, fill, list(tensors), stats)

    def note_send(self, src: int, row: dict, extra: dict, tensor, tkey: str | None, staged: bool) -> None:
        self.summarize(src, row, extra, (tensor,), stats=tkey is None and src in (self.scope or ()))
        if tkey is not None:
            self.record(src, [tkey], [tensor], staged)
