"""What a capture killed mid-way leaves beside its trace, and how the next run puts it right:
staging directories of writers that are gone are removed (those of live writers kept), and a
trace set aside between the two renames of the fallback swap is put back."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from prism_launch.trace import TraceReader
from prism_launch.trace.durable import (StagingOwner, cleanup_stale_partials, host_tag, recover_interrupted_swap,
                                        staging_path)
from tests.prism_launch.trace.sample_trace import write_sample


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_staging_names_carry_the_writer(tmp_path):
    owner = StagingOwner.parse(staging_path(tmp_path / "trace").name)
    assert (owner.name, owner.tag, owner.pid, owner.host) == ("trace", "partial", os.getpid(), host_tag())
    assert owner.dead() is False


def test_only_leftovers_of_gone_writers_are_removed(tmp_path):
    dead = tmp_path / f".trace.partial-{_dead_pid()}-{host_tag()}0badf00d"
    live = tmp_path / f".trace.partial-{os.getpid()}-{host_tag()}0badf00d"
    other_trace = tmp_path / f".other.partial-{_dead_pid()}-{host_tag()}0badf00d"
    foreign = tmp_path / f".trace.partial-{_dead_pid()}-{'f' * 8}0badf00d"  # another host: by age only
    for d in (dead, live, other_trace, foreign):
        d.mkdir()
        (d / "events.parquet").write_bytes(b"x")
    assert cleanup_stale_partials(tmp_path, name="trace") == [dead]
    assert live.exists() and other_trace.exists() and foreign.exists()
    old = time.time() - 7200
    os.utime(foreign, (old, old))
    assert cleanup_stale_partials(tmp_path, name="trace") == [foreign]


_KILLED_MID_SWAP = textwrap.dedent("""
    import os, signal, sys
    import torch
    import prism_launch.trace.durable as durable
    from tests.prism_launch.trace.sample_trace import write_sample

    durable._rename_exchange = lambda a, b: False  # a file system without renameat2
    real, calls = os.rename, []

    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:  # the old trace is aside, the new one not yet in: killed here
            os.kill(os.getpid(), signal.SIGKILL)
        real(a, b)

    os.rename = rename
    write_sample(sys.argv[1], extra={"gen": 2})
""")


def test_a_trace_set_aside_by_a_killed_swap_is_put_back(tmp_path):
    path = tmp_path / "trace"
    write_sample(path, extra={"gen": 1})
    p = subprocess.run([sys.executable, "-c", _KILLED_MID_SWAP, str(path)], cwd=os.getcwd(),
                       env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert not path.exists()
    names = sorted(n.split("-")[0] for n in os.listdir(tmp_path))
    assert names == [".trace.old", ".trace.partial"], names
    # the set-aside copy is the only one: cleanup keeps it, recovery puts it back
    removed = cleanup_stale_partials(tmp_path, name="trace")
    assert [r.name.split("-")[0] for r in removed] == [".trace.partial"]
    back = recover_interrupted_swap(path)
    assert back is not None and back.name.startswith(".trace.old-")
    assert TraceReader(path).manifest.extra == {"gen": 1}
    assert os.listdir(tmp_path) == ["trace"]
    assert recover_interrupted_swap(path) is None  # nothing more to do


def test_a_live_writer_mid_swap_is_left_alone(tmp_path):
    path = tmp_path / "trace"
    aside = tmp_path / f".trace.old-{os.getpid()}-{host_tag()}0badf00d"
    aside.mkdir()
    assert recover_interrupted_swap(path) is None and aside.exists()
