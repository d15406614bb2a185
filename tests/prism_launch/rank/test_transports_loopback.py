"""A single-node emulation's gloo groups listen on loopback unless the user chose an interface."""

from prism_launch.rank.transports import gloo_on_loopback


def test_gloo_is_pointed_at_loopback(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    gloo_on_loopback()
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_users_interface_is_kept(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    gloo_on_loopback()
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
