"""Where the capture's shared-memory exchange goes: /dev/shm when it has room for every captured
rank's arena, else the fallback's file system, else nowhere (the coordinator path, said so)."""

import os
import shutil
from pathlib import Path

from nccl_ext.exchange.arena import OWNER_FILE, release_directory
from prism_launch.modes import capture as mode


def test_room_for_the_arenas_picks_a_fresh_directory(tmp_path):
    d = mode.exchange_dir(tmp_path, 1)
    try:
        assert d is not None and os.path.isdir(d) and os.listdir(d) == [OWNER_FILE]  # no arena yet
        assert Path(d).parent in (Path("/dev/shm"), tmp_path)
    finally:
        release_directory(d)


def test_no_room_anywhere_leaves_the_coordinator_path(tmp_path, capsys):
    free = shutil.disk_usage(tmp_path).free + shutil.disk_usage("/dev/shm").free
    ranks = free // mode.EXCHANGE_BYTES_PER_RANK + 1
    assert mode.exchange_dir(tmp_path, ranks) is None
    assert "every op goes through the coordinator" in capsys.readouterr().err


def test_a_killed_launchers_exchange_is_removed_by_the_next_capture(tmp_path):
    import subprocess
    import sys

    from nccl_ext.exchange import arena as exchange

    # a launcher that claims a directory, fills an arena and is SIGKILLed (no cleanup runs)
    code = ("import os, signal, sys; from nccl_ext.exchange import arena as exchange; d = exchange.claim_directory(sys.argv[1]); "
            "open(os.path.join(d, 'r0-g0'), 'wb').write(b'x' * 4096); print(d, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[3])
    dead = r.stdout.strip()
    assert r.returncode == -9 and os.path.isdir(dead), r.stderr
    old = tmp_path / "prism-exchange-old"  # no owner file (being created, or older): left alone
    old.mkdir()
    mine = exchange.claim_directory(tmp_path)  # sweeps first; then held by this process
    try:
        assert not os.path.exists(dead)
        assert old.is_dir() and os.path.isdir(mine)
        assert exchange.sweep_stale(tmp_path) == []  # a live owner's directory stays
    finally:
        exchange.release_directory(mine)
    assert not os.path.exists(mine)


def test_a_killed_launchers_coordinator_directory_is_removed_by_the_next_capture(tmp_path):
    import subprocess
    import sys

    from nccl_ext.exchange import arena as exchange
    from prism_launch.modes.capture import COORDINATOR_DIR_PREFIX

    code = ("import os, signal, sys; from nccl_ext.exchange import arena as exchange; "
            f"d = exchange.claim_directory(sys.argv[1], prefix={COORDINATOR_DIR_PREFIX!r}); "
            "open(os.path.join(d, 'coord.sock'), 'wb').close(); print(d, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[3])
    dead = r.stdout.strip()
    assert r.returncode == -9 and os.path.isdir(dead) and os.path.basename(dead).startswith(COORDINATOR_DIR_PREFIX)
    mine = exchange.claim_directory(tmp_path, prefix=COORDINATOR_DIR_PREFIX)
    try:
        assert not os.path.exists(dead) and os.path.isdir(mine)
    finally:
        exchange.release_directory(mine)


def test_a_deep_temporary_directory_puts_the_coordinators_socket_under_tmp(monkeypatch):
    """The coordinator's socket goes under TMPDIR while its path fits a Unix socket, else under
    /tmp; where neither fits, the error names TMPDIR."""
    import socket

    import pytest

    from nccl_ext.exchange import arena as exchange
    from prism_launch.errors import PrismError
    from prism_launch.modes import capture
    from prism_launch.modes.capture import COORDINATOR_DIR_PREFIX, COORDINATOR_SOCKET, coordinator_base

    short = "/tmp/pt-x"
    assert coordinator_base(short) == short
    deep = "/tmp/" + "d" * 80
    assert coordinator_base(deep) == "/tmp"
    d = exchange.claim_directory(coordinator_base(deep), prefix=COORDINATOR_DIR_PREFIX)
    try:  # the longest name it makes binds
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.join(d, COORDINATOR_SOCKET))
        s.close()
    finally:
        exchange.release_directory(d)
    monkeypatch.setattr(capture, "UNIX_PATH_MAX", 10)
    with pytest.raises(PrismError, match="set TMPDIR to a shorter, writable directory"):
        coordinator_base(deep)
