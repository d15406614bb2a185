"""The launcher never waits for good on a rank that cannot finish (prism_launch/launch/heartbeat.py,
procs.RankProcesses.wait): a running rank whose heartbeat stopped — stopped, or stuck holding
the interpreter — ends the wait naming it, while a rank that never beats (not started through
prism) and a rank that beats are left to run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from prism_launch.launch import heartbeat
from prism_launch.launch.heartbeat import Heartbeats, RanksStoppedError, heartbeat_path
from prism_launch.launch.procs import RankProcesses, RankSpec, Std


def _beating_then_sleeping(spec: RankSpec) -> int:
    """A rank that starts its heartbeat and then sleeps (alive, beating) for 60 s."""
    heartbeat.start(every_s=0.05)
    time.sleep(60)
    return 0


def _silent(spec: RankSpec) -> int:
    time.sleep(60)
    return 0


def _procs(tmp_path: Path, target) -> RankProcesses:
    return RankProcesses([RankSpec(rank=0, env={"RANK": "0"}), RankSpec(rank=1, env={"RANK": "1"})],
                         start_method="fork", target=target, log_dir=tmp_path, redirects=Std.ALL, tee=Std.NONE,
                         teardown_timeout_s=2.0)


def test_a_stopped_rank_ends_the_wait_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "CHECK_S", 0.05)
    procs = _procs(tmp_path, _beating_then_sleeping)
    try:
        procs.start()
        beats = procs.heartbeats(limit_s=0.5)
        end = time.monotonic() + 10
        while not heartbeat_path(tmp_path / "1" / "error.json").exists() and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(procs.pids[1], signal.SIGSTOP)  # alive, its heartbeat thread stopped with it
        t0 = time.monotonic()
        with pytest.raises(RanksStoppedError, match=r"rank 1 \(pid \d+\) stopped: no heartbeat for \d+ s.*"
                           r"comm.timeout_s=0.5") as e:
            procs.wait(30, heartbeats=beats)
        assert time.monotonic() - t0 < 5.0  # not the 30 s run limit
        assert [s.rank for s in e.value.stopped] == [1]
    finally:
        procs.close("test end")


def test_ranks_that_never_beat_are_not_judged(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "CHECK_S", 0.05)
    procs = _procs(tmp_path, _silent)
    try:
        procs.start()
        with pytest.raises(Exception) as e:
            procs.wait(1.0, heartbeats=procs.heartbeats(limit_s=0.2))
        assert type(e.value).__name__ == "RanksTimeoutError"  # the run's own limit, not a heartbeat
    finally:
        procs.close("test end")


def test_a_file_older_than_since_is_not_the_ranks(tmp_path):
    path = tmp_path / "0" / "heartbeat"
    path.parent.mkdir()
    path.touch()
    old = time.time() - 100
    os.utime(path, (old, old))
    assert Heartbeats({0: path}, limit_s=1.0, since=time.time()).stopped({0: 123}) == []
    beats = Heartbeats({0: path}, limit_s=1.0)
    (stopped,) = beats.stopped({0: 123})
    assert stopped.rank == 0 and stopped.pid == 123 and stopped.age_s > 99
