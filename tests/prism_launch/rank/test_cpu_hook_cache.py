"""The CPU allocator hook's build cache: a library planted where another user could write is
never loaded, a library whose digest does not match is rebuilt, and the build lock follows no
symbolic link. A one-line C++ source stands in for the hook (a real compile, in a second)."""

import ctypes
import os

import pytest

from prism_launch.config import private_dirs
from prism_launch.config.private_dirs import UnsafePathError
from prism_launch.rank import cpu_hook

pytestmark = pytest.mark.skipif(cpu_hook._compiler() is None, reason="no C++ compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int prism_tiny() { return 7; }\n')
    monkeypatch.setattr(cpu_hook, "SOURCE", src)
    monkeypatch.setattr(cpu_hook, "_CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(cpu_hook.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    return tmp_path / "cache"


def _target_name(cache) -> str:
    """The file name the build gives the library (built once, then removed)."""
    built = cpu_hook._build()
    name = built.name
    for p in built.parent.iterdir():
        p.unlink()
    return name


def test_a_library_planted_in_a_world_writable_cache_is_refused_and_not_loaded(cache, monkeypatch):
    name = _target_name(cache)
    planted = cache / "cpu_alloc_hook" / name
    planted.write_bytes(b"not yours")
    (planted.parent / (name + ".sha256")).write_text(cpu_hook._sha256(planted))  # a digest that even matches
    os.chmod(planted.parent, 0o777)
    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **k: loaded.append(path))
    monkeypatch.setattr(cpu_hook, "_HOOK", None)
    monkeypatch.setattr(cpu_hook, "_HOOK_ERROR", None)
    assert cpu_hook.load_hook() is None
    assert loaded == []
    assert "cpu_alloc_hook: is writable by group or others" in cpu_hook.hook_error()
    assert "memory.cache_dir" in cpu_hook.hook_error()
    assert planted.read_bytes() == b"not yours"


def test_a_cache_owned_by_another_user_is_refused(cache, monkeypatch):
    cpu_hook._build()
    monkeypatch.setattr(private_dirs.os, "getuid", lambda: os.stat(cache).st_uid + 1)
    with pytest.raises(UnsafePathError, match=r"cache: is owned by uid \d+, not by you"):
        cpu_hook._build()


def test_a_temporary_fallback_another_user_created_first_is_refused(cache, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("the configured root cannot be created under a file")
    monkeypatch.setattr(cpu_hook, "_CACHE_DIR", tmp_path / "afile" / "cache")
    fallback = tmp_path / "tmp" / f"prism_launch-{os.getuid()}"
    fallback.mkdir(parents=True)
    os.chmod(fallback, 0o777)
    with pytest.raises(UnsafePathError, match=f"prism_launch-{os.getuid()}: is writable by group or others"):
        cpu_hook._build()


def test_a_library_whose_digest_does_not_match_is_rebuilt(cache):
    built = cpu_hook._build()
    assert os.stat(cache).st_mode & 0o777 == 0o700 and os.stat(built.parent).st_mode & 0o777 == 0o700
    digest = built.with_name(built.name + ".sha256")
    assert digest.read_text().strip() == cpu_hook._sha256(built)
    good = built.read_bytes()
    built.write_bytes(b"swapped after the build")
    assert cpu_hook._build() == built
    assert built.read_bytes() != b"swapped after the build"
    assert digest.read_text().strip() == cpu_hook._sha256(built)
    assert ctypes.CDLL(str(built)).prism_tiny() == 7
    assert len(built.read_bytes()) == len(good)


def test_a_symlinked_build_lock_is_refused_and_its_target_left_alone(cache, tmp_path):
    name = _target_name(cache)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (cache / "cpu_alloc_hook" / (name + ".lock")).symlink_to(victim)
    with pytest.raises(UnsafePathError, match=r"\.lock: is a symbolic link"):
        cpu_hook._build()
    assert victim.read_text() == "keep me"
    assert not (cache / "cpu_alloc_hook" / name).exists()
