"""The trace lock: readers share it, a writer excludes them (and they it), the refusal names
who holds it (pid, host, start, program) and never their command line; the file is 0600."""

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from prism_launch.trace import TraceBusyError
from prism_launch.trace.lock import DirLock, holders, lock_path


def test_readers_share_and_a_writer_is_refused_naming_them(tmp_path):
    with DirLock(tmp_path / "t", setting="trace.dir", shared=True), \
            DirLock(tmp_path / "t", setting="trace.dir", shared=True):
        with pytest.raises(TraceBusyError) as e:
            DirLock(tmp_path / "t", setting="trace.dir").acquire()
    msg = str(e.value)
    assert msg.count(f"pid {os.getpid()} on host {socket.gethostname()}") == 2, msg
    assert "(reading)" in msg and "trace.dir=" in msg
    DirLock(tmp_path / "t", setting="trace.dir").acquire().release()  # gone with its holders


def test_a_writer_refuses_readers(tmp_path):
    with DirLock(tmp_path / "t", setting="trace.dir"):
        with pytest.raises(TraceBusyError, match=rf"pid {os.getpid()} .*\(writing\)"):
            DirLock(tmp_path / "t", setting="trace.dir", shared=True).acquire()


def test_lock_file_is_private_and_holds_no_arguments(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/prism-launch", "--secret-token=hunter2", "train.py"])
    with DirLock(tmp_path / "t", setting="trace.dir") as lock:
        raw = lock.path.read_text()
        assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o600
        assert "hunter2" not in raw and "train.py" not in raw
        [rec] = [json.loads(line) for line in raw.splitlines()]
        assert rec["program"] == "prism-launch" and rec["pid"] == os.getpid() and "started_unix" in rec


def test_an_old_world_readable_lock_file_is_made_private(tmp_path):
    p = lock_path(tmp_path / "t")
    p.write_text("")
    os.chmod(p, 0o644)
    with DirLock(tmp_path / "t", setting="trace.dir"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_lines_of_gone_readers_are_not_named():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = socket.gethostname()
    raw = "\n".join(json.dumps({"pid": p, "host": h, "started_unix": 0, "program": "x"})
                    for p, h in ((int(gone), host), (os.getpid(), host), (1, "elsewhere"))).encode()
    assert [h["pid"] for h in holders(raw)] == [os.getpid(), 1]
