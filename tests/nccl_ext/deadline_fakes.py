"""Small fakes for the deadline tests: an in-memory recording of a tiny trace, and a physical
peer process (the assistant, or a pruned ring's edge host) that joins the gloo group and then
misbehaves — never sends (``stall``) or dies (``die``: at once; ``die-later``: after 1.5 s)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time

import torch
import torch.distributed as dist

from nccl_ext.core import wire
from nccl_ext.replay.recording import RecordedOp

ELEMS = 16


def _op(kind: str, op: str, idx: int, t_start: float = 0.0, payload: torch.Tensor | None = None) -> RecordedOp:
    t = payload if payload is not None else torch.zeros(ELEMS)
    return RecordedOp(op=op, unit=0, t_start=t_start, t_end=t_start, n_tensors=1, shapes=(tuple(t.shape),),
                      dtypes=(wire.dtype_name(t.dtype),), idx=idx, kind=kind,
                      reduce="sum" if kind == "all_reduce" else None, digests=(wire.digest(t),))


class TinyRecording:
    """One group (id 0) over ``ranks``: every rank's all-reduce (seq 0) of ``ELEMS`` ones, and
    every point-to-point message of one ``zeros(1)`` a rank sends (``p2p``: (src, dst, tag, seq)
    -> the sender's recorded start; the receiver's is 0)."""

    def __init__(self, ranks: tuple[int, ...], p2p: dict[tuple[int, int, int, int], float] | None = None):
        self.ranks = ranks
        self.p2p = dict(p2p or {})

    def group_id(self, key):
        return 0

    def group_ranks(self, gid):
        return self.ranks

    def folded(self, gid):
        return False

    def captured_members(self, gid):
        return self.ranks

    def collective(self, rank, gid, seq):
        return _op("all_reduce", "allreduce", 0, payload=torch.ones(ELEMS)) if seq == 0 else None

    def contribution(self, rank, gid, seq):
        return [torch.ones(ELEMS)]

    def sent(self, gid, src, dst, tag, seq):
        t = self.p2p.get((src, dst, tag, seq))
        if t is None:
            return None
        return _op("send", "send", seq, t_start=t, payload=torch.zeros(1)), lambda: torch.zeros(1)

    def received(self, rank, gid, src, tag, seq):
        if (src, rank, tag, seq) not in self.p2p:
            return None
        return _op("recv", "recv", 1 + seq, payload=torch.zeros(1))

    def ops_of(self, rank):
        return []


def _peer(store_path: str, rank: int, size: int, mode: str, ready_path: str) -> None:
    torch.set_num_threads(1)
    open(ready_path, "w").close()  # started: the caller's join may begin its own short clock
    group = dist.ProcessGroupGloo(dist.FileStore(store_path, size), rank, size, datetime.timedelta(seconds=30))
    if mode.startswith("die"):
        time.sleep(1.5 if mode == "die-later" else 0.3)  # (0.3: its peer's side of the mesh has connected)
        os._exit(3)  # as a crashed process: no teardown, its connections close
    time.sleep(60)  # stalls: alive, connected, never sends (the test ends it)
    del group
    os._exit(0)


class MisbehavingPeer:
    """Physical rank ``size - 1`` of a gloo group of ``size`` (this process is rank 0), in a
    process of its own; :meth:`join` gives this process's side of the group.

    Started from a forkserver (a clean single-threaded process with torch imported), not forked
    from the test process: a fork of a process whose other threads hold locks (gloo's, earlier
    tests' leftovers) can hang in the child before it joins."""

    def __init__(self, tmp_path, mode: str, size: int = 2):
        self.store_path, self.size = str(tmp_path / f"store-{mode}"), size
        self.ready_path = str(tmp_path / f"ready-{mode}")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
        self.proc = ctx.Process(target=_peer, args=(self.store_path, size - 1, size, mode, self.ready_path))
        self.proc.start()

    def join(self, timeout_s: float) -> dist.ProcessGroup:
        """This process's side of the group, once the peer has started (up to 120 s: a first
        forkserver imports torch); ``timeout_s`` is the group's own timeout."""
        due = time.monotonic() + 120
        while not os.path.exists(self.ready_path):
            if not self.proc.is_alive() or time.monotonic() > due:
                raise RuntimeError(f"the misbehaving peer did not start (exit code {self.proc.exitcode})")
            time.sleep(0.02)
        return dist.ProcessGroupGloo(dist.FileStore(self.store_path, self.size), 0, self.size,
                                     datetime.timedelta(seconds=timeout_s))

    def end(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
