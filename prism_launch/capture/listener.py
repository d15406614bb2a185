"""Where capture ranks connect: a Unix socket whose accept loop no client can stop.

Connections are accepted raw and each one's handshake (:func:`nccl_ext.core.handshake.serve`:
the authkey's HMAC, the protocol version) runs on a short-lived thread of its own under a
deadline; a client that fails it, closes early or never speaks is closed and forgotten, and the
loop goes on accepting the ranks after it."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from nccl_ext.core import handshake
from nccl_ext.core.protocol import Hello, ProtocolError

HANDSHAKE_S = 10.0
"""How long a connected client has to prove the authkey and say hello (a rank does both at once)."""


class RankListener:
    """Accepts ranks at ``address``; ``on_rank(conn, hello)`` for each that passed the handshake
    (called on the handshake's thread)."""

    def __init__(self, address: str, authkey: bytes, on_rank: Callable[[Connection, Hello], None], *,
                 handshake_s: float = HANDSHAKE_S):
        self.address = address
        self._authkey = authkey
        self._on_rank = on_rank
        self.handshake_s = handshake_s
        self.refused = 0
        """Clients closed for failing or not finishing the handshake."""
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind(address)
        self._sock.listen(256)
        self._open = True
        self._thread = threading.Thread(target=self._accept_loop, name="prism-coordinator-accept", daemon=True)

    def start(self) -> None:
        """Start accepting (after the ranks are forked: no thread before fork)."""
        self._thread.start()

    def _accept_loop(self) -> None:
        while self._open:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if not self._open:
                    return
                continue  # a client gone between its connect and our accept: the next one
            sock.setblocking(True)
            threading.Thread(target=self._handshake, args=(sock,), name="prism-coordinator-handshake",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        conn = Connection(os.dup(sock.fileno()))
        # a client that sends half a message holds a read past the handshake's own deadline:
        # shutting the socket down ends that read
        state = {"done": False}
        lock = threading.Lock()

        def expire() -> None:
            with lock:
                if not state["done"]:
                    state["done"] = True
                    _shutdown(sock)

        timer = threading.Timer(self.handshake_s, expire)
        timer.daemon = True
        timer.start()
        try:
            hello = handshake.serve(conn, self._authkey, self.handshake_s)
            with lock:
                if state["done"]:
                    raise handshake.HandshakeTimeout("the handshake finished past its deadline")
                state["done"] = True
        except ProtocolError as e:  # a rank of another version: say so where the launcher's user looks
            self._refuse(conn)
            print(f"prism-launch: capture coordinator: refused a rank: {e}", file=sys.stderr, flush=True)
            return
        except Exception:  # noqa: BLE001 - a stray client, a wrong authkey, one that closed or never spoke
            self._refuse(conn)
            return
        finally:
            timer.cancel()
            sock.close()  # the connection holds its own descriptor
        self._on_rank(conn, hello)

    def _refuse(self, conn: Connection) -> None:
        self.refused += 1
        try:
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        self._open = False
        _shutdown(self._sock)  # wake the loop blocked in accept(); close() alone does not
        self._sock.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        try:
            os.unlink(self.address)
        except OSError:
            pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
