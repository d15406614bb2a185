"""Many small tensors travel as one packed message and arrive as the same tensors."""

import threading
from multiprocessing import Pipe

import torch

from nccl_ext.core import wire


def test_many_small_tensors_arrive_unchanged_and_independent():
    a, b = Pipe()
    pieces = [torch.arange(i, i + 3, dtype=torch.float32) for i in range(1024)]
    pieces[5] = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    pieces[7] = torch.empty(0, dtype=torch.bfloat16)
    header, got = _through(a, b, ("ok", 3), pieces)
    assert header == ("ok", 3) and len(got) == len(pieces)
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got, pieces))
    got[0].add_(100)  # each piece owns its memory
    assert torch.equal(got[1], pieces[1])


def test_few_or_large_tensors_go_one_message_each():
    a, b = Pipe()
    few = [torch.ones(4), torch.zeros(2, dtype=torch.int32)]
    big = [torch.ones(wire.PACK_MAX_BYTES // 4 // 8 + 1) for _ in range(wire.PACK_MIN)]
    for tensors in (few, big, []):
        _, got = _through(a, b, ("x",), tensors)
        assert len(got) == len(tensors) and all(torch.equal(x, y) for x, y in zip(got, tensors))


def _through(a, b, header, tensors):
    """Send on a thread (a pipe holds 64 KiB), receive here."""
    t = threading.Thread(target=wire.send, args=(a, header, tensors))
    t.start()
    out = wire.recv(b)
    t.join(timeout=30)
    assert not t.is_alive()
    return out


def test_a_tensor_given_more_than_once_travels_once_and_arrives_at_each_place():
    a, b = Pipe()
    stand_ins = [torch.full((12,), float(i)) for i in range(4)]
    pieces = [stand_ins[i % 4] for i in range(1024)]  # a folded all-gather's result
    sent = []
    real_send_bytes = a.send_bytes
    a.send_bytes = lambda data: (sent.append(len(data)), real_send_bytes(data))
    _, got = _through(a, b, ("ok", 1), pieces)
    assert len(got) == 1024 and all(torch.equal(x, y) for x, y in zip(got, pieces))
    assert len({id(x) for x in got}) == 4 and got[0] is got[4]  # aliased as the sender's were
    assert sent[1:] == [12 * 4] * 4  # after the header, the four distinct pieces' bytes only
    _, got = _through(a, b, ("ok", 2), [stand_ins[0], stand_ins[0]])  # unpacked: sent once too
    assert len(got) == 2 and got[0] is got[1] and torch.equal(got[1], stand_ins[0])
