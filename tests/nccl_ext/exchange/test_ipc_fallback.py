"""Where a rank's buffer cannot be shared by CUDA IPC, the GPU exchange is not started: the rank
says so once on stderr, naming the setting, its exchanged tensors go through host memory, and
the memory figures do not leave out a buffer it dropped."""

import torch

from nccl_ext.core.device_memory import pool_bytes
from nccl_ext.exchange.device_reduce import DeviceFold
from nccl_ext.exchange.ipc import start_gpu_exchange


def test_a_device_without_cuda_ipc_leaves_the_host_path(tmp_path, capsys, monkeypatch):
    import nccl_ext.core.device_memory as pool

    def on_host(device, nbytes):  # the accounting of allocate_outside, for a buffer this machine can hold
        buf = torch.empty(pool.charged_size(nbytes), dtype=torch.uint8)
        pool._POOL_BYTES["cpu"] = pool._POOL_BYTES.get("cpu", 0) + buf.numel()
        return buf

    monkeypatch.setattr(pool, "allocate_outside", on_host)
    before = pool_bytes("cpu")
    got = start_gpu_exchange(str(tmp_path), 3, DeviceFold(torch.device("cpu"), 1 << 16), 4 << 20, lambda op: None, None)
    assert got is None
    err = capsys.readouterr().err
    assert "rank 3: the GPU exchange is unavailable" in err and "capture.gpu_exchange_mib=0" in err
    assert pool_bytes("cpu") == before  # the dropped buffer is not left out of the figures
    assert not list(tmp_path.iterdir())  # no handle published for peers to open


def test_a_rank_without_the_gpu_exchange_refuses_a_peers_gpu_location_by_name():
    import pytest

    from nccl_ext.capture.rank_exchange import _host_only
    from nccl_ext.exchange.ipc import DEVICE_TAG

    _host_only([None, (4, 0, [(0, "float32", [2])])])  # host locations: read as before
    with pytest.raises(RuntimeError, match=r"rank 5 staged its data on its GPU.*capture.gpu_exchange_mib=0"):
        _host_only([(4, 0, []), (5, DEVICE_TAG, [(0, "float32", [2])], 1, None)])


def test_the_retire_thread_reports_each_op_read_in_order_and_keeps_its_first_failure():
    from nccl_ext.exchange.ipc import Retirer

    class Done:
        def synchronize(self):
            pass

    class Broken:
        def synchronize(self):
            raise RuntimeError("device lost")

    read = []
    r = Retirer(read.append, name="test-retire")
    for op, ev in enumerate([Done(), Broken(), Done()]):
        r.put(ev, op)
    r.close(5.0)
    assert read == [0, 2]  # the op whose fold could not be waited for is not reported read
    assert "op 1" in str(r.error) and "device lost" in str(r.error)


def test_the_gate_queues_a_fold_only_once_its_peers_stagings_have_run_and_never_holds_a_ready_one():
    """One stream folds every group's ops: a fold queued there before its peer's staging ran would
    hold the folds of other groups behind it. The gate holds each op until its events are done;
    an op whose peers are ready goes ahead of one still waiting, put earlier."""
    import threading

    from nccl_ext.exchange.ipc import EventGate

    class Event:
        def __init__(self, done=False):
            self.done = done

        def query(self):
            return self.done

    class Broken:
        def query(self):
            raise RuntimeError("peer gone")

    ran, all_ran = [], threading.Event()

    def then(name):
        def f():
            ran.append(name)
            if len(ran) == 3:
                all_ran.set()
        return f

    late = Event()
    gate = EventGate(None, "test-gate")
    gate.put([late, Event(True)], then("X: a peer's staging not run yet"))
    gate.put([Event(True)], then("Y: ready"))
    gate.put([Broken()], then("Z: its fold's own wait says why"))
    deadline = threading.Event()
    for _ in range(200):
        if len(ran) == 2:
            break
        deadline.wait(0.01)
    assert ran == ["Y: ready", "Z: its fold's own wait says why"]
    late.done = True
    assert all_ran.wait(5) and ran[-1] == "X: a peer's staging not run yet"
    gate.close(5.0)
    assert gate.error is None
