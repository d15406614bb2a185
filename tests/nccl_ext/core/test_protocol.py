"""The capture protocol: every message round-trips through its wire form as its own type, both
sides handle every message of the other, and a peer of another version is refused by name."""

import os
import threading
from multiprocessing.connection import Client

import pytest

from nccl_ext.core import handshake, protocol, wire
from nccl_ext.core.protocol import PROTOCOL_VERSION, RANK_MESSAGES, REPLIES, Coll, ProtocolError, XRead


def _sample(cls):
    return cls(*range(len(cls._fields)))


@pytest.mark.parametrize("cls", [*RANK_MESSAGES.values(), *REPLIES.values()], ids=lambda c: c.__name__)
def test_every_message_round_trips_as_its_own_type(cls):
    m = _sample(cls)
    header = protocol.encode(m)
    assert type(header) is tuple and header[0] == cls.TAG
    back = protocol.decode(header)
    assert type(back) is cls and back == m and back._fields == cls._fields


def test_defaults_travel_and_unknown_or_misshapen_messages_are_named():
    assert protocol.encode(XRead(3)) == ("xread", 3, None)
    with pytest.raises(ProtocolError, match="unknown message.*'nope'"):
        protocol.decode(("nope", 1))
    with pytest.raises(ProtocolError, match="'coll' message has 2 fields.*has 12"):
        protocol.decode(("coll", 1, 2))


def test_the_wire_form_of_a_collective_is_a_plain_tuple():
    m = Coll(1, "tp", 2, "all_reduce", "all_reduce", "sum", None, True, 0, 0.0, 0.0, 0.0)
    assert protocol.encode(m) == ("coll", *m)


def test_the_rank_handles_every_reply():
    from nccl_ext.capture.link import CoordinatorLink
    from nccl_ext.capture.transport import CaptureTransport

    rank = CaptureTransport.__new__(CaptureTransport)  # no coordinator: only its table
    rank._link = CoordinatorLink.__new__(CoordinatorLink)
    after_handshake = set(REPLIES.values()) - set(protocol.HANDSHAKE)
    assert set(rank._reply_table()) == after_handshake, "a reply the rank cannot handle (or a handler of none)"


def test_the_coordinator_handles_every_rank_message(tmp_path):
    from prism_launch.capture.coordinator import Coordinator

    c = Coordinator(str(tmp_path / "c.sock"), b"k" * 16, 2, 30.0)
    try:
        assert set(c._handlers) == set(RANK_MESSAGES.values()), "a message the coordinator cannot handle"
        assert set(RANK_MESSAGES.values()) >= {protocol.Hello} and not set(RANK_MESSAGES.values()) & set(REPLIES.values())
    finally:
        c.close()


def test_a_rank_of_another_version_is_refused_by_name(tmp_path):
    from prism_launch.capture.listener import RankListener

    got = []
    address = str(tmp_path / "c.sock")
    listener = RankListener(address, b"k" * 16, lambda conn, hello: got.append(hello), handshake_s=5.0)
    listener.start()
    try:
        conn = Client(address, family="AF_UNIX", authkey=b"k" * 16)
        wire.send(conn, ("hello", PROTOCOL_VERSION + 1, 3, os.getpid()))
        assert conn.poll(5)
        reply = protocol.decode(wire.recv(conn)[0])
        assert isinstance(reply, protocol.Refused)
        assert f"rank 3 speaks version {PROTOCOL_VERSION + 1}, this side version {PROTOCOL_VERSION}" in reply.reason
        assert not got
    finally:
        listener.close()


def test_a_coordinator_of_another_version_is_refused_by_the_rank(tmp_path, monkeypatch):
    from multiprocessing.connection import Listener

    address = str(tmp_path / "c.sock")
    listener = Listener(address, family="AF_UNIX", authkey=b"k" * 16)

    def old_coordinator():
        conn = listener.accept()
        wire.recv(conn)
        wire.send(conn, ("welcome", PROTOCOL_VERSION + 5))

    threading.Thread(target=old_coordinator, daemon=True).start()
    with pytest.raises(ProtocolError, match=rf"rank 2: connecting to the capture coordinator at {address}.*"
                                            rf"speaks version {PROTOCOL_VERSION + 5}, this side version "
                                            rf"{PROTOCOL_VERSION}"):
        handshake.connect(address, b"k" * 16, 2, 5.0)
    listener.close()


def test_a_rank_gives_up_on_a_silent_coordinator_by_its_deadline(tmp_path):
    import socket
    import time

    address = str(tmp_path / "c.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(address)
    s.listen(4)  # accepts at the kernel's level, never speaks
    t0 = time.monotonic()
    with pytest.raises(handshake.HandshakeTimeout, match=rf"rank 5: connecting to the capture coordinator at "
                                                         rf"{address}: .*within comm.timeout_s=0.3s"):
        handshake.connect(address, b"k" * 16, 5, 0.3)
    assert time.monotonic() - t0 < 5
    s.close()
