"""The store an emulation's physical processes meet through, kept theirs.

- A single-node run's store listens on 127.0.0.1 only: torch's TCPStore binds every interface
  whatever host it is given, so the launcher binds the listening socket itself and hands it
  over (``master_listen_fd``; checked with torch 2.13's libuv server; a torch whose libuv
  server refuses a socket gets the older server, which has taken one since torch 2.0). Gloo, which listens on the interface the host name resolves to, is pointed at
  loopback by the plan (``EmulatePlan.loopback``) unless ``GLOO_SOCKET_IFNAME`` is set.
- Every key the run writes or reads sits under a secret prefix
  (``EmulatePlan.store_prefix``, in the 0600 plan file): one who reaches the store (any local
  user can reach loopback; a multi-node store listens on the network) cannot name the run's
  summaries or its groups' addresses. On one node it is random; on several, node 0 publishes a
  random per-run nonce and every node derives the prefix from it and the trace's manifest,
  which every node holds and the network does not.

Multi-node runs still assume a trusted network, as torchrun's do (README: "Trust model")."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import secrets
import socket
from pathlib import Path

__all__ = ["NONCE_KEY", "is_loopback", "loopback_store", "network_store", "node_prefix", "random_prefix"]

NONCE_KEY = "prism/run-nonce"
"""The one key outside the secret prefix: node 0's per-run nonce (useless without the trace)."""


def random_prefix() -> str:
    return f"prism/{secrets.token_hex(16)}/"


def node_prefix(manifest: Path, nonce: str) -> str:
    """The prefix every node of a multi-node run derives alike: keyed by the trace's manifest."""
    key = hashlib.sha256(Path(manifest).read_bytes()).digest()
    return f"prism/{hmac.new(key, nonce.encode(), hashlib.sha256).hexdigest()[:32]}/"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def loopback_store(timeout: datetime.timedelta, host: str = "127.0.0.1", port: int = 0):
    """A master TCPStore listening on ``host`` (a loopback address) only; ``.port`` is its port."""
    import torch.distributed as dist

    host = "127.0.0.1" if host == "localhost" else host
    try:
        return _store_on(dist, _bound(host, port), timeout, use_libuv=True)
    except (TypeError, RuntimeError, ValueError):
        # a torch whose libuv server will not take a socket: its older server always has
        return _store_on(dist, _bound(host, port), timeout, use_libuv=False)


def _store_on(dist, sock: socket.socket, timeout: datetime.timedelta, *, use_libuv: bool):
    host, port = sock.getsockname()[:2]
    fd = sock.detach()  # the store's server owns the socket from here
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                             master_listen_fd=fd, use_libuv=use_libuv)
    except BaseException:
        socket.close(fd)
        raise


def network_store(host: str, port: int, *, master: bool, timeout: datetime.timedelta):
    """Node ``master``'s store at ``host:port`` of a multi-node run (bound to loopback only when
    the endpoint itself is a loopback address), or a client of it."""
    import torch.distributed as dist

    if master and is_loopback(host):
        return loopback_store(timeout, host, port)
    return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=timeout)


def run_prefix(store, *, master: bool, manifest: Path, timeout: datetime.timedelta) -> str:
    """A multi-node run's key prefix: node 0 publishes a fresh nonce, every node (node 0 too)
    derives the prefix from it and the trace's manifest."""
    if master:
        store.set(NONCE_KEY, secrets.token_hex(16))
    store.wait([NONCE_KEY], timeout)
    return node_prefix(manifest, store.get(NONCE_KEY).decode())
