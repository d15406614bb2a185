"""The one atomic writer: new content whole or old content whole, 0600 unless told, durable,
never through a planted name, and no temporary file left behind by a failure."""

from __future__ import annotations

import os
import stat

import pytest

from nccl_ext.core import atomic
from nccl_ext.core.atomic import atomic_write


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writes_text_and_bytes_private_by_default(tmp_path):
    target = tmp_path / "sub" / "report.json"
    atomic_write(target, "héllo")
    assert target.read_text(encoding="utf-8") == "héllo"
    assert _mode(target) == 0o600
    atomic_write(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert os.listdir(target.parent) == ["report.json"]


def test_mode_is_exact_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "cluster.yaml", "a: 1\n", mode=0o644)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "cluster.yaml") == 0o644


def test_fsyncs_the_file_and_then_the_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    atomic_write(tmp_path / "f", "x")
    assert synced == [False, True]


@pytest.mark.parametrize("fails", ["write", "fsync", "replace"])
def test_a_failure_leaves_the_old_content_and_no_temporary_file(tmp_path, monkeypatch, fails):
    target = tmp_path / "f"
    atomic_write(target, "old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, fails, boom)
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["f"]


def test_never_writes_through_an_existing_temporary_name(tmp_path, monkeypatch):
    """O_EXCL: a name someone else holds (or planted as a link) is skipped, not opened."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    draws = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(draws))
    planted = tmp_path / f".f.{os.getpid()}.aaaa.tmp"
    planted.symlink_to(victim)
    atomic_write(tmp_path / "f", "new")
    assert victim.read_text() == "keep"
    assert (tmp_path / "f").read_text() == "new"
    assert planted.is_symlink()


def test_the_other_writers_are_this_one():
    """The config's private writer and the cluster-file writer go through atomic_write."""
    import inspect

    from prism_launch.config import plan
    from prism_launch.predict import netbench

    for fn in (plan.write_private, netbench.write_atomic):
        src = inspect.getsource(fn)
        assert "atomic_write(" in src and "os.replace" not in src and "mkstemp" not in src, fn.__qualname__
