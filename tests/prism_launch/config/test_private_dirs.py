"""Private folders: created 0700, refused when another user owns them, could write to them,
or when a level is a symbolic link."""

import os

import pytest

from prism_launch.config import private_dirs
from prism_launch.config.private_dirs import UnsafePathError, check_private, ensure_private_dir, open_private_file


def test_every_level_is_created_0700(tmp_path):
    d = ensure_private_dir(tmp_path / "root", "a", "b")
    assert d == tmp_path / "root" / "a" / "b"
    for p in (tmp_path / "root", tmp_path / "root" / "a", d):
        assert os.stat(p).st_mode & 0o777 == 0o700


def test_a_world_writable_level_is_refused_naming_it(tmp_path):
    (tmp_path / "root" / "a").mkdir(parents=True)
    os.chmod(tmp_path / "root" / "a", 0o777)
    with pytest.raises(UnsafePathError, match=r"root/a: is writable by group or others \(mode 0777\)"):
        ensure_private_dir(tmp_path / "root", "a", "b")
    assert not (tmp_path / "root" / "a" / "b").exists()


def test_a_folder_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    ensure_private_dir(tmp_path / "root")
    monkeypatch.setattr(private_dirs.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(UnsafePathError, match="is owned by uid .*, not by you"):
        ensure_private_dir(tmp_path / "root")


def test_a_symlinked_level_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "root").mkdir(mode=0o700)
    (tmp_path / "root" / "a").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        ensure_private_dir(tmp_path / "root", "a")


def test_a_private_file_opens_without_truncation_and_a_symlink_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "x.lock"
    link.symlink_to(victim)
    with pytest.raises(UnsafePathError, match="x.lock: is a symbolic link"):
        open_private_file(link, os.O_WRONLY)
    assert victim.read_text() == "keep me"
    fd = open_private_file(tmp_path / "new.lock", os.O_WRONLY)
    os.close(fd)
    assert os.stat(tmp_path / "new.lock").st_mode & 0o777 == 0o600
    check_private(tmp_path / "new.lock", directory=False)
