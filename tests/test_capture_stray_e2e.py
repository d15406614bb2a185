"""A capture goes on when a stray client connects to its coordinator: one that connects and
closes, and one that connects and never speaks, opened while the ranks start, do not stop any
rank from connecting (each is closed once its handshake fails or runs out)."""

import socket
import threading
import time
from pathlib import Path

from tests.conftest import WORKERS, run_prism

NPROC = 2


def _strays(tmpdir: Path, done: threading.Event, opened: list) -> None:
    """Connect to the coordinator's socket as soon as it exists: close one at once, hold one silent."""
    while not done.is_set():
        socks = list(tmpdir.glob("prism-coord-*/coord.sock"))
        if socks:
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(socks[0]))
                s.close()
                silent = socket.socket(socket.AF_UNIX)
                silent.connect(str(socks[0]))
            except OSError:
                time.sleep(0.01)
                continue
            opened.append(silent)
            done.wait()
            silent.close()
            return
        time.sleep(0.01)


def test_stray_connections_during_a_capture(tmp_path, short_tmp):
    tmpdir = short_tmp
    done, opened = threading.Event(), []
    t = threading.Thread(target=_strays, args=(tmpdir, done, opened), daemon=True)
    t.start()
    try:
        r = run_prism(["--nproc-per-node", str(NPROC), "-r", "1", "device=cpu", "capture.warm_imports=[torch]",
                       "comm.timeout_s=60", "--log-dir", tmp_path / "logs", "mode=capture",
                       f"trace.dir={tmp_path / 'trace'}", WORKERS / "collectives.py"],
                      cwd=tmp_path, env={"TMPDIR": str(tmpdir)}, timeout=600)
    finally:
        done.set()
        t.join(5)
    assert opened, "the test never reached the coordinator's socket"
    assert r.returncode == 0, r.stderr
