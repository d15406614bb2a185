"""A peer's IPC handles are opened once, all together, by the program's thread at an op's issue
(:class:`nccl_ext.exchange.ipc.DevicePeers`): opening one takes the driver's context lock for
writing, so the reader thread that queues folds must never open one while the program's thread
may sit in a synchronous copy behind a deferred wait. CUDA's opening is replaced by a recorder
here; what is checked is who opens what, and when."""

import os
import pickle
import threading

import torch

from nccl_ext.exchange.ipc import DevicePeers, handle_path

EVENTS = 16


def _publish(directory, rank):
    handles = [f"r{rank}e{i}".encode() for i in range(EVENTS)]
    with open(handle_path(directory, rank), "wb") as f:
        f.write(pickle.dumps((torch.arange(64, dtype=torch.uint8), handles)))


def _recorder(monkeypatch):
    opened = []

    def from_ipc_handle(device, handle):
        opened.append((threading.current_thread().name, handle))
        return ("event", handle)

    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", staticmethod(from_ipc_handle), raising=False)
    return opened


def test_the_program_thread_opens_a_peer_with_every_event_and_no_other_thread_opens_it_again(tmp_path, monkeypatch):
    opened = _recorder(monkeypatch)
    _publish(tmp_path, 1)
    peers = DevicePeers(str(tmp_path), torch.device("cpu"))
    peers.meet([1, 2])  # rank 2 has not published yet: left for later
    me = threading.current_thread().name
    assert opened == [(me, f"r1e{i}".encode()) for i in range(EVENTS)]

    got = []
    reader = threading.Thread(target=lambda: got.extend(
        [peers.event(1, i) for i in (EVENTS - 1, 0, 7)] + [peers.views(1, [(8, "uint8", [4])])]),
        name="prism-capture-reader")
    reader.start()
    reader.join(10)
    assert got[:3] == [("event", f"r1e{i}".encode()) for i in (EVENTS - 1, 0, 7)]
    assert got[3][0].tolist() == [8, 9, 10, 11]
    assert len(opened) == EVENTS and peers.opened_late == 0
    peers.meet([1])
    assert len(opened) == EVENTS


def test_a_peer_first_met_in_a_location_is_opened_there_whole_and_counted(tmp_path, monkeypatch):
    opened = _recorder(monkeypatch)
    peers = DevicePeers(str(tmp_path), torch.device("cpu"))
    peers.meet([3])
    assert opened == [] and not os.path.exists(handle_path(str(tmp_path), 3))
    _publish(tmp_path, 3)
    assert peers.event(3, 5) == ("event", b"r3e5")
    assert [h for _, h in opened] == [f"r3e{i}".encode() for i in range(EVENTS)]
    assert peers.opened_late == 1
    peers.event(3, 9)
    assert peers.opened_late == 1 and len(opened) == EVENTS


