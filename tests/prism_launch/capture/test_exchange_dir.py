"""Where the capture's shared-memory exchange goes: /dev/shm when it has room for every captured
rank's arena, else the fallback's file system, else nowhere (the coordinator path, said so)."""

import os
import shutil
from pathlib import Path

from prism_launch.modes import capture as mode


def test_room_for_the_arenas_picks_a_fresh_directory(tmp_path):
    d = mode.exchange_dir(tmp_path, 1)
    try:
        assert d is not None and os.path.isdir(d) and os.listdir(d) == []
        assert Path(d).parent in (Path("/dev/shm"), tmp_path)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_no_room_anywhere_leaves_the_coordinator_path(tmp_path, capsys):
    free = shutil.disk_usage(tmp_path).free + shutil.disk_usage("/dev/shm").free
    ranks = free // mode.EXCHANGE_BYTES_PER_RANK + 1
    assert mode.exchange_dir(tmp_path, ranks) is None
    assert "every op goes through the coordinator" in capsys.readouterr().err
