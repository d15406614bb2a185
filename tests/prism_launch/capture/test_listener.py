"""The coordinator's listener keeps accepting ranks whatever a client before them did: closed at
once, never spoke, held a wrong authkey or a half-sent handshake."""

import socket
import threading
import time
from multiprocessing.connection import Client

from nccl_ext.core import handshake
from prism_launch.capture.listener import RankListener

KEY = b"k" * 16


def _listener(tmp_path, handshake_s=0.5):
    got, arrived = [], threading.Event()

    def on_rank(conn, hello):
        got.append((conn, hello))
        arrived.set()

    address = str(tmp_path / "c.sock")
    listener = RankListener(address, KEY, on_rank, handshake_s=handshake_s)
    listener.start()
    return listener, address, got, arrived


def _raw(address):
    s = socket.socket(socket.AF_UNIX)
    s.connect(address)
    return s


def test_stray_clients_do_not_stop_later_ranks(tmp_path):
    listener, address, got, _ = _listener(tmp_path)
    try:
        _raw(address).close()  # connects and closes
        silent = _raw(address)  # connects and never speaks
        half = _raw(address)
        half.sendall(b"\x00\x00")  # the start of a length prefix, then nothing
        try:
            Client(address, family="AF_UNIX", authkey=b"wrong" * 4)
        except Exception:  # noqa: BLE001 - the wrong key is refused
            pass
        conns = [handshake.connect(address, KEY, r, 5.0) for r in range(3)]
        t0 = time.monotonic()
        while len(got) < 3 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert sorted(h.rank for _c, h in got) == [0, 1, 2]
        # the silent clients are closed by the handshake's deadline
        t0 = time.monotonic()
        while listener.refused < 4 and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert listener.refused == 4
        silent.settimeout(2)
        assert silent.recv(4096) is not None  # the challenge, then the close
        for c in conns:
            c.close()
        silent.close()
        half.close()
    finally:
        listener.close()


def test_a_rank_waits_out_its_handshake_while_a_silent_client_holds_none(tmp_path):
    """The handshake of one client runs on a thread of its own: a rank connecting while a silent
    client waits out its deadline is taken in at once, not after it."""
    listener, address, got, arrived = _listener(tmp_path, handshake_s=30.0)
    try:
        silent = _raw(address)
        t0 = time.monotonic()
        conn = handshake.connect(address, KEY, 7, 5.0)
        assert arrived.wait(5) and got[0][1].rank == 7 and time.monotonic() - t0 < 5
        conn.close()
        silent.close()
    finally:
        listener.close()