def test_no_thread_locks_or_unlocks_arena_pages_while_told_not_to(tmp_path, monkeypatch):
    """Host arenas: once waits go to the GPU a generation first mapped or grown where pages may
    not be locked stays pageable, a drained locked one stays locked until pages may be unlocked
    again (or the arena closes), and ``reserve`` grows the arena ahead, locked."""
    from nccl_ext.exchange import arena as exchange

    calls = []
    monkeypatch.setattr(exchange, "pin", lambda mm: calls.append("pin") or 1000 + len(calls))
    monkeypatch.setattr(exchange, "unpin", lambda ptr: calls.append(("unpin", ptr)))
    deferring = [False]

    def pin_ok():
        return not deferring[0]

    def helper(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join(10)
        return out[0]

    d = str(tmp_path)
    arena = exchange.Arena(d, 0, initial_bytes=1 << 20, pin=True, pin_ok=pin_ok, unpin_ok=pin_ok)
    gen0, _descs, first = arena.put([torch.zeros(1024)])
    assert calls == ["pin"] and arena.high_water == 4096
    arena.reserve(2 * arena.high_water)  # already that large: nothing new
    assert calls == ["pin"]
    arena.reserve(4 << 20)  # a new, larger generation, locked; generation 0 still holds a region
    gen1 = gen0 + 1
    assert calls == ["pin", "pin"] and os.path.exists(exchange.arena_path(d, 0, gen0))
    peers = exchange.PeerViews(d, pin=True, pin_ok=pin_ok)

    deferring[0] = True
    assert helper(lambda: peers.view(0, gen0, 0, "float32", [4]).tolist()) == [0.0] * 4
    assert calls == ["pin", "pin"] and peers.left_pageable == 1
    g, _, second = arena.put([torch.zeros(1 << 20)])  # fits the reserved generation
    assert g == gen1
    g, _, third = arena.put([torch.zeros(1 << 20)])  # does not fit: a new generation, pageable
    assert g == gen1 + 1 and calls == ["pin", "pin"] and arena.left_pageable == 1
    arena.free(first)  # generation 0 drained: stays locked
    arena.free(second)  # generation 1 drained: stays locked
    *_, fourth = arena.put([torch.ones(4)])
    assert calls == ["pin", "pin"] and os.path.exists(exchange.arena_path(d, 0, gen0))
    deferring[0] = False
    *_, fifth = arena.put([torch.ones(4)])  # pages may be unlocked again: the drained generations go
    assert sorted(c for c in calls if c != "pin") == [("unpin", 1001), ("unpin", 1002)]
    assert not os.path.exists(exchange.arena_path(d, 0, gen0))
    for token in (third, fourth, fifth):
        arena.free(token)
    assert arena.live_bytes == 0 and arena.high_water >= 2 << 20
    peers.close()
    arena.close()


def test_the_host_arena_grows_locked_at_the_step_from_which_waits_are_deferred():
    from nccl_ext.capture.transport import CaptureTransport
    from nccl_ext.capture.deferred_waits import DEFER_FROM_STEP, RESERVE_HEADROOM, DeferredWaits
    from types import SimpleNamespace

    from nccl_ext.capture.progress import RankProgress

    class FakeArena:
        pin, high_water, reserved = True, 3 << 20, []

        def reserve(self, n):
            self.reserved.append((n, t.unit, w.may_lock_pages()))

    t = CaptureTransport.__new__(CaptureTransport)  # only what marker() uses
    t._progress = RankProgress(0)
    w = DeferredWaits(t._progress, True)
    w._flags = object()
    t._waits, t._x = w, SimpleNamespace(arena=FakeArena())
    t._span, t._send = (lambda: (0.0, 0.0, 0.0)), (lambda msg: None)
    for _ in range(DEFER_FROM_STEP + 2):
        t.marker("step")
    # once, on the step boundary, while pages may still be locked
    assert FakeArena.reserved == [(6 << 20, DEFER_FROM_STEP - 1, True)] and t.unit == DEFER_FROM_STEP + 2
    FakeArena.reserved.clear()
    FakeArena.high_water = 8 << 30  # large: grown by at most RESERVE_HEADROOM
    w.before_deferring(t._x.arena)
    assert FakeArena.reserved[0][0] == (8 << 30) + RESERVE_HEADROOM
    FakeArena.reserved.clear()
    w2 = DeferredWaits(RankProgress(0, unit=DEFER_FROM_STEP - 1), True)  # no waits on the GPU: no growth
    w2.before_deferring(FakeArena())
    assert FakeArena.reserved == []


def test_once_waits_go_to_the_gpu_only_the_program_locks_pages_and_no_thread_unlocks_them():
    from nccl_ext.capture.deferred_waits import DEFER_FROM_STEP, HELPER_PREFIX, DeferredWaits
    from nccl_ext.capture.progress import RankProgress

    progress = RankProgress(0, unit=DEFER_FROM_STEP)
    w = DeferredWaits(progress, True)
    w._flags = None  # no flags: waits never go to the GPU

    def on_thread(name):
        seen = []
        t = threading.Thread(target=lambda: seen.append((w.may_lock_pages(), w.may_unlock_pages())), name=name)
        t.start()
        t.join(10)
        return seen.pop()

    helper, program = f"{HELPER_PREFIX}capture-reader", "autograd-like"  # backward passes issue ops off the main thread
    assert on_thread(helper) == (True, True) and on_thread(program) == (True, True)
    w._flags, progress.unit = object(), DEFER_FROM_STEP - 1  # the program's first steps
    assert on_thread(helper) == (True, True)
    progress.unit = DEFER_FROM_STEP
    assert on_thread(helper) == (False, False)
    assert on_thread(program) == (True, False) and (w.may_lock_pages(), w.may_unlock_pages()) == (True, False)


def test_no_room_to_grow_the_host_arena_ahead_is_said_and_not_fatal(capsys):
    from nccl_ext.capture.deferred_waits import DeferredWaits
    from nccl_ext.capture.progress import RankProgress

    class FullArena:
        pin, high_water = True, 1 << 20

        def reserve(self, n):
            raise OSError(28, "capture's shared-memory exchange: no room for a 2 MiB arena")

    w = DeferredWaits(RankProgress(3), True)
    w._flags = object()
    w.before_deferring(FullArena())
    err = capsys.readouterr().err
    assert "rank 3: could not grow the host arena ahead to 2 MiB" in err and "no room" in err
