"""A message's tensors are in host memory before any of it is sent, and outside the send lock:
a GPU tensor's copy waits for its stream, which may wait (on the GPU) for an op that only the
coordinator's reader of this connection, or another thread's message, completes."""

import threading
from collections import defaultdict
from multiprocessing import Pipe

import pytest
import torch

from nccl_ext.core import wire
from nccl_ext.core.protocol import Send, XRead
from nccl_ext.capture.link import CoordinatorLink


def test_nothing_is_sent_until_every_tensor_is_in_host_memory(monkeypatch):
    a, b = Pipe()
    taken = wire.tensor_bytes

    def second_fails(t):
        if t.numel() == 2:
            raise RuntimeError("copy failed")
        return taken(t)

    monkeypatch.setattr(wire, "tensor_bytes", second_fails)
    with pytest.raises(RuntimeError, match="copy failed"):
        wire.send(a, ("coll", 1), [torch.ones(3), torch.ones(2)])
    assert not b.poll(0)  # no header without its tensors: the reader is never left mid-message
    wire.send(a, ("coll", 2), [torch.ones(3)])
    header, got = wire.recv(b)
    assert header == ("coll", 2) and torch.equal(got[0], torch.ones(3))


def test_a_message_whose_tensor_waits_holds_neither_the_reader_nor_another_threads_message(monkeypatch):
    a, b = Pipe()
    transport = CoordinatorLink.__new__(CoordinatorLink)  # only what send uses
    transport._conn, transport._send_lock, transport.busy_s = a, threading.Lock(), defaultdict(float)
    ready, waiting = threading.Event(), threading.Event()
    taken = wire.tensor_bytes

    def slow(t):  # as a GPU tensor's copy behind a stream that waits for an op not complete yet
        if t.numel() == 5:
            waiting.set()
            assert ready.wait(30)
        return taken(t)

    monkeypatch.setattr(wire, "tensor_bytes", slow)
    program = threading.Thread(target=transport.send, args=(Send(9, "g", 1, 0, 0, 0, 0.0, 0.0, 0.0), [torch.ones(5)]))
    program.start()
    assert waiting.wait(30)
    reader = threading.Thread(target=transport.send, args=(XRead(8),))
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "another thread's message waited for the copy"
    assert b.poll(10) and wire.recv(b)[0] == ("xread", 8, None)  # nothing of the waiting message before it
    ready.set()
    program.join(30)
    header, got = wire.recv(b)
    assert header[:2] == ("send", 9) and torch.equal(got[0], torch.ones(5))
