"""The start of a capture connection, both sides, each under a deadline: the authkey's HMAC
challenge both ways (:mod:`multiprocessing.connection`'s own), then the rank's
:class:`~nccl_ext.core.protocol.Hello` answered :class:`~nccl_ext.core.protocol.Welcome`, or
:class:`~nccl_ext.core.protocol.Refused` where the protocol versions differ.

A peer that connects and says nothing, or closes half-way, costs the other side at most the
deadline — never its accept loop or its rank."""

from __future__ import annotations

import os
import socket
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from nccl_ext.core import protocol, wire
from nccl_ext.core.errors import HandshakeTimeout
from nccl_ext.core.protocol import PROTOCOL_VERSION, Hello, ProtocolError, Refused, Welcome


class _Deadlined:
    """A connection whose reads wait at most until ``deadline`` (what the challenge functions
    use of a connection: ``send_bytes``, ``recv_bytes``)."""

    def __init__(self, conn: Connection, deadline: float):
        self._conn = conn
        self._deadline = deadline

    def send_bytes(self, data) -> None:
        self._conn.send_bytes(data)

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        self.wait()
        return self._conn.recv_bytes(maxlength)

    def wait(self) -> None:
        if not self._conn.poll(max(0.0, self._deadline - time.monotonic())):
            raise HandshakeTimeout("the peer sent nothing more before the deadline")


def serve(conn: Connection, authkey: bytes, timeout_s: float) -> Hello:
    """The coordinator's side, on a connection just accepted: the rank's :class:`Hello` once it
    proved the authkey and speaks this protocol version (it is told :class:`Welcome`); raises
    (the caller closes the connection) otherwise — :class:`ProtocolError` after telling the rank
    :class:`Refused` with both versions."""
    peer = _Deadlined(conn, time.monotonic() + timeout_s)
    deliver_challenge(peer, authkey)
    answer_challenge(peer, authkey)
    peer.wait()
    header, _ = wire.recv(conn)
    if not isinstance(header, tuple) or not header or header[0] != Hello.TAG or len(header) < 2:
        raise ProtocolError(f"capture protocol: a connection's first message is {header!r:.80}, not a hello")
    try:
        protocol.check_version(header[1], f"rank {header[2] if len(header) > 2 else '?'}")
    except ProtocolError as e:
        try:
            wire.send(conn, protocol.encode(Refused(str(e))))
        except OSError:
            pass
        raise
    hello = protocol.decode(header)
    wire.send(conn, protocol.encode(Welcome(PROTOCOL_VERSION)))
    return hello


def connect(address: str, authkey: bytes, rank: int, timeout_s: float) -> Connection:
    """The rank's side: a connection to the coordinator at ``address`` that has passed the
    handshake within ``timeout_s``; errors name the rank and the address."""
    deadline = time.monotonic() + timeout_s
    where = f"rank {rank}: connecting to the capture coordinator at {address}"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.setblocking(True)
    except OSError as e:
        sock.close()
        raise ConnectionError(f"{where}: {e} (within comm.timeout_s={timeout_s:g}s)") from e
    conn = Connection(sock.detach())
    try:
        peer = _Deadlined(conn, deadline)
        answer_challenge(peer, authkey)
        deliver_challenge(peer, authkey)
        wire.send(conn, protocol.encode(Hello(PROTOCOL_VERSION, rank, os.getpid())))
        peer.wait()
        header, _ = wire.recv(conn)
    except HandshakeTimeout as e:
        conn.close()
        raise HandshakeTimeout(f"{where}: the handshake did not finish within comm.timeout_s={timeout_s:g}s "
                               "(is the launcher's coordinator still running?)") from e
    except (OSError, EOFError, AuthenticationError) as e:
        conn.close()
        raise ConnectionError(f"{where}: the handshake failed ({type(e).__name__}: {e}); a wrong authkey "
                              "or a coordinator that went away") from e
    reply = protocol.decode(header)
    if isinstance(reply, Refused):
        conn.close()
        raise ProtocolError(f"{where}: refused: {reply.reason}")
    if not isinstance(reply, Welcome):
        conn.close()
        raise ProtocolError(f"{where}: the coordinator answered the hello with {reply!r:.80}")
    try:
        protocol.check_version(reply.version, "the coordinator")
    except ProtocolError as e:
        conn.close()
        raise ProtocolError(f"{where}: {e}") from None
    return conn
