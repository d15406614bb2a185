"""The writer and a full disk: checked before writing, ENOSPC while writing; either way a
plain TraceSpaceError (needed vs free, where) and nothing a reader accepts."""

import errno

import pytest

from prism_launch.trace import TraceMissingError, TraceReader, TraceSpaceError, TraceUnwritableError, TraceWriter
from prism_launch.trace import space
from tests.prism_launch.trace.sample_trace import COMMIT_KW, sample_events, sample_tensors


def _writer(path):
    w = TraceWriter(path)
    w.add_events(sample_events())
    w.add_tensors(0, sample_tensors())
    return w


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(space, "free_bytes", lambda path: 4096)
    w = _writer(tmp_path / "t")
    with pytest.raises(TraceSpaceError, match=r"not enough free disk space for the PrismTrace at .*4.0 KiB free"):
        w.commit(**COMMIT_KW)
    with pytest.raises(TraceMissingError):
        TraceReader(tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


def test_enospc_while_writing_leaves_nothing(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))

    monkeypatch.setattr(pq, "write_table", full)
    w = _writer(tmp_path / "t")
    with pytest.raises(TraceSpaceError, match="the disk filled up: not enough free space left for the PrismTrace") as e:
        w.commit(**COMMIT_KW)
    assert e.value.during and e.value.needed > 0 and "trace.dir=" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind


def test_enospc_while_spilling_ends_with_the_same_message_and_leaves_nothing(tmp_path, monkeypatch):
    import builtins

    import torch

    real_open = builtins.open

    def full_for_blobs(path, mode="r", *a, **k):
        if "blob" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", full_for_blobs)
    with pytest.raises(TraceSpaceError, match="the disk filled up") as e:
        with TraceWriter(tmp_path / "t", spill_bytes=1024) as w:
            w.add_tensors(0, {"a": torch.zeros(1024)})  # 4 KiB: past spill_bytes, written at once
    assert e.value.during and e.value.needed > 0
    assert list(tmp_path.iterdir()) == []


def test_unwritable_parent_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TraceUnwritableError, match=rf"{blocker} is not writable \(it is a file"):
        space.require_writable(blocker / "tr")


def test_capture_monitor_ends_the_capture_when_the_disk_cannot_hold_it(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from prism_launch.capture.monitor import CaptureMonitor

    coord = SimpleNamespace(bytes_recorded=64 << 20, t0=0.0, finished=set(), ops_completed=10)
    monitor = CaptureMonitor(coord, tmp_path / "tr", ranks=2, setting=False)
    monkeypatch.setattr(space, "free_bytes", lambda path: 1 << 30)
    monitor.tick()  # room enough
    monkeypatch.setattr(space, "free_bytes", lambda path: 32 << 20)
    monitor._next_space = 0.0
    with pytest.raises(TraceSpaceError, match=r"disk filled up: .*needs about 75.2 MiB, 32.0 MiB"):
        monitor.tick()
    monitor.close()
