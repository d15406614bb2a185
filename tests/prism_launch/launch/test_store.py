"""The emulation's store: a single-node one listens on loopback only; every node of a
multi-node run derives the same secret key prefix, which depends on the trace it holds."""

import datetime
import socket

import pytest
import torch.distributed as dist

from prism_launch.launch.store import NONCE_KEY, loopback_store, network_store, node_prefix, random_prefix, run_prefix

T = datetime.timedelta(seconds=10)


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                out.append(addr)
    return out


def test_single_node_store_listens_on_loopback_only():
    store = loopback_store(T)
    assert _listening(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=T)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_the_default_tcpstore_would_listen_everywhere():
    """Why the store binds its socket itself (if torch changes this, the test says so)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    assert set(_listening(store.port)) & {"00000000", "00000000000000000000000000000000"}


def test_a_loopback_endpoint_of_a_multi_node_run_stays_on_loopback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = network_store("127.0.0.1", port, master=True, timeout=T)
    assert _listening(port) == ["0100007F"]
    del store


def test_every_node_derives_the_same_prefix_and_it_needs_the_trace(tmp_path):
    manifest = tmp_path / "manifest.json"
    manifest.write_text('{"files": {}}')
    master = loopback_store(T)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=T)
    p0 = run_prefix(master, master=True, manifest=manifest, timeout=T)
    p1 = run_prefix(client, master=False, manifest=manifest, timeout=T)
    assert p0 == p1 and p0.startswith("prism/") and len(p0) > 32
    nonce = master.get(NONCE_KEY).decode()
    other = tmp_path / "other.json"
    other.write_text('{"files": {"x": "y"}}')
    assert node_prefix(other, nonce) != p0  # one without the trace cannot name the keys
    assert run_prefix(master, master=True, manifest=manifest, timeout=T) != p0  # a fresh nonce per run
    assert random_prefix() != random_prefix()


def test_keys_under_the_prefix_are_out_of_reach_without_it():
    master = loopback_store(T)
    prefix = random_prefix()
    dist.PrefixStore(prefix, master).set("prism/summary/3", "mine")
    outsider = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=1))
    assert not outsider.check(["prism/summary/3"])
    with pytest.raises(Exception):
        outsider.get("prism/summary/3")


def test_the_older_server_takes_the_bound_socket_too():
    """The fallback for a torch whose libuv server refuses a socket."""
    from prism_launch.launch.store import _bound, _store_on

    store = _store_on(dist, _bound("127.0.0.1", 0), T, use_libuv=False)
    assert not store.libuvBackend and _listening(store.port) == ["0100007F"]
