"""Where a rank's buffer cannot be shared by CUDA IPC, the GPU exchange is not started: the rank
says so once on stderr, naming the setting, its exchanged tensors go through host memory, and
the memory figures do not leave out a buffer it dropped."""

import torch

from nccl_ext.device_path.pool import pool_bytes
from nccl_ext.exchange_device import DeviceFold
from nccl_ext.exchange_ipc import start_gpu_exchange


def test_a_device_without_cuda_ipc_leaves_the_host_path(tmp_path, capsys, monkeypatch):
    import nccl_ext.device_path.pool as pool

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

    from nccl_ext.capture_exchange import _host_only
    from nccl_ext.exchange_ipc import DEVICE_TAG

    _host_only([None, (4, 0, [(0, "float32", [2])])])  # host locations: read as before
    with pytest.raises(RuntimeError, match=r"rank 5 staged its data on its GPU.*capture.gpu_exchange_mib=0"):
        _host_only([(4, 0, []), (5, DEVICE_TAG, [(0, "float32", [2])], 1, None)])


def test_the_retire_thread_reports_each_op_read_in_order_and_keeps_its_first_failure():
    from nccl_ext.exchange_ipc import Retirer

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
