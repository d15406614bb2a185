"""Tiny rank program for spawn-mode tests of prism_launch.launch.procs.

Usage: procs_worker.py MODE [ARG]
  ok            print a line to stdout and stderr, exit 0
  lines N       print N numbered lines to stdout and stderr, one raw fd-1 line, exit 0
  env PATH      dump os.environ as JSON to PATH, exit 0
  raise         raise ValueError, writing the error file in torchelastic's format
  record        raise ValueError inside torch's @record (real ErrorHandler)
  exit N        print to stderr, exit N
  sleep         sleep until killed
  ignore_term   ignore SIGTERM, then sleep until killed
  kill_self SIG die by signal SIG
  grandchild P  start a sleeping grandchild, write its pid to P, then sleep
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _sleep_forever() -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _write_error_file(exc: BaseException) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as fh:
        json.dump(data, fh)


def boom_in_spawned_worker() -> None:
    raise ValueError(f"boom from rank {_rank()}")


def main(argv: list[str]) -> int:
    mode = argv[1]
    arg = argv[2] if len(argv) > 2 else None
    if mode == "ok":
        print(f"hello stdout rank {_rank()}", flush=True)
        print(f"hello stderr rank {_rank()}", file=sys.stderr, flush=True)
        return 0
    if mode == "lines":
        for i in range(int(arg or 10)):
            print(f"rank{_rank()} out {i}")
            print(f"rank{_rank()} err {i}", file=sys.stderr)
        sys.stdout.flush()
        os.write(1, f"rank{_rank()} c-level\n".encode())  # bypasses Python's sys.stdout
        return 0
    if mode == "env":
        with open(str(arg), "w") as fh:
            json.dump(dict(os.environ), fh)
        return 0
    if mode == "raise":
        try:
            boom_in_spawned_worker()
        except ValueError as e:
            _write_error_file(e)
            raise
    if mode == "record":
        from torch.distributed.elastic.multiprocessing.errors import record

        record(boom_in_spawned_worker)()
    if mode == "exit":
        print(f"exiting with {arg}", file=sys.stderr, flush=True)
        return int(arg or 1)
    if mode == "sleep":
        _sleep_forever()
        return 0
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        _sleep_forever()
        return 0
    if mode == "kill_self":
        os.kill(os.getpid(), getattr(signal, str(arg)))
        time.sleep(5)
        return 0
    if mode == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(str(arg) + ".tmp", "w") as fh:
            fh.write(str(child.pid))
        os.replace(str(arg) + ".tmp", str(arg))
        _sleep_forever()
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
