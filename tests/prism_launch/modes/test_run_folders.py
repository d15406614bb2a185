"""Log folders are new per run and private, like torchrun's (never an existing one reused)."""

import os
import stat
from types import SimpleNamespace

from prism_launch.config import Mode
from prism_launch.modes.context import RunContext


def test_each_phase_gets_a_new_private_folder(tmp_path):
    ctx = SimpleNamespace(log_root=tmp_path / "logs", run_id="abc")
    planted = tmp_path / "logs" / "abc-capture"
    planted.mkdir(parents=True)  # the predictable name of earlier versions: not used
    a = RunContext.log_dir(ctx, Mode.capture)
    b = RunContext.log_dir(ctx, Mode.capture)
    assert a != b and a.parent == b.parent == tmp_path / "logs"
    assert a.name.startswith("abc-capture-") and planted not in (a, b)
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o700
    c = RunContext.log_dir(SimpleNamespace(log_root=None, run_id="abc"), Mode.emulate)
    assert stat.S_IMODE(os.stat(c).st_mode) == 0o700
    c.rmdir()
