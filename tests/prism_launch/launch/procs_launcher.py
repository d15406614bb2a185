"""Runs a RankProcesses in its own process, for the launcher-death tests.

Usage: procs_launcher.py fork|spawn LOG_DIR PID_FILE
Starts two ranks that sleep, writes {"launcher": pid, "ranks": {rank: pid}} to
PID_FILE, then waits (bounded) for them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from prism_launch.launch.procs import RankProcesses, RankSpec, Std

WORKER = str(Path(__file__).with_name("procs_worker.py"))


def sleeper(spec: RankSpec) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def main() -> int:
    method, log_dir, pid_file = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    spawn = method == "spawn"
    specs = [
        RankSpec(rank=r, env={"RANK": str(r)}, argv=[sys.executable, WORKER, "sleep"] if spawn else None)
        for r in range(2)
    ]
    procs = RankProcesses(
        specs,
        start_method="spawn" if spawn else "fork",
        target=None if spawn else sleeper,
        log_dir=log_dir,
        redirects=Std.ALL,
        tee=Std.NONE,
        teardown_timeout_s=1.0,
    )
    with procs:
        procs.start()
        with open(pid_file + ".tmp", "w") as fh:
            json.dump({"launcher": os.getpid(), "ranks": procs.pids}, fh)
        os.replace(pid_file + ".tmp", pid_file)
        procs.wait(timeout_s=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
