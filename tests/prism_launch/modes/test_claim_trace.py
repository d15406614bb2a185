"""A run claims its trace: a capture exclusively (and clears what gone captures left), an
emulation shared (and puts back a trace a killed swap set aside)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from prism_launch.modes import claim_trace
from prism_launch.trace import TraceBusyError, TraceLayout
from prism_launch.trace.durable import host_tag


def _ctx(root):
    return SimpleNamespace(trace=TraceLayout(root))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_capture_clears_gone_writers_and_an_emulation_restores(tmp_path, capsys):
    root = tmp_path / "trace"
    gone = tmp_path / f".trace.partial-{_dead_pid()}-{host_tag()}00c0ffee"
    gone.mkdir()
    aside = tmp_path / f".trace.old-{_dead_pid()}-{host_tag()}00c0ffee"
    aside.mkdir()
    (aside / "manifest.json").write_text("{}")
    with claim_trace(_ctx(root), write=False):  # a reader: puts the trace back, leaves staging alone
        assert (root / "manifest.json").exists() and gone.exists()
        with pytest.raises(TraceBusyError, match=rf"pid {os.getpid()} .*\(reading\)"):
            claim_trace(_ctx(root), write=True)
    with claim_trace(_ctx(root), write=True):
        assert not gone.exists()
    err = capsys.readouterr().err
    assert "put back the previous trace" in err and f"removed {gone}" in err
