"""A message's rest has a deadline once its first bytes are there (nccl_ext/core/wire.py): a
sender that stalls part way through a frame fails the read by its deadline, naming what was
read; whole messages, large ones included, still arrive whole."""

import os
import pickle
import struct
import threading
import time
from multiprocessing import Pipe

import pytest
import torch

from nccl_ext.core import wire
from nccl_ext.core.pending import CommDeadlineError


def _frame(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


@pytest.mark.parametrize("cut", ["length", "header", "tensor"])
def test_a_message_cut_short_fails_by_its_deadline_naming_it(cut):
    a, b = Pipe()
    header = _frame(pickle.dumps((("coll", 5), [wire.TensorDesc("float32", (4,))], False, None)))
    whole = header + _frame(torch.ones(4).numpy().tobytes())
    sent = {"length": whole[:2], "header": header[:9], "tensor": whole[:-3]}[cut]
    os.write(a.fileno(), sent)  # the sender stops here, alive
    assert b.poll(0)
    t0 = time.monotonic()
    with pytest.raises(CommDeadlineError, match=r"deadline exceeded: rank 3's message: .* then nothing") as e:
        wire.recv(b, timeout_s=0.3, what="rank 3's message")
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert f"{len(sent)} bytes of the message arrived" in str(e.value) and "comm.timeout_s=0.3" in str(e.value)
    assert isinstance(e.value, OSError)  # readers drop the connection, as for one that broke


def test_a_connection_that_ends_inside_a_message_says_so():
    a, b = Pipe()
    os.write(a.fileno(), _frame(b"x" * 10)[:6])
    a.close()
    with pytest.raises(OSError, match="ended inside a message"):
        wire.recv(b, timeout_s=5.0, what="rank 1's message")


def test_whole_messages_arrive_whole_larger_than_the_pipe_and_with_packed_tensors():
    a, b = Pipe()
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: many reads
    small = [torch.full((3,), float(i)) for i in range(wire.PACK_MIN)]
    sender = threading.Thread(target=lambda: (wire.send(a, ("big",), [big, big]), wire.send(a, ("small",), small)))
    sender.start()
    header, got = wire.recv(b, timeout_s=10.0)
    assert header == ("big",) and len(got) == 2 and torch.equal(got[0], big) and got[0] is got[1]
    header, got = wire.recv(b, timeout_s=10.0)
    assert header == ("small",) and all(torch.equal(x, y) for x, y in zip(got, small))
    wire.send(a, ("empty",), [torch.empty(0, 2)])
    header, got = wire.recv(b)  # the default deadline
    assert header == ("empty",) and got[0].shape == (0, 2)
    sender.join(10)
